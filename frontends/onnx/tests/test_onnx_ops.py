"""Op kernels of the ONNX importer beyond ONNX's node tests: every candidate of ConvTranspose, ops
on a dynamic batch, and refusals that name their reason.

ONNX's node tests (``test_onnx_backend.py``) run whichever candidate the tuner picks; here
the dispatch table is set by hand (``graph.dispatch_table.record``) so that each candidate of a
multi-candidate kernel is run and checked on its own. Expected values come from ONNX Runtime (ONNX's
reference evaluator gets grouped ConvTranspose wrong); tolerance
``|engine - ref| <= 1e-4·|ref| + 1e-4·max|ref|`` (float32).
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
ort = pytest.importorskip("onnxruntime")

import engine_onnx  # noqa: E402

RTOL = 1e-4


def _model(nodes, inputs, outputs, initializers=(), opset=19):
    graph = helper.make_graph(nodes, "ops", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _close(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale)


def _reference(model, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _run_each_candidate(model, feeds: dict, key: tuple[int, ...]) -> list[str]:
    """Run ``model`` once per candidate index of its multi-candidate task, each on a fresh graph whose
    dispatch row is set before the first run; returns the entries that ran (from ``graph.trace``)."""
    expected = _reference(model, feeds)
    builder = engine_onnx.convert(model)
    inputs = [feeds[vi.name] for vi in model.graph.input if vi.name in feeds]
    ran = []
    for c in range(2):
        graph = builder.build()
        counts = [len(task.candidates) for task in graph.compiled_tasks]
        assert max(counts) == 2, counts
        graph.dispatch_table.record(key, tuple(min(c, n - 1) for n in counts))
        for out, ref in zip(graph.run_async(inputs), expected):
            _close(out.numpy(), ref)
        events = graph.trace(inputs, warmup=0)["traceEvents"]
        ran += [e["args"]["entry"] for e in events if e.get("ph") == "X" and e["args"].get("candidate") == c
                and e["args"]["entry"].startswith("convt_")]
    return ran


CONVT_CASES = {
    "2d_stride2_pads_outpad": dict(x=(2, 3, 5, 4), w=(3, 4, 3, 3), strides=[2, 2], pads=[1, 0, 1, 2],
                                   output_padding=[1, 1]),
    "2d_groups_dilations": dict(x=(1, 4, 4, 5), w=(4, 3, 2, 3), group=2, dilations=[2, 1], strides=[1, 2]),
    "2d_output_shape": dict(x=(1, 2, 3, 3), w=(2, 2, 3, 3), strides=[3, 2], output_shape=[10, 8]),
    "2d_same_lower": dict(x=(1, 2, 4, 4), w=(2, 3, 3, 3), strides=[2, 2], auto_pad="SAME_LOWER"),
    "1d_stride3": dict(x=(2, 3, 7), w=(3, 2, 4), strides=[3], pads=[2, 1]),
    "3d_groups_outpad": dict(x=(1, 4, 3, 4, 3), w=(4, 2, 2, 3, 2), group=2, strides=[2, 1, 2],
                             output_padding=[1, 0, 0], pads=[0, 1, 0, 1, 0, 1]),
    "2d_wide_channels": dict(x=(1, 32, 6, 6), w=(32, 16, 4, 4), strides=[2, 2], pads=[1, 1, 1, 1]),
}


@pytest.mark.parametrize("name", sorted(CONVT_CASES))
def test_conv_transpose_every_candidate_matches_the_reference(name):
    cfg = dict(CONVT_CASES[name])
    xs, ws = cfg.pop("x"), cfg.pop("w")
    rng = np.random.default_rng(len(name))
    w = rng.standard_normal(ws).astype(np.float32)
    oc = ws[1] * cfg.get("group", 1)
    b = rng.standard_normal(oc).astype(np.float32)
    batch_dims = ["n", *xs[1:]]
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, batch_dims)
    y_vi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(xs))
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], **cfg),
             helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, [x_vi], [y_vi], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    x = rng.standard_normal(xs).astype(np.float32)
    assert _run_each_candidate(model, {"x": x}, (xs[0],)) == ["convt_direct", "convt_gemm"]


def test_conv_transpose_with_a_weight_computed_at_run_time():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, w.shape)]
    y_vi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)
    model = _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], group=2)], inputs, [y_vi])
    assert _run_each_candidate(model, {"x": x, "w": w}, ()) == ["convt_direct", "convt_gemm"]


def _on_a_dynamic_batch(node, shape, initializers=(), out_dtype=TensorProto.FLOAT, batches=(1, 4), rank=None):
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *shape[1:]])
    outs = [helper.make_tensor_value_info(o, out_dtype if i or node.op_type.startswith("Arg") else
                                          TensorProto.FLOAT, [None] * (rank or len(shape)))
            for i, o in enumerate(node.output)]
    model = _model([node], [x_vi], outs, initializers)
    graph = engine_onnx.convert(model).build()
    rng = np.random.default_rng(0)
    for n in batches:
        x = rng.standard_normal((n, *shape[1:])).astype(np.float32)
        for out, ref in zip(graph.run_async([x]), _reference(model, {"x": x})):
            _close(out.numpy(), ref)


def _const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_on_a_dynamic_batch(mode):
    pads = _const("pads", [0, 1, 2, 3, 0, 1, 1, 4])  # reflect needs pads < the axis size
    value = _const("v", [1.5], np.float32)
    node = helper.make_node("Pad", ["x", "pads", "v"], ["y"], mode=mode)
    _on_a_dynamic_batch(node, (0, 2, 4, 5), [pads, value])


@pytest.mark.parametrize("mode,ctm", [("nearest", "asymmetric"), ("linear", "half_pixel"),
                                      ("linear", "align_corners"), ("cubic", "pytorch_half_pixel")])
def test_resize_on_a_dynamic_batch(mode, ctm):
    # scales whose products are whole: align_corners divides by the output length, which ONNX's
    # reference takes unrounded (scale * size) and ONNX Runtime rounded; they agree on whole lengths
    scales = _const("scales", [1.0, 1.0, 1.6, 0.75], np.float32)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, coordinate_transformation_mode=ctm)
    _on_a_dynamic_batch(node, (0, 3, 5, 8), [scales])


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_large_enough_to_share_out_to_threads(mode):
    scales = _const("scales", [1.0, 1.0, 2.0, 2.0], np.float32)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode)
    _on_a_dynamic_batch(node, (0, 8, 64, 64), [scales], batches=(2,))


def test_topk_argmax_and_tile_on_a_dynamic_batch():
    _on_a_dynamic_batch(helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1), (0, 9, 3), [_const("k", [4])],
                        out_dtype=TensorProto.INT64)
    _on_a_dynamic_batch(helper.make_node("ArgMin", ["x"], ["y"], axis=2, keepdims=0, select_last_index=1),
                        (0, 2, 6), out_dtype=TensorProto.INT64, rank=2)
    _on_a_dynamic_batch(helper.make_node("Tile", ["x", "r"], ["y"]), (0, 2, 3), [_const("r", [1, 3, 2])])
    _on_a_dynamic_batch(helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-3),
                        (0, 3, 4, 4), [_const("s", [1.0, 2.0, 0.5], np.float32),
                                       _const("b", [0.0, -1.0, 3.0], np.float32)])


def test_range_over_a_dynamic_length_is_a_kernel():
    """torch's ``arange(x.shape[1])``: Range(0, Shape(x)[1], 1) with a symbolic sequence length."""
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])
    y_vi = helper.make_tensor_value_info("y", TensorProto.INT64, [None])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["y"])]
    model = _model(nodes, [x_vi], [y_vi], [_const("zero", 0), _const("one", 1)])
    graph = engine_onnx.convert(model).build()
    for n in (3, 7):
        x = np.zeros((2, n, 4), np.float32)
        (out,) = graph.run_async([x])
        _close(out.numpy(), _reference(model, {"x": x})[0])


