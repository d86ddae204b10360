"""Whole models through the importer's GPU kernels (``engine_onnx.gpu``), against ONNX Runtime.

Each model is converted for ``opencl`` and run on the OpenCL driver (PoCL in CI: the kernels'
logic, compiled and run for real on the CPU) at two batch sizes, and converted for ``cuda`` with
every kernel compiled by NVRTC into cubins and PTX; on a machine with a CUDA GPU the same
bundles run there too (``onnx_support.check_gpu``). Random weights, no downloads.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_support import check_gpu, gpu_reason

pytest.importorskip("onnxruntime")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))]

from engine_onnx import zoo  # noqa: E402


def _image_feeds(model: onnx.ModelProto, batches) -> list[dict[str, np.ndarray]]:
    name = zoo.graph_inputs(model)[0].name
    return [{name: np.random.default_rng(b).standard_normal((b, 3, 224, 224)).astype(np.float32)} for b in batches]


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_light_model_on_gpu_kinds(name, tmp_path) -> None:
    model = zoo.batch_generalised(zoo.with_random_weights(onnx.load(zoo.light_model_path(name))))
    check_gpu(model, _image_feeds(model, (1, 2)), tmp_path)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torch_vision_model_on_gpu_kinds(name, tmp_path) -> None:
    pytest.importorskip("torch")
    model = getattr(zoo, name)()
    names = check_gpu(model, _image_feeds(model, (1, 2)), tmp_path)
    assert not [n for n in names if "batchnorm" in n.lower()], names  # folded into the Convs, as on the CPU


def test_transformer_encoder_on_gpu_kinds(tmp_path) -> None:
    pytest.importorskip("torch")
    model = zoo.transformer_encoder(layers=2, seq=16)
    feeds = [{"x": np.random.default_rng(b).standard_normal((b, 16, 64)).astype(np.float32)} for b in (1, 3)]
    check_gpu(model, feeds, tmp_path)


def test_bert_encoder_on_gpu_kinds(tmp_path) -> None:
    pytest.importorskip("torch")
    model = zoo.bert_encoder(layers=2)
    check_gpu(model, [zoo.bert_inputs(1, 16, seed=1), zoo.bert_inputs(3, 24, seed=3)], tmp_path)
