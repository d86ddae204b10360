"""GPU kernels of table-driven copies and index searches: Pad, Tile, Resize/Upsample, ArgMax/ArgMin,
TopK and ConvTranspose (``engine_onnx.ops.gpu_indexing``).

Every model is converted for ``opencl`` and run on the OpenCL driver (PoCL in CI) against ONNX
Runtime, and converted for ``cuda`` with every kernel compiled by NVRTC (``onnx_support.check_gpu``).
Inputs have a symbolic batch, run with batches 1 and 3.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnx_support import check_gpu, gpu_reason, ort_output, small_model, value_info

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))

RNG = np.random.default_rng(0)


def _const(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _feeds(shape, batches=(1, 3), dtype=np.float32, integers=False):
    if integers:  # small integer values: ties for ArgMax/ArgMin/TopK
        return [{"x": RNG.integers(-3, 4, (b, *shape)).astype(dtype)} for b in batches]
    return [{"x": RNG.standard_normal((b, *shape)).astype(dtype)} for b in batches]


def _one(op, inits, shape, opset=18, in_type=T.FLOAT, out_type=T.FLOAT, inputs=None, **attrs):
    """A one-node model of ``x`` (batch-symbolic ``shape``) and constant extra inputs."""
    names = inputs if inputs is not None else ["x", *[i.name for i in inits]]
    node = helper.make_node(op, names, ["y"], **attrs)
    return small_model([node], [value_info("x", in_type, ["batch", *shape])], [value_info("y", out_type, None)], inits,
                       opset)


# -- Pad -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_modes_with_negative_pads(tmp_path, mode) -> None:
    pads = [0, 1, 2, -1, 0, 0, 1, 3]  # axis 2 cropped at its end, axis 3 cropped at its start
    m = _one("Pad", [_const("p", pads), _const("v", 1.5, np.float32)], [2, 5, 6], mode=mode)
    names = check_gpu(m, _feeds([2, 5, 6]), tmp_path)
    assert any(n.startswith("pad") for n in names)


def test_pad_wrap(tmp_path) -> None:
    m = _one("Pad", [_const("p", [0, 0, 2, 1, 0, 0, 1, 4])], [2, 3, 4], opset=19, mode="wrap")
    check_gpu(m, _feeds([2, 3, 4]), tmp_path)


def test_pad_with_axes_on_int64(tmp_path) -> None:
    m = _one("Pad", [_const("p", [1, 2, 3, 0]), _const("v", 7), _const("a", [-1, 1])], [3, 4],
             in_type=T.INT64, out_type=T.INT64)
    check_gpu(m, _feeds([3, 4], dtype=np.int64, integers=True), tmp_path)


def test_pad_opset_2_attributes(tmp_path) -> None:
    m = _one("Pad", [], [2, 3], opset=2, pads=[0, 1, 0, 0, 2, 1], value=-2.0)
    check_gpu(m, _feeds([2, 3]), tmp_path)


def _cpu_matches_ort(model, feeds) -> None:
    import engine_onnx

    graph = engine_onnx.convert(model).build()
    for feed in feeds:
        expected = ort_output(model, feed)
        np.testing.assert_allclose(graph.run_async([feed["x"]])[0].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_nan_fill_values_compile_and_fill_on_the_cpu_and_gpu_kinds(tmp_path) -> None:
    """A NaN constant (a Pad value, an extrapolation value) is written as NAN in every kernel."""
    m = _one("Pad", [_const("p", [0, 1, 2, 0, 0, 1, 0, 1]), _const("v", np.nan, np.float32)], [2, 3, 4])
    _cpu_matches_ort(m, _feeds([2, 3, 4]))
    check_gpu(m, _feeds([2, 3, 4]), tmp_path)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_that_changes_no_axis_is_the_input(tmp_path, mode) -> None:
    m = _one("Resize", [_const("roi", [], np.float32), _const("s", [1.0, 1.0, 1.0, 1.0], np.float32)], [2, 3, 4],
             mode=mode)
    _cpu_matches_ort(m, _feeds([2, 3, 4]))
    check_gpu(m, _feeds([2, 3, 4]), tmp_path)


# -- Tile ------------------------------------------------------------------------------------------


def test_tile(tmp_path) -> None:
    m = _one("Tile", [_const("r", [1, 2, 1, 3])], [3, 4, 5])
    check_gpu(m, _feeds([3, 4, 5]), tmp_path)


def test_tile_int32(tmp_path) -> None:
    m = _one("Tile", [_const("r", [1, 3])], [5], in_type=T.INT32, out_type=T.INT32)
    check_gpu(m, _feeds([5], dtype=np.int32, integers=True), tmp_path)


# -- Resize ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctm,nearest", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                                         ("align_corners", "round_prefer_ceil"), ("pytorch_half_pixel", "ceil"),
                                         ("half_pixel_symmetric", "round_prefer_floor")])
def test_resize_nearest_scales(tmp_path, ctm, nearest) -> None:
    # scales exact in binary: the importer computes coordinates in float64, ONNX Runtime in float32
    m = _one("Resize", [_const("s", [1, 1, 2.5, 0.75], np.float32)], [2, 4, 8], inputs=["x", "", "s"],
             mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=nearest)
    check_gpu(m, _feeds([2, 4, 8]), tmp_path)


def test_resize_nearest_sizes_on_int32(tmp_path) -> None:
    m = _one("Resize", [_const("sz", [7, 3])], [2, 4, 5], inputs=["x", "", "", "sz"], mode="nearest",
             in_type=T.INT32, out_type=T.INT32, axes=[2, 3])
    feeds = [{"x": RNG.integers(-100, 100, (b, 2, 4, 5)).astype(np.int32)} for b in (1, 3)]
    check_gpu(m, feeds, tmp_path)


def test_resize_nearest_tf_crop_and_resize_extrapolates(tmp_path) -> None:
    roi = _const("roi", [-0.2, 0.1, 1.3, 0.8], np.float32)
    m = _one("Resize", [roi, _const("sz", [6, 7])], [2, 4, 5], inputs=["x", "roi", "", "sz"], mode="nearest",
             coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=9.0, axes=[2, 3])
    check_gpu(m, _feeds([2, 4, 5]), tmp_path)


def test_upsample_opset_9(tmp_path) -> None:
    m = _one("Upsample", [_const("s", [1, 1, 2, 3], np.float32)], [2, 3, 4], opset=9, mode="nearest")
    check_gpu(m, _feeds([2, 3, 4]), tmp_path)


def test_upsample_linear_opset_9(tmp_path) -> None:
    m = _one("Upsample", [_const("s", [1, 1, 2, 2], np.float32)], [2, 3, 4], opset=9, mode="linear")
    check_gpu(m, _feeds([2, 3, 4]), tmp_path)


@pytest.mark.parametrize("mode,ctm", [("linear", "half_pixel"), ("linear", "align_corners"),
                                      ("cubic", "half_pixel"), ("cubic", "asymmetric")])
def test_resize_linear_and_cubic(tmp_path, mode, ctm) -> None:
    m = _one("Resize", [_const("s", [1, 1, 1.75, 0.5], np.float32)], [2, 4, 8], inputs=["x", "", "s"],
             mode=mode, coordinate_transformation_mode=ctm)
    check_gpu(m, _feeds([2, 4, 8]), tmp_path)


def test_resize_linear_antialias_tf_crop_extrapolates(tmp_path) -> None:
    roi = _const("roi", [0.3, -0.25, 0.9, 1.2], np.float32)
    m = _one("Resize", [roi, _const("sz", [4, 7])], [2, 9, 6], inputs=["x", "roi", "", "sz"], mode="linear",
             coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-1.0, axes=[2, 3])
    check_gpu(m, _feeds([2, 9, 6]), tmp_path)
    m = _one("Resize", [_const("sz", [3, 4])], [2, 9, 10], inputs=["x", "", "", "sz"], mode="linear",
             antialias=1, axes=[2, 3])
    check_gpu(m, _feeds([2, 9, 10]), tmp_path)


# -- ArgMax / ArgMin / TopK ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("keepdims,last", [(1, 0), (0, 1), (1, 1)])
def test_argmax_argmin_with_ties(tmp_path, op, keepdims, last) -> None:
    m = _one(op, [], [7, 5], out_type=T.INT64, axis=1, keepdims=keepdims, select_last_index=last)
    check_gpu(m, _feeds([7, 5], integers=True), tmp_path)


def test_argmax_along_the_dynamic_batch_of_int32(tmp_path) -> None:
    m = _one("ArgMax", [], [4], in_type=T.INT32, out_type=T.INT64, axis=0, keepdims=0)
    check_gpu(m, _feeds([4], dtype=np.int32, integers=True), tmp_path)


@pytest.mark.parametrize("largest,dtype", [(1, np.float32), (0, np.int32)])
def test_topk_with_ties(tmp_path, largest, dtype) -> None:
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=largest)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    m = small_model([node], [value_info("x", elem, ["batch", 9, 3])],
                    [value_info("v", elem, None), value_info("i", T.INT64, None)], [_const("k", [4])])
    check_gpu(m, _feeds([9, 3], dtype=dtype, integers=True), tmp_path)


# -- ConvTranspose ---------------------------------------------------------------------------------


def _convt(tmp_path, c, m_per_group, spatial, kernel, bias=True, relu=False, **attrs) -> list[str]:
    group = attrs.get("group", 1)
    w = RNG.standard_normal((c, m_per_group, *kernel)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(RNG.standard_normal(m_per_group * group).astype(np.float32), "b"))
        inputs.append("b")
    nodes = [helper.make_node("ConvTranspose", inputs, ["t" if relu else "y"], **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["t"], ["y"]))
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", c, *spatial])], [value_info("y", T.FLOAT, None)], inits)
    return check_gpu(m, _feeds([c, *spatial]), tmp_path)


def test_convtranspose_stride_pads_output_padding(tmp_path) -> None:
    _convt(tmp_path, 3, 4, [5, 6], [3, 3], strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 0])


def test_convtranspose_group_dilation_relu_no_bias(tmp_path) -> None:
    names = _convt(tmp_path, 4, 3, [4, 5], [2, 3], bias=False, relu=True, group=2, dilations=[2, 1],
                   strides=[1, 3])
    assert not any(n.startswith("relu") for n in names)


def test_convtranspose_1d_and_3d(tmp_path) -> None:
    _convt(tmp_path, 2, 3, [7], [4], strides=[3], pads=[2, 1])
    (tmp_path / "3d").mkdir()
    _convt(tmp_path / "3d", 2, 2, [3, 2, 3], [2, 2, 2], strides=[2, 1, 2], auto_pad="SAME_UPPER")


def test_convtranspose_output_shape(tmp_path) -> None:
    _convt(tmp_path, 2, 2, [4, 4], [3, 3], strides=[2, 2], output_shape=[10, 9])
