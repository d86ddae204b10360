"""The allocator role: aligned buffers and copies.

This template's "device memory" is host memory from numpy, so ownership is plain reference
counting (the ``Storage`` holds the array) and its pointers are plain addresses (``int``). numpy
only promises 16-byte alignment, so each buffer is over-allocated and sliced at the first aligned
byte. A real accelerator replaces these three functions with its driver's allocate/free,
host-to-device/device-to-host copies and memset, queued on the stream it is given; it frees through
``Storage(..., release=free_on_stream)``, which receives the stream the memory was last used on.
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine.device import Device
from engine.storage import Storage

__all__ = ["allocate", "copy", "memset"]


def allocate(device: Device, nbytes: int, alignment: int, stream: object = None) -> Storage:
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    ptr = raw.ctypes.data + (-raw.ctypes.data % alignment)
    # No host_view: the core must treat this memory as device memory and copy through us.
    return Storage(device, ptr, nbytes, owner=raw, stream=stream)


def copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes < 0:  # ctypes would turn a negative size into a huge size_t
        raise ValueError(f"byte count must be non-negative, got {nbytes}")
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def memset(dst: int, value: int, nbytes: int) -> None:
    if nbytes < 0 or not 0 <= value <= 255:
        raise ValueError(f"memset({value}, {nbytes}): expected a byte value and a non-negative size")
    if nbytes:
        ctypes.memset(dst, value, nbytes)
