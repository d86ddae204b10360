"""A lane's workspace of one kind: one allocation, or several where the device caps allocations.

The planner gives every block a byte offset in one linear space. Most devices can allocate the
whole space at once; OpenCL devices cannot allocate more than ``CL_DEVICE_MAX_MEM_ALLOC_SIZE`` in
one buffer (a quarter of the device's memory is common). For those the planner keeps every block
inside one segment of ``Backend.max_allocation()`` bytes (``memory.segment_offsets``) and the
workspace is one allocation per segment; ``ptr_at(offset)`` maps a planned offset to the pointer
in its segment.

A workspace that cannot be allocated is an ``OutOfMemoryError`` saying which workspace (the
caller's ``purpose``) and, when segmented, which segment. Every workspace allocated is logged
(``engine.runtime.workspace``, INFO): a lane's workspace is replaced only when a key needs more, so
these records are its growth.
"""

from __future__ import annotations

from typing import Any

from engine.backend import BackendBase
from engine.errors import OutOfMemoryError
from engine.log import get_logger
from engine.storage import close_all

__all__ = ["Workspace"]

log = get_logger("engine.runtime.workspace")


class Workspace:
    """``nbytes`` of one kind's scratch for one lane, in segments of ``segment_bytes`` (or one)."""

    __slots__ = ("nbytes", "segment_bytes", "storages", "base")

    def __init__(self, backend: BackendBase, device_index: int, nbytes: int, stream: Any,
                 segment_bytes: int | None = None, *, purpose: str = "a workspace"):
        self.nbytes = nbytes
        if segment_bytes is None or nbytes <= segment_bytes:
            self.segment_bytes = None
            sizes = [nbytes]
        else:
            self.segment_bytes = segment_bytes
            sizes = [min(segment_bytes, nbytes - start) for start in range(0, nbytes, segment_bytes)]
        storages = []
        for size in sizes:
            try:
                storages.append(backend.allocate(size, device_index, stream))
            except MemoryError as exc:
                close_all(storages)  # the traceback keeps this frame: do not let it keep the memory
                raise _failure(exc, backend, device_index, nbytes, sizes, len(storages), purpose) from exc
        self.storages = tuple(storages)
        log.info("%s on %s:%d: allocated %d bytes in %d allocation(s)", purpose, backend.kind, device_index,
                 nbytes, len(storages))
        #: The pointer of the first segment (the only one on most devices).
        self.base = self.storages[0].ptr

    @property
    def segmented(self) -> bool:
        return self.segment_bytes is not None

    def ptr_at(self, offset: int) -> Any:
        """The pointer of planned byte ``offset``."""
        if self.segment_bytes is None:
            return self.base + offset
        segment, within = divmod(offset, self.segment_bytes)
        return self.storages[segment].ptr + within

    def release_after(self, stream: Any) -> None:
        """Order the release of every segment after the work queued on ``stream``."""
        for storage in self.storages:
            storage.stream = stream

    def __repr__(self) -> str:
        return f"<Workspace {self.nbytes} bytes in {len(self.storages)} allocation(s)>"


def _failure(exc: MemoryError, backend: BackendBase, device_index: int, nbytes: int, sizes: list[int],
             failed: int, purpose: str) -> OutOfMemoryError:
    """The ``OutOfMemoryError`` for segment ``failed`` of a workspace of ``nbytes`` in ``sizes``."""
    if len(sizes) > 1:
        purpose = f"{purpose} (segment {failed + 1} of {len(sizes)}, {nbytes} bytes in all)"
    return OutOfMemoryError.from_error(exc, sizes[failed], f"{backend.kind}:{device_index}", purpose)
