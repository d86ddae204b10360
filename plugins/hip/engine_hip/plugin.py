"""The ``engine.devices`` entry point of ``engine-hip``: hands the registry one ``HipBackend``.

Importing this module imports neither hip-python nor the ROCm runtime: the backend probes the
runtime the first time it is asked whether it is available. The plugin's settings
(``engine.backend.gpu.settings``) are read here, once, when the backend is built; an invalid value
makes the plugin fail to register, which ``engine devices`` shows with the cause.
"""

from __future__ import annotations

from engine.backend.gpu.settings import GpuPluginSettings
from engine.hookspecs import hookimpl
from engine.settings import Settings

from engine_hip.backend import HipBackend
from engine_hip.streams import SOURCES

__all__ = ["engine_backends", "SYNC_ENV", "STREAM_SOURCES_ENV", "DEFAULT_STREAM_SOURCES"]

#: ``ENGINE_HIP_SYNC=1``: wait for and check every launch (debug mode: a fault names its kernel);
#: ``ENGINE_HIP_STREAM_SOURCES``: which frameworks' current streams to follow (empty for none).
SYNC_ENV, STREAM_SOURCES_ENV = GpuPluginSettings.variables("hip")
DEFAULT_STREAM_SOURCES = "torch"


@hookimpl
def engine_backends(settings: Settings) -> list[HipBackend]:
    own = GpuPluginSettings.from_env("hip", SOURCES, DEFAULT_STREAM_SOURCES)
    return [HipBackend(settings.cache_dir, debug=own.debug, stream_sources=own.stream_sources)]
