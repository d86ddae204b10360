"""The reference kernels as CUDA C++: the shared sources of ``engine.backend.gpu.reference`` in the
CUDA dialect (what differs is only the prelude: see there)."""

from __future__ import annotations

from typing import Mapping

from engine.backend import ReferenceKernel
from engine.backend.gpu import reference as _shared

__all__ = ["reference_kernels", "fault_kernel", "SOURCES", "MLP_MACROS", "DIALECT"]

DIALECT = _shared.CUDA
MLP_MACROS = _shared.MLP_MACROS
#: Every shipped CUDA source by name, with its entries (the compile test builds each one).
SOURCES: Mapping[str, tuple[str, tuple[str, ...]]] = _shared.sources(DIALECT)


def reference_kernels() -> Mapping[str, ReferenceKernel]:
    return _shared.reference_kernels(DIALECT)


def fault_kernel() -> ReferenceKernel:
    return _shared.fault_kernel(DIALECT)
