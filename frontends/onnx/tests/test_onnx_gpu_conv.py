"""GPU kernels of the ONNX importer for Conv, pooling (``ops/gpu_conv.py``).

Every model is converted for ``opencl`` and run on the OpenCL driver (PoCL in CI) against ONNX
Runtime, and converted for ``cuda`` with every kernel compiled by NVRTC (``onnx_support.check_gpu``).
Where a Conv offers several candidates, each is forced in turn through the dispatch table, so every
candidate is checked, not only the one the default choice runs.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnx_support import check_gpu, check_gpu_candidates, gpu_reason, small_model, value_info

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))

RNG = np.random.default_rng(0)


def _init(name, shape, low=None, high=None):
    v = RNG.standard_normal(shape) if low is None else RNG.uniform(low, high, shape)
    return helper.make_tensor(name, T.FLOAT, shape, v.astype(np.float32).ravel())


def _feeds(shape, batches=(1, 3)):
    return [{"x": RNG.standard_normal((b, *shape)).astype(np.float32)} for b in batches]


def _single(op, shape, inits=(), inputs=None, post=(), **attrs) -> onnx.ModelProto:
    """``op`` on input ``x`` (``[batch, *shape]``) and the initializers' names, then ``post``
    nodes chained on its output; the last output is the graph's."""
    nodes = [helper.make_node(op, inputs or ["x", *[i.name for i in inits]], ["y0"], **attrs)]
    for k, (p_op, p_attrs) in enumerate(post):
        nodes.append(helper.make_node(p_op, [f"y{k}"], [f"y{k + 1}"], **p_attrs))
    return small_model(nodes, [value_info("x", T.FLOAT, ["batch", *shape])],
                       [value_info(nodes[-1].output[0], T.FLOAT, None)],
                  inits)


def _check_candidates(model, shape, tmp_path, batches=(1, 3)) -> list[tuple[str, ...]]:
    return check_gpu_candidates(model, _feeds(shape, batches), tmp_path)


def _conv_entries(entries) -> tuple[str, ...]:
    """The candidates of the one Conv task."""
    (found,) = [e for e in entries if "direct" in e]
    return found


def _conv(shape, w_shape, bias=True, **attrs) -> onnx.ModelProto:
    inits = [_init("w", w_shape)] + ([_init("b", [w_shape[0]])] if bias else [])
    return _single("Conv", shape, inits, **attrs)


@pytest.mark.parametrize("case", [
    dict(shape=[8, 12, 12], w=[16, 8, 3, 3], pads=[1, 1, 1, 1]),
    dict(shape=[8, 13, 11], w=[16, 8, 3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
    dict(shape=[8, 13, 11], w=[12, 8, 1, 1]),
    dict(shape=[3, 16, 16], w=[8, 3, 7, 7], pads=[3, 3, 3, 3], strides=[2, 2], bias=False),
    dict(shape=[8, 13, 11], w=[8, 1, 3, 3], pads=[1, 1, 1, 1], group=8),
    dict(shape=[8, 12, 12], w=[16, 1, 3, 3], pads=[1, 1, 1, 1], group=8, strides=[2, 2]),
    dict(shape=[8, 12, 12], w=[6, 4, 3, 3], group=2),
    dict(shape=[4, 13, 11], w=[8, 4, 3, 3], dilations=[2, 2], pads=[2, 1, 2, 1]),
    dict(shape=[4, 13, 11], w=[8, 4, 3, 2], pads=[0, 2, 1, 0]),
    dict(shape=[4, 13, 11], w=[6, 4, 3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(shape=[4, 13, 11], w=[6, 4, 4, 4], auto_pad="SAME_LOWER", strides=[2, 2]),
    dict(shape=[4, 13, 11], w=[5, 4, 3, 3], auto_pad="VALID", bias=False),
    dict(shape=[4, 15], w=[6, 4, 3], pads=[1, 2], strides=[2]),
], ids=["3x3", "3x3_s2_odd", "1x1", "7x7_s2_stem", "depthwise", "depthwise_x2_s2", "grouped", "dilated",
        "asymmetric_pads", "same_upper", "same_lower", "valid", "1d"])
def test_conv_every_candidate_matches_ort(case, tmp_path) -> None:
    case = dict(case)
    shape, w_shape, bias = case.pop("shape"), case.pop("w"), case.pop("bias", True)
    entries = _conv_entries(_check_candidates(_conv(shape, w_shape, bias, **case), shape, tmp_path))
    # channels per group even: oc_block; rows longer than a pixel: ow_block
    assert entries == ("direct", *(["oc_block"] if (w_shape[0] // case.get("group", 1)) % 2 == 0 else []), "ow_block")


def _bn_inits(c):
    return [_init("s", [c]), _init("beta", [c]), _init("mean", [c]), _init("var", [c], 0.5, 2.0)]


def test_conv_batchnorm_relu_is_one_kernel_with_the_folded_weights(tmp_path) -> None:
    shape = [4, 13, 11]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *shape])], [value_info("y", T.FLOAT, None)],
               [_init("w", [8, 4, 3, 3]), _init("b", [8]), *_bn_inits(8)])
    entries = _check_candidates(m, shape, tmp_path)
    assert [e for e in entries if e] == [("direct", "oc_block", "ow_block")]


def test_conv_batchnorm_residual_add_relu_reads_the_residual_in_the_kernel(tmp_path) -> None:
    shape = [6, 9, 9]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["n"]),
             helper.make_node("Add", ["x", "n"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *shape])], [value_info("y", T.FLOAT, None)],
               [_init("w", [6, 6, 3, 3]), *_bn_inits(6)])
    entries = _check_candidates(m, shape, tmp_path)
    assert [e for e in entries if e] == [("direct", "oc_block", "ow_block")]


