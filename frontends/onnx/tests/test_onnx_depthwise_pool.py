"""The depthwise and pointwise Conv candidates and the pooling kernels give ONNX Runtime's results.

Both read a padded, stride-phase-split copy of each plane (``engine_onnx/ops/phase_plane.py``) with
whole 8-float vectors per output row, so the geometries are chosen against that layout: planes
narrower than one vector (1x1, 2x3, 7x7), one vector and a tail (13, 14), whole vectors (56), odd
widths, stride 1, 2 (the shuffle split, with and without its vector loop) and 3 (the generic
split), padding 0, 1 and asymmetric, dilation, a depth multiplier, a 1-D plane; and the fused
epilogues (bias, Relu, Clip(0, 6), a residual ``Add``). Pools add ceil_mode, count_include_pad and
windows that reach past the end padding, 1x1 outputs, and a plane too wide for the buffer (the
per-window path). ``conv_pointwise`` (1x1 Convs with few input channels per group) computes 6
channels x 16 pixels at a time: pixel and channel counts that are not multiples of those, groups,
one pixel. Every model has a symbolic batch and runs at batch 1 and 3; the Conv candidates are
forced through the public dispatch table, so each is checked even where the tuner would pick
another one.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine_onnx  # noqa: E402
from onnx_support import ort_output  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4
BATCHES = (1, 3)


def _model(nodes, inputs, inits):
    """``inputs``: (name, shape without the batch); the one output ``y`` has its shape inferred."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *s]) for n, s in inputs]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "depthwise_pool", ins, [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _close(actual, expected, what):
    scale = float(np.abs(expected).max()) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def _feeds(inputs, batch):
    rng = np.random.default_rng(batch)
    return {n: rng.standard_normal((batch, *s)).astype(np.float32) for n, s in inputs}


