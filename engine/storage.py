"""Device memory the engine owns (``Storage``) or borrows (``ExternalStorage``).

A storage is the smallest thing a backend hands out: a device pointer, a size and a device. The
pointer is the backend's own (``int`` addresses on CPU/CUDA/HIP, ``engine.pointer.BufferPtr`` on
handle-addressed devices); the core only adds byte offsets to it.

Release is stream-ordered: a storage remembers the stream its memory was last used on (``stream``,
set by the backend when it allocates for a stream and by the core when it queues work elsewhere)
and the backend's ``release`` callable receives that stream, so a caching pool can free on the
stream instead of waiting for the whole device. Cleanup is attached with ``weakref.finalize`` to a
callable that does not reference the storage, so it runs exactly once: on ``close()`` or when the
last reference goes, never from ``__del__``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

from engine.device import Device

__all__ = ["Storage", "ExternalStorage", "close_all"]


def _release(release: Callable[[Any], None], cell: list[Any]) -> None:
    release(cell[0])


class Storage:
    """An allocation made by a backend.

    ``host_view`` is a writable (or, for read-only weights, read-only) memoryview of the bytes when
    the host process can address them directly (CPU memory, mapped files); ``None`` for device memory.
    ``owner`` is whatever keeps the memory alive (a numpy buffer, an mmap, a driver handle holder).
    ``release(stream)`` frees the memory once, ordered after the work queued on ``stream``.
    """

    __slots__ = ("device", "ptr", "nbytes", "host_view", "owner", "_stream", "_cell", "_finalizer", "__weakref__")

    def __init__(
        self,
        device: Device,
        ptr: Any,
        nbytes: int,
        *,
        host_view: memoryview | None = None,
        owner: object = None,
        release: Callable[[Any], None] | None = None,
        stream: Any = None,
    ):
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self.host_view = host_view
        self.owner = owner
        self._stream = stream
        if release is None:  # memory freed by its owner's reference count: nothing to order
            self._cell = None
            self._finalizer = None
        else:  # the finalizer must not reference the storage: it reads the stream from a cell
            self._cell = [stream]
            self._finalizer = weakref.finalize(self, _release, release, self._cell)

    @property
    def addr(self) -> int:
        """The pointer as an integer address; only for backends whose pointers are addresses."""
        ptr = self.ptr
        if isinstance(ptr, int):
            return ptr
        raise TypeError(f"{self!r} is addressed by a {type(ptr).__name__}, not an integer address")

    @property
    def stream(self) -> Any:
        """The stream whose queued work last used this memory (release is ordered after it)."""
        return self._stream

    @stream.setter
    def stream(self, value: Any) -> None:
        self._stream = value
        if self._cell is not None:
            self._cell[0] = value

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
        ptr = f"0x{self.ptr:x}" if isinstance(self.ptr, int) else repr(self.ptr)
        return f"{type(self).__name__}(device={self.device}, ptr={ptr}, nbytes={self.nbytes})"


class ExternalStorage(Storage):
    """Memory the engine does not own (a torch tensor's buffer, a numpy array, a mapped weight file).

    ``owner`` keeps the producer alive for as long as the storage is referenced; nothing is freed.
    """

    __slots__ = ()

    def __init__(self, device: Device, ptr: Any, nbytes: int, *, owner: object,
                 host_view: memoryview | None = None, stream: Any = None):
        super().__init__(device, ptr, nbytes, host_view=host_view, owner=owner, stream=stream)


def close_all(storages: Iterable[Storage | None]) -> None:
    """Release the allocations a failed attempt made so far (an exception's traceback would keep
    them alive for as long as the exception lives)."""
    for storage in storages:
        if storage is not None:
            storage.close()
