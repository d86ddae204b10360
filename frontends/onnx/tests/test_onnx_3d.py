"""3-D (NCDHW) Conv, MaxPool and AveragePool of the ONNX importer (``ops/conv_nd.py``,
``ops/pool_nd.py``, ``ops/gpu_window_nd.py``), against ONNX Runtime.

Every model runs on the CPU plugin at batch 1 and 3 (a ``dim_param`` batch), and the same models'
GPU kernels run on OpenCL (PoCL in CI) with their CUDA rendering compiled by NVRTC
(``onnx_support.check_gpu``), so the shared dialect is checked on every kind CI has. A model of a
fixed batch converted with ``batch_symbol`` runs at batch 1 and 3, ONNX Runtime on each sample
alone. Tolerance: ``|engine - ort| <= 1e-4·|ort| + 1e-4·max|ort|`` (float32). The models are
small and few (each shape is a kernel of its own, compiled once and cached by content).
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

import engine  # noqa: E402
import engine_onnx  # noqa: E402
from engine_onnx.errors import UnsupportedModelError  # noqa: E402
from onnx_support import (candidate_entries, check_gpu, gpu_reason, ort_output, small_model,  # noqa: E402
                          value_info)

RTOL = 1e-4
RNG = np.random.default_rng(0)
SHAPE = [4, 5, 6, 7]  # channels, depth, height, width after the batch
needs_gpu_kind = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))


def _init(name: str, shape, low: float | None = None, high: float | None = None) -> onnx.TensorProto:
    v = RNG.standard_normal(shape) if low is None else RNG.uniform(low, high, shape)
    return helper.make_tensor(name, T.FLOAT, shape, v.astype(np.float32).ravel())


def _model(nodes, inits=(), shape=SHAPE, batch="batch") -> onnx.ModelProto:
    return small_model(nodes, [value_info("x", T.FLOAT, [batch, *shape])],
                       [value_info(nodes[-1].output[0], T.FLOAT, None)], inits, opset=13)


def _conv(w_shape, bias=True, post=(), **attrs) -> onnx.ModelProto:
    inits = [_init("w", w_shape)] + ([_init("b", [w_shape[0]])] if bias else [])
    nodes = [helper.make_node("Conv", ["x", *[i.name for i in inits]], ["y0"], **attrs)]
    for k, op in enumerate(post):
        nodes.append(helper.make_node(op, [f"y{k}"], [f"y{k + 1}"]))
    return _model(nodes, inits)


def _pool(op: str, **attrs) -> onnx.ModelProto:
    return _model([helper.make_node(op, ["x"], ["y"], **attrs)])


def _feeds(batches=(1, 3)) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((b, *SHAPE)).astype(np.float32)} for b in batches]


def _close(actual: np.ndarray, expected: np.ndarray, msg: str = "") -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape, msg)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * float(np.abs(expected).max()), err_msg=msg)


def _check_cpu(model: onnx.ModelProto) -> list[str]:
    """The model on the CPU plugin at batch 1 and 3 against ONNX Runtime; returns the tasks' names."""
    graph = engine_onnx.convert(model).build()
    for feed in _feeds():
        _close(graph.run_async([feed["x"]])[0].numpy(), ort_output(model, feed), f"batch {feed['x'].shape[0]}")
    assert all(len(e) == 1 for e in candidate_entries(graph))  # one direct kernel per op
    return _kernels(graph)


def _kernels(graph) -> list[str]:
    """The op kernels a graph runs (copies left out), without their numbering."""
    return _op_names([t.meta.name for t in graph.compiled_tasks])


def _op_names(names: list[str]) -> list[str]:
    """Kernel names without the copies between host and device, nor their numbering."""
    return [n.rsplit("_", 1)[0] for n in names if "copy" not in n]


