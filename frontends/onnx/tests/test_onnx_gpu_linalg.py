"""GPU kernels of MatMul/Gemm, softmax and normalisations, and reductions (``engine_onnx.gpu``).

Each model is checked by ``onnx_support.check_gpu`` (run on the OpenCL driver against ONNX Runtime,
compiled for CUDA by NVRTC); the products, which have two candidates (``mm_simple`` and
``mm_tiled``), are also run with each candidate forced through the public dispatch table, so
both are checked whatever the tuner would pick.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnx_support import check_gpu, check_gpu_candidates, gpu_reason, small_model, value_info

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))

RNG = np.random.default_rng(0)


def _init(name, shape):
    return helper.make_tensor(name, T.FLOAT, shape, RNG.standard_normal(shape).astype(np.float32).ravel())


def _feeds(shapes: dict, batches=(1, 3)):
    """Feeds per batch; a shape starting with "batch" gets it, others are taken as they are."""
    return [{n: RNG.standard_normal([b if d == "batch" else d for d in s]).astype(np.float32)
             for n, s in shapes.items()} for b in batches]


def _mm_entries(entries):
    return [e for e in entries if "mm_tiled" in e]


# -- MatMul and Gemm ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_shape, b_shape", [
    ([17, 33], [33, 19]),
    (["batch", 4, 5, 6], [6, 7]),
    (["batch", 4, 5, 6], ["batch", 4, 6, 3]),
    (["batch", 1, 5, 6], [4, 6, 3]),
    ([6], ["batch", 6, 5]),
    (["batch", 40, 18], [18]),
    ([18], [18]),
])
def test_matmul_shapes_each_candidate(a_shape, b_shape, tmp_path) -> None:
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    m = small_model(nodes, [value_info("a", T.FLOAT, a_shape), value_info("b", T.FLOAT, b_shape)],
                    [value_info("y", T.FLOAT, None)])
    entries = check_gpu_candidates(m, _feeds({"a": a_shape, "b": b_shape}), tmp_path)
    assert _mm_entries(entries) == [("mm_simple", "mm_tiled")]


@pytest.mark.parametrize("act", ["Relu", "Gelu"])
def test_matmul_with_constant_weight_fuses_bias_and_activation(act, tmp_path) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "bias"], ["z"]),
             helper.make_node(act, ["z"], ["y"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 7, 40])], [value_info("y", T.FLOAT, None)],
               [_init("w", [40, 33]), _init("bias", [33])], opset=20)
    check_gpu_candidates(m, _feeds({"x": ["batch", 7, 40]}), tmp_path)
    names = check_gpu(m, _feeds({"x": ["batch", 7, 40]}), tmp_path)
    assert [n.rsplit("_", 1)[0] for n in names if "copy" not in n] == ["matmul"]


@pytest.mark.parametrize("trans_a, trans_b, alpha, beta, c_shape", [
    (0, 0, 1.0, 1.0, [19]),
    (1, 0, 0.5, 2.0, [1, 19]),
    (0, 1, 1.5, 0.25, [17, 19]),
    (1, 1, 1.0, -1.0, []),
    (0, 0, 2.0, 0.0, [17, 1]),
    (0, 1, 1.0, 1.0, None),
])
def test_gemm_attributes_each_candidate(trans_a, trans_b, alpha, beta, c_shape, tmp_path) -> None:
    a_shape = [33, 17] if trans_a else [17, 33]
    b_shape = [19, 33] if trans_b else [33, 19]
    inputs = ["a", "b"] + (["c"] if c_shape is not None else [])
    nodes = [helper.make_node("Gemm", inputs, ["y"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)]
    shapes = {"a": a_shape, "b": b_shape}
    if c_shape is not None:
        shapes["c"] = c_shape
    m = small_model(nodes, [value_info(n, T.FLOAT, s) for n, s in shapes.items()], [value_info("y", T.FLOAT, None)])
    entries = check_gpu_candidates(m, _feeds(shapes, batches=(1,)), tmp_path)
    assert _mm_entries(entries) == [("mm_simple", "mm_tiled")]


def test_gemm_with_constant_transposed_weight_and_batch_rows(tmp_path) -> None:
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5),
             helper.make_node("Relu", ["h"], ["y"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 50])], [value_info("y", T.FLOAT, None)],
               [_init("w", [10, 50]), _init("c", [10])])
    check_gpu_candidates(m, _feeds({"x": ["batch", 50]}), tmp_path)


# -- Softmax and normalisations -------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape, axis, opset", [
    (["batch", 3, 10], -1, 18),
    (["batch", 1030], -1, 18),
    (["batch", 5, 4], 1, 18),
    (["batch", 3, 4, 5], 1, 11),
])
def test_softmax_matches_ort(op, shape, axis, opset, tmp_path) -> None:
    m = small_model([helper.make_node(op, ["x"], ["y"], axis=axis)], [value_info("x", T.FLOAT, shape)],
               [value_info("y", T.FLOAT, None)], opset=opset)
    check_gpu(m, _feeds({"x": shape}), tmp_path)


def test_layernorm_bert_shape_with_scale_and_bias(tmp_path) -> None:
    nodes = [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-12)]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 7, 64])], [value_info("y", T.FLOAT, None)],
               [_init("s", [64]), _init("b", [64])])
    check_gpu(m, _feeds({"x": ["batch", 7, 64]}), tmp_path)


def test_layernorm_over_two_axes_with_statistics_outputs(tmp_path) -> None:
    nodes = [helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean", "inv"], axis=1)]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 30, 45])],
               [value_info("y", T.FLOAT, None), value_info("mean", T.FLOAT, None), value_info("inv", T.FLOAT, None)],
               [_init("s", [30, 45])])
    check_gpu(m, _feeds({"x": ["batch", 30, 45]}), tmp_path)


def test_standalone_batchnorm_with_constant_and_run_time_parameters(tmp_path) -> None:
    shape = ["batch", 3, 5, 4]
    var = helper.make_tensor("var", T.FLOAT, [3], RNG.uniform(0.5, 2, 3).astype(np.float32))
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),
             helper.make_node("BatchNormalization", ["a", "s", "b", "mean", "var"], ["y"], epsilon=1e-3),
             helper.make_node("BatchNormalization", ["a", "s2", "b", "mean", "var"], ["z"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, shape), value_info("s2", T.FLOAT, [3])],
               [value_info("y", T.FLOAT, None), value_info("z", T.FLOAT, None)], [_init("s", [3]), _init("b", [3]),
                                                                    _init("mean", [3]), var])
    feeds = [{**f, "s2": RNG.standard_normal(3).astype(np.float32)} for f in _feeds({"x": shape})]
    names = check_gpu(m, feeds, tmp_path)
    assert "batchnorm" in [n.rsplit("_", 1)[0] for n in names]


def test_instancenorm_with_fused_relu(tmp_path) -> None:
    nodes = [helper.make_node("InstanceNormalization", ["x", "s", "b"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 3, 9, 11])], [value_info("y", T.FLOAT, None)],
               [_init("s", [3]), _init("b", [3])])
    check_gpu(m, _feeds({"x": ["batch", 3, 9, 11]}), tmp_path)


# -- Reductions -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, axes, keepdims", [
    ("ReduceMean", [-1], 1),
    ("ReduceSum", [1], 0),
    ("ReduceMax", [0, 2], 1),
    ("ReduceMin", [1, 3], 0),
    ("ReduceProd", [2], 1),
    ("ReduceL2", None, 0),
    ("ReduceSumSquare", [1, 2], 1),
    ("ReduceL1", [3], 0),
])
def test_reductions_match_ort(op, axes, keepdims, tmp_path) -> None:
    shape = ["batch", 3, 4, 5]
    inputs = ["x"] + (["axes"] if axes is not None else [])
    inits = [helper.make_tensor("axes", T.INT64, [len(axes)], axes)] if axes is not None else []
    m = small_model([helper.make_node(op, inputs, ["y"], keepdims=keepdims)], [value_info("x", T.FLOAT, shape)],
               [value_info("y", T.FLOAT, None)], inits)
    check_gpu(m, _feeds({"x": shape}), tmp_path)


def test_integer_reduce_sum_with_attribute_axes(tmp_path) -> None:
    m = small_model([helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)],
               [value_info("x", T.INT64, ["batch", 6, 2])], [value_info("y", T.INT64, None)], opset=11)
    feeds = [{"x": RNG.integers(-100, 100, (b, 6, 2)).astype(np.int64)} for b in (1, 3)]
    check_gpu(m, feeds, tmp_path)
