"""The importer's GEMM and Conv kernels: every candidate of every task gives ONNX Runtime's result.

Each candidate is forced through the public dispatch table (``graph.dispatch_table.record``) at
its own batch size, so a candidate the tuner would never pick on this machine is still run and
checked. The shapes are chosen against the packed GEMM's blocking (6x16 micro-tiles, 72-row A
blocks, K in blocks of at most 256, column chunks of at most 256): odd M, N and K, K across a
block boundary, more rows than one A block, and Conv geometries with groups, depthwise, strides,
dilations, asymmetric pads, 1-D, 1x1 with and without stride, plus the fused residual ``Add``.
"""

from __future__ import annotations


import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine_onnx  # noqa: E402
from onnx_support import candidate_entries, ort_output, random_initializer  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4


def _model(nodes, x_shape, y_shape, inits, extra_inputs=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])
    ins = [x] + [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *s]) for n, s in extra_inputs]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *y_shape])
    graph = helper.make_graph(nodes, "kernels", ins, [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check_every_candidate(model, inputs_at) -> list[tuple[str, ...]]:
    """Runs the model once per candidate index (index i at batch i + 1, clipped per task) and
    compares each run with ONNX Runtime; returns the tasks' entry names."""
    graph = engine_onnx.convert(model).build()
    counts = graph.dispatch_table.candidates_per_task
    for i in range(max(counts)):
        batch = i + 1
        graph.dispatch_table.record((batch,), tuple(min(i, c - 1) for c in counts))
        feeds = inputs_at(batch)
        expected = ort_output(model, feeds)
        actual = graph.run_async(list(feeds.values()))[0].numpy()
        scale = float(np.abs(expected).max())
        entries = [e[min(i, len(e) - 1)] for e in candidate_entries(graph)]
        np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale,
                                   err_msg=f"candidates {entries}")
    return candidate_entries(graph)


CONVS = {
    # name: (C, H, W, OC, kernel, attrs)
    "3x3_pad1": (5, 11, 13, 7, [3, 3], {"pads": [1, 1, 1, 1]}),
    "k_over_block_rows_over_block": (40, 9, 10, 77, [3, 3], {"pads": [1, 1, 1, 1]}),
    "stride2_asym_pads": (6, 15, 14, 9, [3, 3], {"pads": [0, 1, 2, 1], "strides": [2, 2]}),
    "dilation2": (4, 12, 12, 5, [3, 3], {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "5x5_stride3": (3, 17, 19, 8, [5, 5], {"strides": [3, 3], "pads": [2, 1, 2, 1]}),
    "one_by_one": (33, 7, 9, 70, [1, 1], {}),
    "one_by_one_stride2": (8, 9, 9, 13, [1, 1], {"strides": [2, 2]}),
    "grouped": (12, 8, 8, 18, [3, 3], {"group": 3, "pads": [1, 1, 1, 1]}),
    "depthwise_s1": (16, 14, 14, 16, [3, 3], {"group": 16, "pads": [1, 1, 1, 1]}),
    "depthwise_s2": (8, 15, 16, 8, [3, 3], {"group": 8, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "depthwise_multiplier_dilated": (4, 13, 11, 8, [3, 5], {"group": 4, "pads": [2, 1, 0, 3],
                                                            "dilations": [2, 1], "strides": [1, 2]}),
    "wide_image": (3, 40, 41, 6, [3, 3], {"pads": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_every_conv_candidate_matches_onnxruntime(name):
    c, h, w, oc, kernel, attrs_ = CONVS[name]
    rng = np.random.default_rng(len(name))
    group = attrs_.get("group", 1)
    weight = random_initializer(rng, "w", [oc, c // group, *kernel])
    bias = random_initializer(rng, "b", [oc])
    node = helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs_)
    probe = onnx.shape_inference.infer_shapes(_model([node, helper.make_node("Relu", ["c"], ["y"])],
                                                     [c, h, w], [oc, "oh", "ow"], [weight, bias]))
    out = [d.dim_value for d in probe.graph.output[0].type.tensor_type.shape.dim][1:]
    model = _model([node, helper.make_node("Relu", ["c"], ["y"])], [c, h, w], out, [weight, bias])
    entries = _check_every_candidate(
        model, lambda b: {"x": np.random.default_rng(b).standard_normal((b, c, h, w)).astype(np.float32)})
    (conv,) = entries
    assert {"conv_direct", "conv_implicit", "conv_im2col_blocked", "conv_im2col_packed"} <= set(conv)
    assert ("conv_depthwise" in conv) == (c == group)


def test_one_dimensional_conv_candidates_match_onnxruntime():
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[2, 1], strides=[2], dilations=[2])]
    model = _model(nodes, [6, 37], [10, 18], [random_initializer(rng, "w", [10, 6, 3])])
    _check_every_candidate(
        model, lambda b: {"x": np.random.default_rng(b).standard_normal((b, 6, 37)).astype(np.float32)})


@pytest.mark.parametrize("op", ["Add", "Sum"])
def test_conv_batchnorm_add_relu_is_one_kernel_reading_the_residual(op):
    """ResNet's block tail: the BatchNormalization is folded, the Add (a ``Sum`` in older exports)
    and the Relu fused, so the graph has two Conv kernels and nothing else; every candidate still
    matches."""
    rng = np.random.default_rng(2)
    inits = [random_initializer(rng, "w1", [8, 8, 3, 3]), random_initializer(rng, "w2", [8, 8, 3, 3]),
             helper.make_tensor("scale", TensorProto.FLOAT, [8], rng.uniform(0.5, 1.5, 8).astype(np.float32)),
             random_initializer(rng, "shift", [8]), random_initializer(rng, "mean", [8]),
             helper.make_tensor("var", TensorProto.FLOAT, [8], rng.uniform(0.5, 2.0, 8).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
             helper.make_node(op, ["x", "n"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = _model(nodes, [8, 10, 10], [8, 10, 10], inits)
    entries = _check_every_candidate(
        model, lambda b: {"x": np.random.default_rng(b).standard_normal((b, 8, 10, 10)).astype(np.float32)})
    assert len(entries) == 2 and all("conv_implicit" in e for e in entries)


def test_a_residual_computed_later_is_not_fused_and_still_correct():
    """The Add's other operand comes after the Conv in node order: the Conv cannot read it yet, so
    the Add stays a kernel of its own."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["x"], ["later"]),
             helper.make_node("Add", ["c", "later"], ["y"])]
    model = _model(nodes, [4, 6, 6], [4, 6, 6], [random_initializer(rng, "w", [4, 4, 3, 3])])
    entries = _check_every_candidate(
        model, lambda b: {"x": np.random.default_rng(b).standard_normal((b, 4, 6, 6)).astype(np.float32)})
    assert len(entries) >= 2


GEMMS = {"odd": (7, 13, 5), "k_over_block": (9, 300, 33), "rows_over_block": (150, 70, 41),
         "wide": (3, 40, 600), "vector": (1, 513, 17)}


@pytest.mark.parametrize("name", sorted(GEMMS))
def test_every_matmul_and_gemm_candidate_matches_onnxruntime(name):
    m, k, n = GEMMS[name]
    rng = np.random.default_rng(m * k + n)
    inits = [random_initializer(rng, "bm", [k, n]), random_initializer(rng, "wg", [n, n]), random_initializer(rng, "cg", [n])]
    nodes = [helper.make_node("MatMul", ["x", "bm"], ["p"]),
             helper.make_node("Reshape", ["p", "shape"], ["q"]),
             helper.make_node("Gemm", ["q", "wg", "cg"], ["g"], transB=1, alpha=0.5),
             helper.make_node("Tanh", ["g"], ["y"])]
    inits.append(helper.make_tensor("shape", TensorProto.INT64, [2], [-1, n]))
    model = _model(nodes, [m, k], [n], inits) if m == 1 else None
    if model is None:  # rows of every batch item flattened into the Gemm's M
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", m, k])
        model = helper.make_model(helper.make_graph(nodes, "kernels", [x], [y], initializer=inits),
                                  opset_imports=[helper.make_opsetid("", 17)])
    entries = _check_every_candidate(
        model, lambda b: {"x": np.random.default_rng(b).standard_normal((b, m, k)).astype(np.float32)})
    for task in entries:
        if task[0].startswith("mm_"):
            assert {"mm_simple", "mm_blocked", "mm_packed"} <= set(task)