CONV_CASES = {
    "stride_pads": dict(w=[6, 4, 3, 3, 3], strides=[2, 1, 2], pads=[1, 1, 0, 1, 0, 1]),
    "dilated_asymmetric_no_bias": dict(w=[5, 4, 2, 3, 1], dilations=[2, 1, 3], bias=False),
    "grouped": dict(w=[6, 2, 3, 1, 2], group=2, pads=[0, 1, 1, 1, 0, 0]),
    "depthwise_x2": dict(w=[8, 1, 3, 3, 3], group=4, pads=[1, 1, 1, 1, 1, 1], strides=[1, 2, 2]),
    "same_upper_s2": dict(w=[3, 4, 3, 2, 3], auto_pad="SAME_UPPER", strides=[2, 2, 2]),
    "pointwise": dict(w=[3, 4, 1, 1, 1]),
}

POOL_CASES = {
    "max_pads_strides": ("MaxPool", dict(kernel_shape=[3, 3, 3], strides=[2, 2, 2], pads=[1, 1, 1, 1, 1, 1])),
    "max_ceil": ("MaxPool", dict(kernel_shape=[2, 3, 2], strides=[2, 2, 2], ceil_mode=1)),
    "max_dilated": ("MaxPool", dict(kernel_shape=[2, 2, 3], dilations=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1])),
    "avg_pads": ("AveragePool", dict(kernel_shape=[3, 2, 3], strides=[1, 2, 2], pads=[1, 0, 1, 1, 1, 1])),
    "avg_include_pad": ("AveragePool", dict(kernel_shape=[3, 2, 3], strides=[1, 2, 2], pads=[1, 0, 1, 1, 1, 1],
                                            count_include_pad=1)),
    "avg_ceil": ("AveragePool", dict(kernel_shape=[2, 3, 2], strides=[2, 2, 2], ceil_mode=1)),
    "avg_ceil_include_pad": ("AveragePool", dict(kernel_shape=[3, 3, 3], strides=[2, 2, 2], pads=[1, 1, 1, 0, 0, 0],
                                                 ceil_mode=1, count_include_pad=1)),
}


def _conv_case(name: str) -> onnx.ModelProto:
    case = dict(CONV_CASES[name])
    return _conv(case.pop("w"), case.pop("bias", True), **case)


@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv3d_matches_ort(name) -> None:
    assert _check_cpu(_conv_case(name)) == ["conv"]


@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_pool3d_matches_ort(name) -> None:
    op, attrs = POOL_CASES[name]
    assert _check_cpu(_pool(op, **attrs)) == [op.lower()]


def _fused_model() -> onnx.ModelProto:
    """Conv → BatchNormalization → Add (the input: a residual) → Relu, then a MaxPool → Sigmoid."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["n"], epsilon=1e-3),
             helper.make_node("Add", ["x", "n"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2, 2], strides=[2, 2, 2]),
             helper.make_node("Sigmoid", ["p"], ["y"])]
    inits = [_init("w", [4, 4, 3, 3, 3]), _init("b", [4]), _init("s", [4]), _init("beta", [4]), _init("mean", [4]),
             _init("var", [4], 0.5, 2.0)]
    return _model(nodes, inits)


def test_conv3d_batchnorm_residual_relu_and_pool_sigmoid_fuse() -> None:
    assert _check_cpu(_fused_model()) == ["conv", "maxpool"]


def test_conv3d_with_a_weight_computed_at_run_time() -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 1, 1, 0, 1, 1], group=2)]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *SHAPE]), value_info("w", T.FLOAT, [6, 2, 2, 3, 3])],
                    [value_info("y", T.FLOAT, None)], opset=13)
    graph = engine_onnx.convert(m).build()
    w = RNG.standard_normal((6, 2, 2, 3, 3)).astype(np.float32)
    for feed in _feeds():
        feed["w"] = w
        _close(graph.run_async([feed["x"], w])[0].numpy(), ort_output(m, feed))


def test_global_pools_reduce_a_volume() -> None:
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"]), helper.make_node("GlobalMaxPool", ["g"], ["y"])]
    assert _check_cpu(_model(nodes)) == ["globalaveragepool", "globalmaxpool"]


def _chain(batch) -> onnx.ModelProto:
    """Conv → Relu → AveragePool → MaxPool with the input's leading size ``batch``."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1, 1, 1], strides=[1, 1, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("AveragePool", ["r"], ["a"], kernel_shape=[2, 2, 2], pads=[0, 1, 0, 1, 0, 1]),
             helper.make_node("MaxPool", ["a"], ["y"], kernel_shape=[2, 3, 2], ceil_mode=1, strides=[2, 2, 2])]
    return _model(nodes, [_init("w", [5, 4, 3, 3, 3]), _init("b", [5])], batch=batch)


