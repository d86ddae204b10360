"""The demo model built from a backend's reference kernels, as a bundle loaded by the runtime.

Same topology as ``engine.demo.mlp`` (``matmul -> bias_relu in place -> matmul -> bias_add in
place -> softmax with workspace``), with the kernels the backend supplies in its own language, so
the runtime's whole path (builder, bundle, loader, planner, prepared runs) runs on the kind.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from engine.backend import ReferenceKernel
from engine.device import Device
from engine.plugins import Registry

__all__ = ["DEMO_SHAPE", "build_demo_bundle", "load_demo_graph"]

#: (d_in, hidden, classes) of the demo model, as in engine.demo.mlp.
DEMO_SHAPE = (64, 128, 10)


def build_demo_bundle(registry: Registry, kind: str, refs: Mapping[str, ReferenceKernel],
                      weights: Mapping[str, np.ndarray]) -> bytes:
    """The demo MLP on ``kind`` as bundle bytes (inputs and weights on ``kind`` too), built by
    ``engine.demo.mlp.build_mlp`` from the backend's reference kernels ``refs``."""
    from engine.demo.mlp import build_mlp

    d_in, hidden, classes = DEMO_SHAPE
    return build_mlp(d_in=d_in, hidden=hidden, classes=classes, weights=weights, registry=registry, device=kind,
                     kernels=refs).to_bytes()


def load_demo_graph(registry: Registry, kind: str, device_index: int, refs: Mapping[str, ReferenceKernel],
                    weights: Mapping[str, np.ndarray]) -> Any:
    """The demo bundle loaded with ``engine.load_compiled_graph`` on ``kind:device_index``."""
    from engine import load_compiled_graph  # the runtime, imported only by graph tests

    data = build_demo_bundle(registry, kind, refs, weights)
    return load_compiled_graph(data, device=str(Device(kind, device_index)), registry=registry)
