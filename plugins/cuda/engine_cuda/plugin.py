"""The ``engine.devices`` entry point of ``engine-cuda``: hands the registry one ``CudaBackend``.

Importing this module imports neither ``cuda.bindings`` nor the driver: the backend probes the
driver the first time it is asked whether it is available. The plugin's settings
(``engine.backend.gpu.settings``) are read here, once, when the backend is built; an invalid value
makes the plugin fail to register, which ``engine devices`` shows with the cause.
"""

from __future__ import annotations

from engine.backend.gpu.settings import GpuPluginSettings
from engine.hookspecs import hookimpl
from engine.settings import Settings

from engine_cuda.backend import CudaBackend
from engine_cuda.streams import SOURCES

__all__ = ["engine_backends", "SYNC_ENV", "STREAM_SOURCES_ENV", "DEFAULT_STREAM_SOURCES"]

#: ``ENGINE_CUDA_SYNC=1``: wait for and check every launch (debug mode: a fault names its kernel);
#: ``ENGINE_CUDA_STREAM_SOURCES``: which frameworks' current streams to follow (empty for none).
SYNC_ENV, STREAM_SOURCES_ENV = GpuPluginSettings.variables("cuda")
DEFAULT_STREAM_SOURCES = "torch,cupy"


@hookimpl
def engine_backends(settings: Settings) -> list[CudaBackend]:
    own = GpuPluginSettings.from_env("cuda", SOURCES, DEFAULT_STREAM_SOURCES)
    return [CudaBackend(settings.cache_dir, debug=own.debug, stream_sources=own.stream_sources)]
