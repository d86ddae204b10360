"""The allocator role: aligned buffers and copies.

This template's "device memory" is host memory from numpy, so ownership is plain reference
counting (the ``Storage`` holds the array). numpy only promises 16-byte alignment, so each
buffer is over-allocated and sliced at the first aligned byte. A real accelerator replaces these
three functions with its driver's allocate/free, host-to-device/device-to-host copies and memset,
enqueued on ``stream``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine.device import Device
from engine.storage import Storage

__all__ = ["allocate", "copy", "memset"]


def allocate(device: Device, nbytes: int, alignment: int) -> Storage:
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    addr = raw.ctypes.data + (-raw.ctypes.data % alignment)
    # No host_view: the core must treat this memory as device memory and copy through us.
    return Storage(device, addr, nbytes, owner=raw)


def copy(dst_addr: int, src_addr: int, nbytes: int) -> None:
    if nbytes < 0:  # ctypes would turn a negative size into a huge size_t
        raise ValueError(f"byte count must be non-negative, got {nbytes}")
    if nbytes:
        ctypes.memmove(dst_addr, src_addr, nbytes)


def memset(addr: int, value: int, nbytes: int) -> None:
    if nbytes < 0 or not 0 <= value <= 255:
        raise ValueError(f"memset({value}, {nbytes}): expected a byte value and a non-negative size")
    if nbytes:
        ctypes.memset(addr, value, nbytes)
