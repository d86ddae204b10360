"""ONNX's own node tests against the importer's GPU kernels (``engine_onnx.gpu``).

The same selection of node tests as ``test_onnx_backend.py`` (the CPU run), each converted for a
GPU kind through the ONNX backend API (``EngineOnnxBackend.prepare(model, "OPENCL")``: host arrays
in and out, kernels on the device) and compared with the test's expected outputs at its
tolerances. Where a node test feeds shape parameters as graph inputs, they are bound as
initializers first, as exported models carry them (``test_onnx_backend.with_parameters_bound``).

* ``opencl`` runs on the OpenCL plugin: PoCL in CI, a real OpenCL driver compiling and running
  every kernel on the CPU. It is the check CI can make of the GPU kernels' logic.
* ``cuda`` runs the same cases on a CUDA GPU (marker ``gpu``; skipped with the reason elsewhere).

A model the importer refuses for that kind (an op or dtype without GPU kernels, anything it
refuses on the CPU too) is skipped with the importer's reason; any other failure is a failure.
"""

from __future__ import annotations

import unittest

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("engine_onnx.backend")

from onnx.backend.test.loader import load_node_model_tests  # noqa: E402
from onnx.backend.test.runner import Runner  # noqa: E402

from engine_onnx.backend import EngineOnnxBackend  # noqa: E402
from engine_onnx.errors import UnsupportedModelError, UnsupportedOpsetError  # noqa: E402
from test_onnx_backend import selected, with_parameters_bound  # noqa: E402

CASES = [case for case in sorted(load_node_model_tests(), key=lambda c: c.name)
         if selected(case.name) and case.model is not None]


def _arrays(values) -> list:
    """A data set's values as numpy arrays (some cases give ``TensorProto`` s)."""
    return [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in values]


def _run(case, device: str) -> None:
    if not EngineOnnxBackend.supports_device(device):
        pytest.skip(f"no usable {device} device here")
    for inputs, expected in case.data_sets:
        inputs, expected = _arrays(inputs), _arrays(expected)
        model, feed = with_parameters_bound(case.model, inputs)
        try:
            rep = EngineOnnxBackend.prepare(model, device)
        except (UnsupportedModelError, UnsupportedOpsetError) as exc:
            raise unittest.SkipTest(f"unsupported: {exc}") from None
        Runner.assert_similar_outputs(expected, rep.run(feed), rtol=case.rtol, atol=case.atol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_on_opencl(case) -> None:
    _run(case, "OPENCL")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_on_cuda(case) -> None:
    _run(case, "CUDA")
