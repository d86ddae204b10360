"""Pooled, stream-ordered device memory: what a fresh output per run costs is a pool hit.

Every allocation comes from the device's stream-ordered pool (``cuMemAllocFromPoolAsync``), set
to keep freed memory (release threshold: unlimited), and is freed on the stream that last used it
(``Storage`` hands its release the stream): memory freed on a stream is reused by the next
allocation on that stream at once, and by other streams once the driver sees the free complete.
So the fast path's one allocation per graph output never reaches the operating system once the
pool has warmed up. Zero-byte requests get one byte (a valid, distinct pointer).

Releases may run on any thread (garbage collection) and after the driver is gone (interpreter
exit): failures there are ignored, since nothing can be reported from a finaliser.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from engine.backend.gpu.driver import Driver
from engine.device import Device
from engine.storage import Storage

__all__ = ["PoolAllocator"]


def _free(driver: Driver, index: int, ptr: int, home: int, stream: Any) -> None:
    try:
        driver.free_async(ptr, home if stream is None else int(stream), index)
    except Exception:  # noqa: BLE001 - see the module docstring
        pass


class PoolAllocator:
    """Allocations of one device from its pool (see the module docstring)."""

    __slots__ = ("driver", "device", "pool")

    def __init__(self, driver: Driver, device: Device, pool: int):
        self.driver, self.device, self.pool = driver, device, pool

    def allocate(self, nbytes: int, stream: int) -> Storage:
        """``nbytes`` ordered on ``stream``; ``MemoryError`` (from the driver) when out of memory."""
        ptr = self.driver.alloc_async(nbytes or 1, self.pool, stream)
        return Storage(self.device, ptr, nbytes, release=functools.partial(_free, self.driver, self.device.index, ptr, stream),
                       stream=stream)

    def factory(self, nbytes: int, stream: int) -> Callable[[], Storage]:
        """A zero-argument allocator of ``nbytes`` on ``stream`` for the fast path."""
        return functools.partial(self.allocate, nbytes, stream)
