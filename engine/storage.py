"""Device memory the engine owns (``Storage``) or borrows (``ExternalStorage``).

A storage is the smallest thing a backend hands out: an address, a size and a device. Cleanup is
attached with ``weakref.finalize`` to a callable that does not reference the storage, so it runs
exactly once: on ``close()`` or when the last reference goes, never from ``__del__``.
"""

from __future__ import annotations

import weakref
from typing import Callable

from engine.device import Device

__all__ = ["Storage", "ExternalStorage"]


class Storage:
    """An allocation made by a backend.

    ``host_view`` is a writable (or, for read-only weights, read-only) memoryview of the bytes when
    the host process can address them directly (CPU memory, mapped files); ``None`` for device memory.
    ``owner`` is whatever keeps the memory alive (a numpy buffer, an mmap, a driver handle holder).
    """

    __slots__ = ("device", "addr", "nbytes", "host_view", "owner", "_finalizer", "__weakref__")

    def __init__(
        self,
        device: Device,
        addr: int,
        nbytes: int,
        *,
        host_view: memoryview | None = None,
        owner: object = None,
        release: Callable[[], None] | None = None,
    ):
        self.device = device
        self.addr = addr
        self.nbytes = nbytes
        self.host_view = host_view
        self.owner = owner
        self._finalizer = weakref.finalize(self, release) if release is not None else None

    @property
    def readonly(self) -> bool:
        return self.host_view is not None and self.host_view.readonly

    def close(self) -> None:
        """Release the memory now; safe to call twice. Views into it must no longer be used."""
        if self._finalizer is not None:
            self._finalizer()
        self.host_view = None
        self.owner = None

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, addr=0x{self.addr:x}, nbytes={self.nbytes})"


class ExternalStorage(Storage):
    """Memory the engine does not own (a torch tensor's buffer, a numpy array, a mapped weight file).

    ``owner`` keeps the producer alive for as long as the storage is referenced; nothing is freed.
    """

    __slots__ = ()

    def __init__(self, device: Device, addr: int, nbytes: int, *, owner: object,
                 host_view: memoryview | None = None):
        super().__init__(device, addr, nbytes, host_view=host_view, owner=owner)
