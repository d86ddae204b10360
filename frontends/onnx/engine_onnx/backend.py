"""ONNX's backend API (``onnx.backend.base``) on the importer and the CPU plugin.

``EngineOnnxBackend.prepare(model)`` converts the model and loads the bundle; ``rep.run(inputs)``
runs it and returns numpy arrays. This is what ``onnx.backend.test.BackendTest`` drives, so ONNX's
own node tests check the importer and every kernel it generates.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from engine_onnx.convert import convert

__all__ = ["EngineOnnxBackend", "EngineOnnxRep", "prepare", "run_model", "supports_device"]


class EngineOnnxRep(BackendRep):
    """A converted, loaded model; ``run`` takes the inputs in graph order (or a name → array dict)."""

    def __init__(self, graph, input_names: Sequence[str]):
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


class EngineOnnxBackend(Backend):
    """engine (importer + CPU plugin) as an ONNX backend."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().startswith("CPU")

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> EngineOnnxRep:
        super().prepare(model, device, **kwargs)
        builder = convert(model, batch_symbol=kwargs.get("batch_symbol"))
        graph = builder.build()
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
