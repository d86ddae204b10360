"""ONNX's backend API (``onnx.backend.base``) on the importer and the engine's device plugins.

``EngineOnnxBackend.prepare(model, device)`` converts the model for the device's kind and loads
the bundle; ``rep.run(inputs)`` runs it and returns numpy arrays. This is what
``onnx.backend.test.BackendTest`` drives, so ONNX's own node tests check the importer and every
kernel it generates. Devices are ONNX's ``"CPU"`` and ``"CUDA"`` (``"CUDA:1"`` picks a device) and
``"OPENCL"``; on a GPU kind the model takes and returns host arrays (the engine copies them).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from engine_onnx.convert import convert
from engine_onnx.gpu import GPU_KINDS

__all__ = ["EngineOnnxBackend", "EngineOnnxRep", "prepare", "run_model", "supports_device"]


class EngineOnnxRep(BackendRep):
    """A converted, loaded model; ``run`` takes the inputs in graph order (or a name → array dict)."""

    def __init__(self, graph, input_names: Sequence[str]):
        #: the loaded ``CompiledGraph``
        self.graph = graph
        self.input_names = list(input_names)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            inputs = [inputs[n] for n in self.input_names]
        elif isinstance(inputs, np.ndarray):
            inputs = [inputs]
        arrays = [np.require(np.asarray(x), requirements="C") for x in inputs]  # keeps 0-d arrays 0-d
        outs = self.graph.run_async(arrays)
        return tuple(np.array(o.numpy(), copy=True) for o in outs)


def _device(device: str) -> tuple[str, str]:
    """ONNX's device string (``"CPU"``, ``"CUDA:1"``) as (the engine's kind, the engine's device)."""
    kind, _, index = device.partition(":")
    kind = kind.strip().lower()
    if kind != "cpu" and kind not in GPU_KINDS:
        raise ValueError(f"device {device!r}: expected CPU, {', '.join(k.upper() for k in GPU_KINDS)} (optionally "
                         f"with ':index')")
    return kind, f"{kind}:{index or 0}"


class EngineOnnxBackend(Backend):
    """engine (importer + a device plugin) as an ONNX backend."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Whether ``device``'s kind has kernels here and its plugin can run them on this machine."""
        import engine

        try:
            kind, _ = _device(device)
        except ValueError:
            return False
        return any(d.kind == kind and d.available for d in engine.devices())

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> EngineOnnxRep:
        super().prepare(model, device, **kwargs)
        kind, where = _device(device)
        builder = convert(model, batch_symbol=kwargs.get("batch_symbol"), device=kind,
                          io_device=None if kind == "cpu" else "cpu")
        graph = builder.build(device=where) if kind != "cpu" else builder.build()
        inits = {i.name for i in model.graph.initializer}
        return EngineOnnxRep(graph, [i.name for i in model.graph.input if i.name not in inits])

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info=None, **kwargs: Any):
        raise NotImplementedError("engine-onnx runs whole models (prepare/run_model), not single nodes")


prepare = EngineOnnxBackend.prepare
run_model = EngineOnnxBackend.run_model
supports_device = EngineOnnxBackend.supports_device