def _per_sample(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's output for each row of ``x`` alone (the model's batch is 1), concatenated."""
    return np.concatenate([ort_output(model, {"x": x[i:i + 1]}) for i in range(x.shape[0])])


@pytest.mark.parametrize("device", ["cpu", pytest.param("opencl", marks=needs_gpu_kind)])
def test_a_fixed_batch_model_under_batch_symbol_runs_at_batch_1_and_3(device) -> None:
    model = _chain(1)
    kwargs = {} if device == "cpu" else dict(device=device, io_device="cpu")
    graph = engine_onnx.convert(model, batch_symbol="batch", **kwargs).build()
    assert graph.meta.inputs[0].shape_str() == "[batch, 4, 5, 6, 7]"
    for batch in (1, 3):
        x = RNG.standard_normal((batch, *SHAPE)).astype(np.float32)
        _close(graph.run_async([x])[0].numpy(), _per_sample(model, x), f"{device} batch {batch}")


def _refusal(model: onnx.ModelProto, **kwargs) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        engine_onnx.convert(model, **kwargs)
    return str(info.value)


def test_refusals_name_the_reason() -> None:
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2, 2])]
    indices = small_model(nodes, [value_info("x", T.FLOAT, ["batch", *SHAPE])],
                          [value_info("y", T.FLOAT, None), value_info("i", T.INT64, None)], opset=13)
    assert "the Indices output" in _refusal(indices)
    dilated = small_model([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2, 2], dilations=[2, 1, 1])],
                          [value_info("x", T.FLOAT, ["batch", *SHAPE])], [value_info("y", T.FLOAT, None)], opset=19)
    assert "AveragePool with dilations" in _refusal(dilated)
    conv4d = small_model([helper.make_node("Conv", ["x", "w"], ["y"])],
                         [value_info("x", T.FLOAT, [1, 2, 3, 3, 3, 3])], [value_info("y", T.FLOAT, None)],
                         [_init("w", [2, 2, 2, 2, 2, 2])], opset=13)
    assert "4-D convolution (1-D, 2-D and 3-D only)" in _refusal(conv4d)


@needs_gpu_kind
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv3d_gpu_matches_ort(name, tmp_path) -> None:
    assert _op_names(check_gpu(_conv_case(name), _feeds(), tmp_path)) == ["conv"]


@needs_gpu_kind
@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_pool3d_gpu_matches_ort(name, tmp_path) -> None:
    op, attrs = POOL_CASES[name]
    assert _op_names(check_gpu(_pool(op, **attrs), _feeds(), tmp_path)) == [op.lower()]


@needs_gpu_kind
def test_fused_conv3d_and_pool_gpu(tmp_path) -> None:
    assert _op_names(check_gpu(_fused_model(), _feeds(), tmp_path)) == ["conv", "maxpool"]


def _cuda_reason() -> str | None:
    """Why the CUDA plugin cannot run kernels here, or None when it can."""
    kinds = {d.kind: d for d in engine.devices()}
    if "cuda" not in kinds:
        return "the CUDA plugin is not installed"
    return None if kinds["cuda"].available else f"no usable CUDA device: {kinds['cuda'].reason}"


@pytest.mark.gpu
def test_conv3d_and_pools_on_cuda_under_batch_symbol() -> None:
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    model = _chain(1)
    graph = engine_onnx.convert(model, batch_symbol="batch", device="cuda", io_device="cpu").build()
    for batch in (1, 3):
        x = RNG.standard_normal((batch, *SHAPE)).astype(np.float32)
        _close(graph.run_async([x])[0].numpy(), _per_sample(model, x), f"cuda batch {batch}")
