"""Device memory for suite tests: allocate, write and read bytes through the backend's own copies.

Everything goes through the public contract (``allocate``, ``copy_from_host``, ``copy_to_host``,
``synchronize``) on one device and stream, so the helpers work for ``int`` and ``BufferPtr``
pointers alike. Reads synchronize the stream before the host looks at the bytes, as the core does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backend import BackendBase
from engine.storage import Storage

__all__ = ["DeviceMemory", "host_address", "pattern"]


def host_address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` pseudo-random bytes (never all equal), different for each seed."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class DeviceMemory:
    """Allocations and copies on ``backend``'s device ``device_index``, queued on ``stream``.

    Storages are kept until ``close()`` so that pointers handed to kernels stay valid for the test.
    """

    def __init__(self, backend: BackendBase, device_index: int, stream: Any):
        self.backend = backend
        self.device_index = device_index
        self.stream = stream
        self._kept: list[Storage] = []

    def alloc(self, nbytes: int) -> Storage:
        storage = self.backend.allocate(nbytes, self.device_index, self.stream)
        self._kept.append(storage)
        return storage

    def write(self, ptr: Any, data: np.ndarray | bytes) -> None:
        """Copy ``data``'s bytes to ``ptr`` (the host buffer may be reused when this returns)."""
        host = np.frombuffer(bytes(data), np.uint8) if isinstance(data, (bytes, bytearray)) else data
        host = np.ascontiguousarray(host)
        if host.nbytes:
            self.backend.copy_from_host(ptr, host_address(host), host.nbytes, self.stream)

    def upload(self, data: np.ndarray | bytes) -> Storage:
        """A new allocation holding ``data``'s bytes."""
        nbytes = len(data) if isinstance(data, (bytes, bytearray)) else int(data.nbytes)
        storage = self.alloc(nbytes)
        self.write(storage.ptr, data)
        return storage

    def read(self, ptr: Any, nbytes: int) -> bytes:
        """``nbytes`` at ``ptr``, after the work queued on the stream is done."""
        host = np.empty(nbytes, np.uint8)
        if nbytes:
            self.backend.copy_to_host(host_address(host), ptr, nbytes, self.stream)
        self.sync()
        return host.tobytes()

    def read_array(self, ptr: Any, dtype: Any, shape: int | tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        return np.frombuffer(self.read(ptr, count * dt.itemsize), dt).reshape(shape)

    def sync(self) -> None:
        self.backend.synchronize(self.device_index, self.stream)

    def close(self) -> None:
        self.sync()
        kept, self._kept = self._kept, []
        for storage in kept:
            storage.close()
