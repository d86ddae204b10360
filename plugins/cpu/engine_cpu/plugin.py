"""The ``engine.devices`` entry point of ``engine-cpu``: hands the registry one ``CpuBackend``.

Kept trivial on purpose (DESIGN §5): discovery must be cheap, so building the backend only reads
the registry's settings; nothing is compiled or loaded until a kernel asks for it.
"""

from __future__ import annotations

from engine.hookspecs import hookimpl
from engine.settings import Settings

from engine_cpu.backend import CpuBackend

__all__ = ["engine_backends"]


@hookimpl
def engine_backends(settings: Settings) -> list[CpuBackend]:
    return [CpuBackend(cache_dir=settings.cache_dir)]
