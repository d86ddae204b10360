"""The ``engine.devices`` entry point of ``engine-hip``: hands the registry one ``HipBackend``.

Importing this module imports neither hip-python nor the ROCm runtime: the backend probes the
runtime the first time it is asked whether it is available. The plugin's settings are read here,
once, when the backend is built; an invalid value makes the plugin fail to register, which
``engine devices`` shows with the cause.
"""

from __future__ import annotations

import os

import engine
from engine.settings import Settings

from engine_hip.backend import HipBackend
from engine_hip.streams import sources_from

__all__ = ["engine_backends", "SYNC_ENV", "STREAM_SOURCES_ENV"]

#: ``1``: wait for and check every launch (debug mode: a fault names its kernel). Default ``0``.
SYNC_ENV = "ENGINE_HIP_SYNC"
#: Which frameworks' current streams to follow (``torch`` by default; empty for none).
STREAM_SOURCES_ENV = "ENGINE_HIP_STREAM_SOURCES"


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


@engine.hookimpl
def engine_backends(settings: Settings) -> list[HipBackend]:
    env = os.environ
    return [HipBackend(settings.cache_dir, debug=_flag(SYNC_ENV, env.get(SYNC_ENV, "")),
                       stream_sources=sources_from(env.get(STREAM_SOURCES_ENV, "torch")))]
