"""The ``engine.devices`` entry point of ``engine-opencl``: hands the registry one ``OpenCLBackend``.

The plugin's own settings are read here, once, when the backend is built (never deep in the code);
an invalid value makes the plugin fail to register, which ``engine devices`` shows with the cause.
"""

from __future__ import annotations

import os
from typing import Mapping

from engine.hookspecs import hookimpl
from engine.settings import Settings

from engine_opencl.backend import OpenCLBackend

__all__ = ["engine_backends", "DEVICES_ENV", "MAX_ALLOC_ENV", "ALIGNMENT_ENV"]

#: Comma-separated, case-insensitive substrings of "platform / device / type": which devices to use.
DEVICES_ENV = "ENGINE_OPENCL_DEVICES"
#: Caps the largest single allocation below the device's ``MAX_MEM_ALLOC_SIZE`` (tests, sharing).
MAX_ALLOC_ENV = "ENGINE_OPENCL_MAX_ALLOC_BYTES"
#: Raises the allocation and planning alignment for devices needing more than 128 bytes.
ALIGNMENT_ENV = "ENGINE_OPENCL_ALIGNMENT"


def _positive(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer number of bytes")
    return int(raw)


@hookimpl
def engine_backends(settings: Settings) -> list[OpenCLBackend]:
    env = os.environ
    alignment = _positive(env, ALIGNMENT_ENV)
    if alignment is not None and (alignment < 128 or alignment & (alignment - 1)):
        raise ValueError(f"{ALIGNMENT_ENV}={alignment}: expected a power of two of at least 128 bytes")
    return [OpenCLBackend(settings.cache_dir, devices=env.get(DEVICES_ENV) or None,
                          max_allocation=_positive(env, MAX_ALLOC_ENV), alignment=alignment)]
