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

#: Cases refused with the node named: PRelu v6's per-channel slope of shape [C] against [N, C, ...],
#: which the version converter leaves as it is (it no longer broadcasts under PRelu 7's rules).
REFUSED = {"test_PReLU_1d_multiparam": "PRelu", "test_PReLU_2d_multiparam": "PRelu",
           "test_PReLU_3d_multiparam": "PRelu"}


def _tensors(folder: str, prefix: str) -> list[np.ndarray]:
    paths = sorted(glob.glob(os.path.join(folder, f"{prefix}_*.pb")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
    return [numpy_helper.to_array(onnx.load_tensor(p)) for p in paths]


def test_the_wheel_ships_the_cases():
    assert len(CASES) == 117


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
