"""The PyTorch reference cases the onnx wheel ships (opset 6; backend/test/data/pytorch-converted and
pytorch-operator), converted and run against their shipped outputs: old opsets import through
ONNX's version converter, and none may be silently wrong."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import engine_onnx

_ROOT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
CASES = sorted(glob.glob(os.path.join(_ROOT, "pytorch-converted", "*", "model.onnx"))
               + glob.glob(os.path.join(_ROOT, "pytorch-operator", "*", "model.onnx")))

#: Cases refused with the node named (none today: PRelu v6's per-channel slope of shape [C] against
#: [N, C, ...], which the version converter leaves as it is, is reshaped to [C, 1, ...] first).
REFUSED: dict[str, str] = {}


def _tensors(folder: str, prefix: str) -> list[np.ndarray]:
    paths = sorted(glob.glob(os.path.join(folder, f"{prefix}_*.pb")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
    return [numpy_helper.to_array(onnx.load_tensor(p)) for p in paths]


def test_the_wheel_ships_the_cases():
    assert len(CASES) == 117
    names = {os.path.basename(os.path.dirname(p)) for p in CASES}
    assert {"test_PReLU_1d_multiparam", "test_PReLU_2d_multiparam", "test_PReLU_3d_multiparam"} <= names


@pytest.mark.parametrize("model", CASES, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_pytorch_case_matches_its_shipped_outputs(model):
    name = os.path.basename(os.path.dirname(model))
    if name in REFUSED:
        with pytest.raises(engine_onnx.UnsupportedModelError, match=REFUSED[name]):
            engine_onnx.convert(model)
        return
    graph = engine_onnx.convert(model).build()
    sets = sorted(glob.glob(os.path.join(os.path.dirname(model), "test_data_set_*")))
    assert sets
    for folder in sets:
        expected = _tensors(folder, "output")
        got = [t.numpy() for t in graph.run_async(_tensors(folder, "input"))]
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5, equal_nan=True)



def _prelu_v6(readers: int, constant: bool = True, shape=(2, 3, 4, 5)) -> onnx.ModelProto:
    """An opset-6 model: ``readers`` PRelu nodes reading one per-channel slope of shape [3], a
    constant or (``constant=False``) a graph input."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, list(shape)) for i in range(readers)]
    slope = numpy_helper.from_array(SLOPE, "slope")
    inputs = [x] if constant else [x, helper.make_tensor_value_info("slope", TensorProto.FLOAT, [3])]
    nodes = [helper.make_node("PRelu", ["x", "slope"], [f"y{i}"]) for i in range(readers)]
    graph = helper.make_graph(nodes, "prelu6", inputs, outs, initializer=[slope] if constant else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])


SLOPE = np.array([0.1, 0.2, 0.3], np.float32)


@pytest.mark.parametrize("readers", [1, 2])
def test_an_opset_6_per_channel_prelu_slope_applies_along_the_channels(readers):
    model = _prelu_v6(readers)
    before = model.SerializeToString()
    graph = engine_onnx.convert(model).build()
    assert model.SerializeToString() == before  # the caller's model is not changed
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    outputs = graph.run_async([x])
    assert len(outputs) == readers
    for y in outputs:
        np.testing.assert_allclose(y.numpy(), np.where(x < 0, x * SLOPE.reshape(3, 1, 1), x), rtol=1e-6)


def test_an_opset_6_prelu_slope_given_at_run_time_is_refused_not_misread():
    # The last axis has C elements too, so read from the right (PRelu 7) it would broadcast, wrongly.
    with pytest.raises(engine_onnx.UnsupportedModelError, match="opset-6 definition of PRelu"):
        engine_onnx.convert(_prelu_v6(1, constant=False, shape=(2, 3, 4, 3)))
