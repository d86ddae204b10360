"""A GPU plugin's settings, read from its environment variables once, when its backend is built.

Every CUDA-like plugin has the same two knobs under its own prefix: ``ENGINE_<VENDOR>_SYNC=1``
(wait for and check every launch, so a fault names its kernel) and
``ENGINE_<VENDOR>_STREAM_SOURCES`` (which frameworks' current streams to follow; empty for none).
An invalid value raises ``ValueError`` naming the variable, which makes the plugin fail to
register and ``engine devices`` show the cause.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import attrs

from engine.backend.gpu.streams import StreamSource

__all__ = ["GpuPluginSettings", "parse_flag", "select_sources"]

_FALSE = ("", "0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def parse_flag(variable: str, raw: str) -> bool:
    """``raw`` as a boolean; anything but the usual spellings is refused (a typo must not be ignored)."""
    value = raw.strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(f"{variable}={raw!r}: expected 0 or 1")


def select_sources(variable: str, names: str, known: Mapping[str, StreamSource]) -> tuple[StreamSource, ...]:
    """The stream sources ``names`` (comma-separated) picks from ``known``; ``ValueError`` naming an unknown one."""
    chosen = [n.strip().lower() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"{variable}={names!r}: unknown source(s) {unknown}; known: {', '.join(known)}")
    return tuple(known[n] for n in chosen)


@attrs.frozen
class GpuPluginSettings:
    debug: bool
    stream_sources: Sequence[StreamSource]

    @staticmethod
    def variables(vendor: str) -> tuple[str, str]:
        """The plugin's (sync, stream sources) variable names, e.g. ``ENGINE_CUDA_SYNC``."""
        prefix = f"ENGINE_{vendor.upper()}_"
        return prefix + "SYNC", prefix + "STREAM_SOURCES"

    @classmethod
    def from_env(cls, vendor: str, sources: Mapping[str, StreamSource], default_sources: str,
                 env: Mapping[str, str] | None = None) -> "GpuPluginSettings":
        env = os.environ if env is None else env
        sync, streams = cls.variables(vendor)
        return cls(debug=parse_flag(sync, env.get(sync, "")),
                   stream_sources=select_sources(streams, env.get(streams, default_sources), sources))