def _refusal(node, shape, initializers=(), inputs=()):
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y_vi = helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, [None] * max(len(shape), 1))
    model = _model([node], [x_vi, *inputs], [y_vi], initializers)
    with pytest.raises(engine_onnx.UnsupportedModelError) as info:
        engine_onnx.convert(model)
    (bad,) = info.value.nodes
    assert bad.op_type == node.op_type
    return bad.reason


def test_refused_attributes_and_inputs_name_the_reason():
    w = numpy_helper.from_array(np.ones((2, 2, 2, 2, 2, 2), np.float32), "w")
    assert "4-D ConvTranspose" in _refusal(helper.make_node("ConvTranspose", ["x", "w"], ["y"]),
                                           (1, 2, 3, 3, 3, 3), [w])
    pads_in = helper.make_tensor_value_info("pads", TensorProto.INT64, [4])
    assert "pads must be known at import" in _refusal(helper.make_node("Pad", ["x", "pads"], ["y"]), (2, 3),
                                                      inputs=[pads_in])
    scales = _const("scales", [1.0, 2.0], np.float32)
    assert "antialias with mode='nearest'" in _refusal(
        helper.make_node("Resize", ["x", "", "scales"], ["y"], antialias=1), (2, 3), [scales])
    assert "resizing dynamic axis 0" in _refusal(
        helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear"), ("n", 3),
        [_const("scales", [2.0, 1.0], np.float32)])
    assert "k=5 outside [0, 3]" in _refusal(helper.make_node("TopK", ["x", "k"], ["y", "i"]), (2, 3),
                                           [_const("k", [5])])
    start = helper.make_tensor_value_info("start", TensorProto.FLOAT, [])
    assert "output length depends on them" in _refusal(
        helper.make_node("Range", ["start", "x", "x"], ["y"]), (), inputs=[start])
