"""The allocator role: aligned host memory and synchronous copies.

Memory comes from numpy rather than ``posix_memalign`` so that ownership is ordinary Python
reference counting: the ``Storage`` holds the array as its ``owner``, views into it keep it
alive, and nothing needs an explicit free (no finalizer can run twice or too early). numpy only
guarantees 16-byte alignment, so we over-allocate by the alignment and slice at the first
aligned byte; kernels and planned workspace offsets rely on that alignment for vector loads.

CPU "streams" do not exist: every copy and memset completes before it returns, and storages carry
no ``release`` callable (numpy frees the memory when the last reference goes).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from engine.device import Device
from engine.errors import OutOfMemoryError
from engine.hostptr import array_address
from engine.storage import Storage

__all__ = ["HostAllocator", "copy", "memset"]


class HostAllocator:
    """Hands out ``Storage`` whose ``ptr`` is an ``alignment``-aligned host address (an ``int``)."""

    __slots__ = ("device", "alignment")

    def __init__(self, device: Device, alignment: int):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.device = device
        self.alignment = alignment

    def allocate(self, nbytes: int) -> Storage:
        """``nbytes`` of uninitialised memory; zero bytes gives a valid aligned address and an empty view."""
        # np.empty raises MemoryError (a subclass) on failure; BackendBase adds size and device.
        raw = np.empty(nbytes + self.alignment, dtype=np.uint8)
        base = array_address(raw)  # far cheaper than raw.ctypes.data, and this runs per output per run
        offset = (-base) % self.alignment
        return Storage(self.device, base + offset, nbytes, host_view=memoryview(raw)[offset:offset + nbytes],
                       owner=raw)

    def factory(self, nbytes: int) -> Callable[[], Storage]:
        """``allocate`` with its size bound, for the per-run output allocations of the fast path.

        Not behind ``BackendBase.allocate``, so it raises ``OutOfMemoryError`` itself (the core adds
        which output it was for); the ``try`` costs nothing when the allocation succeeds.
        """
        alignment, device, empty, uint8 = self.alignment, self.device, np.empty, np.uint8
        where = f"{device.kind}:{device.index}"

        def allocate() -> Storage:
            try:
                raw = empty(nbytes + alignment, uint8)
            except MemoryError as exc:
                raise OutOfMemoryError.from_error(exc, nbytes, where) from exc
            base = array_address(raw)
            offset = (-base) % alignment
            return Storage(device, base + offset, nbytes, host_view=memoryview(raw)[offset:offset + nbytes],
                           owner=raw)

        return allocate


def _check(nbytes: int) -> None:
    # ctypes converts a negative size to a huge size_t: refuse it before it reaches libc.
    if nbytes < 0:
        raise ValueError(f"byte count must be non-negative, got {nbytes}")


def copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove``: host to host, which on the CPU covers all three copy directions."""
    _check(nbytes)
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def memset(addr: int, value: int, nbytes: int) -> None:
    """Set ``nbytes`` bytes at ``addr`` to the byte ``value``."""
    _check(nbytes)
    if not 0 <= value <= 255:
        raise ValueError(f"memset value must be a byte (0..255), got {value}")
    if nbytes:
        ctypes.memset(addr, value, nbytes)