# name: (C, H, W, multiplier, kernel, Conv attributes); H == 0 makes a 1-D Conv over W.
DEPTHWISE = {
    "plane_1x1": (8, 1, 1, 1, [3, 3], {"pads": [1, 1, 1, 1]}),
    "plane_2x3": (5, 2, 3, 1, [3, 3], {"pads": [1, 1, 1, 1]}),
    "plane_7x7_s1": (12, 7, 7, 1, [3, 3], {"pads": [1, 1, 1, 1]}),
    "plane_7x7_s2": (12, 7, 7, 1, [3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "plane_13x13_s2_asym": (6, 13, 13, 1, [3, 3], {"pads": [0, 1, 1, 0], "strides": [2, 2]}),
    "plane_14x14_s1": (10, 14, 14, 1, [3, 3], {"pads": [1, 1, 1, 1]}),
    "plane_28x28_s2": (9, 28, 28, 1, [3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "plane_56x56_s1": (3, 56, 56, 1, [3, 3], {"pads": [1, 1, 1, 1]}),
    "plane_56x56_s2_unpadded": (3, 56, 56, 1, [3, 3], {"strides": [2, 2]}),
    "odd_37x29_s2": (4, 29, 37, 1, [3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "odd_33x35_s2_pad2": (4, 35, 33, 1, [5, 5], {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
    "no_padding_16x17": (5, 16, 17, 1, [3, 3], {}),
    "stride3": (4, 17, 20, 1, [3, 3], {"pads": [1, 2, 0, 1], "strides": [3, 3]}),
    "dilation2": (6, 14, 15, 1, [3, 3], {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "dilation2_stride2": (6, 20, 21, 1, [3, 3], {"pads": [2, 2, 2, 2], "dilations": [2, 2], "strides": [2, 2]}),
    "multiplier2": (6, 12, 11, 2, [3, 3], {"pads": [1, 1, 1, 1]}),
    "multiplier2_stride2": (4, 15, 18, 2, [3, 3], {"pads": [1, 0, 1, 1], "strides": [2, 2]}),
    "one_dimensional": (7, 0, 40, 1, [3], {"pads": [1, 1], "strides": [2]}),
}

EPILOGUES = ("relu", "clip6", "residual_relu", "none")


def _depthwise_model(name, epilogue, bias):
    c, h, w, mult, kernel, attrs_ = DEPTHWISE[name]
    rng = np.random.default_rng(len(name))
    oc = c * mult
    x_shape = [c, h, w] if h else [c, w]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [oc, 1, *kernel],
                                rng.standard_normal((oc, 1, *kernel)).astype(np.float32))]
    conv_in = ["x", "w"]
    if bias:
        inits.append(helper.make_tensor("b", TensorProto.FLOAT, [oc], rng.standard_normal(oc).astype(np.float32)))
        conv_in.append("b")
    conv = helper.make_node("Conv", conv_in, ["c"], group=c, **attrs_)
    probe = _model([conv, helper.make_node("Identity", ["c"], ["y"])], [("x", x_shape)], inits)
    out_shape = [d.dim_value for d in probe.graph.output[0].type.tensor_type.shape.dim][1:]
    inputs = [("x", x_shape)]
    if epilogue == "relu":
        tail = [helper.make_node("Relu", ["c"], ["y"])]
    elif epilogue == "clip6":
        inits += [helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]),
                  helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
        tail = [helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    elif epilogue == "residual_relu":
        inputs.append(("r", out_shape))
        tail = [helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    else:
        tail = [helper.make_node("Identity", ["c"], ["y"])]
    return _model([conv, *tail], inputs, inits), inputs


def _run_forced(graph, entry, feeds):
    """Runs ``graph`` with ``entry`` forced on every task that has it (candidate 0 elsewhere)."""
    entries = [tuple(c.entry for c in task.meta.candidates) for task in graph.compiled_tasks]
    forced = tuple(e.index(entry) if entry in e else 0 for e in entries)
    assert any(entry in e for e in entries), f"no task offers {entry}: {entries}"
    batch = next(iter(feeds.values())).shape[0]
    graph.dispatch_table.record((batch,), forced)
    return graph.run_async(list(feeds.values()))[0].numpy(), entries


@pytest.mark.parametrize("name", sorted(DEPTHWISE))
def test_depthwise_candidate_matches_onnxruntime(name):
    epilogue = EPILOGUES[len(name) % len(EPILOGUES)]
    model, inputs = _depthwise_model(name, epilogue, bias=len(name) % 3 != 0)
    graph = engine_onnx.convert(model).build()
    for batch in BATCHES:
        feeds = _feeds(inputs, batch)
        actual, entries = _run_forced(graph, "conv_depthwise", feeds)
        _close(actual, ort_output(model, feeds), f"{name} ({epilogue}) at batch {batch}, tasks {entries}")
    if epilogue == "residual_relu":  # the Add and Relu ran in the Conv's epilogue
        assert len(entries) == 1


@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_depthwise_epilogues_with_and_without_bias(epilogue):
    for bias in (True, False):
        model, inputs = _depthwise_model("plane_14x14_s1", epilogue, bias)
        graph = engine_onnx.convert(model).build()
        for batch in BATCHES:
            feeds = _feeds(inputs, batch)
            actual, entries = _run_forced(graph, "conv_depthwise", feeds)
            _close(actual, ort_output(model, feeds), f"{epilogue}, bias={bias}, batch {batch}")
        assert len(entries) == 1  # every epilogue is fused into the one Conv kernel


def test_every_candidate_of_a_shufflenet_depthwise_agrees():
    """The depthwise candidate and the general ones compute the same thing on ShuffleNet's shape."""
    model, inputs = _depthwise_model("plane_28x28_s2", "none", bias=True)
    graph = engine_onnx.convert(model).build()
    feeds = _feeds(inputs, 1)
    expected = ort_output(model, feeds)
    (entries,) = [tuple(c.entry for c in task.meta.candidates) for task in graph.compiled_tasks]
    for entry in entries:
        actual, _ = _run_forced(graph, entry, feeds)
        _close(actual, expected, entry)



# name: (C, H, W, OC, group): 1x1 stride-1 Convs with few input channels per group (conv_pointwise).
POINTWISE = {
    "mobilenet_expand": (16, 12, 12, 96, 1),
    "pixel_edge_and_channel_edge": (24, 7, 9, 35, 1),
    "shufflenet_grouped": (24, 14, 14, 112, 4),
    "grouped_odd": (12, 5, 7, 9, 3),
    "one_pixel": (8, 1, 1, 13, 1),
    "wide_k": (64, 4, 20, 7, 1),
}


@pytest.mark.parametrize("name", sorted(POINTWISE))
@pytest.mark.parametrize("epilogue", ["relu", "residual_relu"])
def test_pointwise_candidate_matches_onnxruntime(name, epilogue):
    c, h, w, oc, group = POINTWISE[name]
    rng = np.random.default_rng(len(name))
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [oc, c // group, 1, 1],
                                rng.standard_normal((oc, c // group, 1, 1)).astype(np.float32)),
             helper.make_tensor("b", TensorProto.FLOAT, [oc], rng.standard_normal(oc).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group)]
    inputs = [("x", [c, h, w])]
    if epilogue == "residual_relu":
        inputs.append(("r", [oc, h, w]))
        nodes += [helper.make_node("Add", ["r", "c"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    model = _model(nodes, inputs, inits)
    graph = engine_onnx.convert(model).build()
    for batch in BATCHES:
        feeds = _feeds(inputs, batch)
        actual, entries = _run_forced(graph, "conv_pointwise", feeds)
        _close(actual, ort_output(model, feeds), f"{name} ({epilogue}) at batch {batch}, tasks {entries}")
    assert len(entries) == 1  # bias, residual and Relu are the Conv kernel's epilogue

# name: (op, C, H, W, attributes); H == 0 makes a 1-D pool over W.
POOLS = {
    "avg_3x3_s2_p1_56": ("AveragePool", 5, 56, 56, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "avg_3x3_s2_p1_56_include_pad": ("AveragePool", 5, 56, 56, {"kernel_shape": [3, 3], "strides": [2, 2],
                                                                "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    "avg_3x3_s2_ceil_13": ("AveragePool", 4, 13, 13, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "avg_2x2_s2_ceil_7_include_pad": ("AveragePool", 3, 7, 7, {"kernel_shape": [2, 2], "strides": [2, 2],
                                                               "ceil_mode": 1, "count_include_pad": 1,
                                                               "pads": [1, 0, 0, 1]}),
    "avg_asym_pads_odd": ("AveragePool", 3, 14, 29, {"kernel_shape": [3, 2], "strides": [2, 3],
                                                     "pads": [0, 1, 2, 1]}),
    "avg_asym_pads_odd_include_pad": ("AveragePool", 3, 14, 29, {"kernel_shape": [3, 2], "strides": [2, 3],
                                                                 "pads": [0, 1, 2, 1], "count_include_pad": 1}),
    "avg_1x1_output": ("AveragePool", 6, 7, 7, {"kernel_shape": [7, 7]}),
    "avg_plane_1x1": ("AveragePool", 6, 1, 1, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    "avg_plane_2x3_s2": ("AveragePool", 6, 2, 3, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "avg_1d": ("AveragePool", 4, 0, 33, {"kernel_shape": [4], "strides": [2], "pads": [1, 2]}),
    "max_3x3_s2_p1_112": ("MaxPool", 3, 112, 112, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "max_3x3_s2_ceil_14": ("MaxPool", 4, 14, 14, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "max_3x3_s1_p1_7": ("MaxPool", 5, 7, 7, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    "max_2x2_s2_28": ("MaxPool", 5, 28, 28, {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "max_dilation2": ("MaxPool", 3, 15, 16, {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 1, 1, 2]}),
    "max_stride3_odd": ("MaxPool", 3, 20, 23, {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1]}),
    "max_1x1_output": ("MaxPool", 6, 2, 3, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 0]}),
    "max_1d_wider_than_the_buffer": ("MaxPool", 2, 0, 70000, {"kernel_shape": [3], "strides": [1], "pads": [1, 1]}),
    "avg_1d_wider_than_the_buffer": ("AveragePool", 2, 0, 70000, {"kernel_shape": [3], "strides": [1],
                                                                  "pads": [1, 1]}),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool_matches_onnxruntime(name):
    op, c, h, w, attrs_ = POOLS[name]
    x_shape = [c, h, w] if h else [c, w]
    nodes = [helper.make_node(op, ["x"], ["p"], **attrs_)]
    nodes.append(helper.make_node("Relu" if len(name) % 2 else "Identity", ["p"], ["y"]))
    model = _model(nodes, [("x", x_shape)], [])
    graph = engine_onnx.convert(model).build()
    for batch in BATCHES:
        feeds = _feeds([("x", x_shape)], batch)
        actual = graph.run_async(list(feeds.values()))[0].numpy()
        expected = ort_output(model, feeds)
        assert actual.shape == expected.shape
        _close(actual, expected, f"{name} at batch {batch}")