def test_conv_clip_relu6_and_a_caffe_channel_scale_fuse(tmp_path) -> None:
    shape = [4, 10, 10]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "k"], ["s"]), helper.make_node("Add", ["s", "o"], ["a"]),
             helper.make_node("Clip", ["a", "lo", "hi"], ["y"])]
    inits = [_init("w", [8, 4, 3, 3]), _init("b", [8]), _init("k", [1, 8, 1, 1], 0.5, 2.0), _init("o", [8, 1, 1]),
             helper.make_tensor("lo", T.FLOAT, [], [0.0]), helper.make_tensor("hi", T.FLOAT, [], [6.0])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *shape])], [value_info("y", T.FLOAT, None)], inits)
    entries = _check_candidates(m, shape, tmp_path)
    assert [e for e in entries if e] == [("direct", "oc_block", "ow_block")]


def test_conv_with_a_weight_and_bias_computed_at_run_time(tmp_path) -> None:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], group=2)]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 4, 7, 9]), value_info("w", T.FLOAT, [6, 2, 3, 3]),
                       value_info("b", T.FLOAT, [6])], [value_info("y", T.FLOAT, None)])
    feeds = [{"x": RNG.standard_normal((b, 4, 7, 9)).astype(np.float32),
              "w": RNG.standard_normal((6, 2, 3, 3)).astype(np.float32),
              "b": RNG.standard_normal(6).astype(np.float32)} for b in (1, 3)]
    check_gpu(m, feeds, tmp_path)


def test_a_fire_module_end_to_end(tmp_path) -> None:
    """SqueezeNet's fire module: squeeze 1x1, then 1x1 and 3x3 expands concatenated."""
    shape = [8, 13, 13]
    nodes = [helper.make_node("Conv", ["x", "ws", "bs"], ["s"]), helper.make_node("Relu", ["s"], ["sr"]),
             helper.make_node("Conv", ["sr", "w1", "b1"], ["e1"]), helper.make_node("Relu", ["e1"], ["r1"]),
             helper.make_node("Conv", ["sr", "w3", "b3"], ["e3"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["e3"], ["r3"]), helper.make_node("Concat", ["r1", "r3"], ["c"], axis=1),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)]
    inits = [_init("ws", [4, 8, 1, 1]), _init("bs", [4]), _init("w1", [8, 4, 1, 1]), _init("b1", [8]),
             _init("w3", [8, 4, 3, 3]), _init("b3", [8])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *shape])], [value_info("y", T.FLOAT, None)], inits)
    names = check_gpu(m, _feeds(shape), tmp_path)
    assert [n.rsplit("_", 1)[0] for n in names if "copy" not in n] == ["conv", "conv", "conv", "concat", "maxpool"]


@pytest.mark.parametrize("op,shape,attrs", [
    ("MaxPool", [4, 13, 11], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", [4, 13, 11], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", [3, 12, 12], dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("MaxPool", [3, 11, 10], dict(kernel_shape=[3, 2], dilations=[2, 2], pads=[2, 0, 1, 1])),
    ("MaxPool", [3, 11, 10], dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ("MaxPool", [3, 17], dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    ("AveragePool", [4, 13, 11], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", [4, 13, 11], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", [4, 13, 11], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1,
                                      count_include_pad=1)),
    ("AveragePool", [4, 13, 11], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ("AveragePool", [4, 13, 11], dict(kernel_shape=[3, 3], auto_pad="SAME_LOWER")),
], ids=["max_3x3_s2_p1", "max_ceil", "max_2x2", "max_dilated", "max_same_upper", "max_1d", "avg_p1",
        "avg_include_pad", "avg_include_pad_ceil", "avg_ceil", "avg_same_lower"])
def test_pooling_matches_ort(op, shape, attrs, tmp_path) -> None:
    names = check_gpu(_single(op, shape, **attrs), _feeds(shape), tmp_path)
    assert [n.rsplit("_", 1)[0] for n in names if "copy" not in n] == [op.lower()]


def test_maxpool_relu_fuses(tmp_path) -> None:
    shape = [4, 9, 9]
    m = _single("MaxPool", shape, post=[("Relu", {})], kernel_shape=[3, 3], strides=[2, 2])
    names = check_gpu(m, _feeds(shape), tmp_path)
    assert [n.rsplit("_", 1)[0] for n in names if "copy" not in n] == ["maxpool"]


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [[5, 3, 7], [3, 23, 31], [4, 9]], ids=["small", "large", "1d"])
def test_global_pooling_every_candidate_matches_ort(op, shape, tmp_path) -> None:
    entries = _check_candidates(_single(op, shape, post=[("Sigmoid", {})]), shape, tmp_path)
    assert [e for e in entries if e] == [("plane_block", "plane_thread")]


def test_maxpool_indices_is_refused_on_gpu() -> None:
    import engine_onnx
    from engine_onnx.errors import UnsupportedModelError

    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 2, 4, 4])],
                    [value_info("y", T.FLOAT, None), value_info("i", T.INT64, None)])
    with pytest.raises(UnsupportedModelError, match="Indices"):
        engine_onnx.convert(m, device="opencl", io_device="cpu")
