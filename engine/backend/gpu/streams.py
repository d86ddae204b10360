"""Which stream work goes on: the caller's when it names one, else one stream per (thread, device).

``current(index)`` answers, in order:

1. the stream the calling thread set with ``use(stream, index)`` (a context manager, nestable);
2. the first *stream source* that names a stream: a vendor plugin passes callables that read a
   framework's current stream (torch's, CuPy's) and return ``None`` when the framework is not
   loaded or is on its default stream — the legacy default stream would serialise every thread and
   cannot be captured, so it is never picked up implicitly;
3. the thread's own stream on that device, made on first use and kept for the thread's life.

A thread's own streams go back to a free list when the thread ends and are handed to the next new
thread, never destroyed while the process runs: memory released later on such a stream (a
``Storage`` finalised after its thread ended) still orders after real work. Before answering, the
device's context is made current in the calling thread, so the launches that follow find it
(on every call when the process sees several devices, since other code may switch contexts).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator, Sequence

from engine.backend.gpu.driver import Driver

__all__ = ["StreamLanes", "StreamSource"]

#: Reads an external current stream for a device index: a handle, or ``None`` to pass.
StreamSource = Callable[[int], "int | None"]


class _ThreadStreams:
    """A thread's own streams by device; returned to the free list when the thread's local dies."""

    __slots__ = ("by_device", "overrides", "active", "__weakref__")

    def __init__(self) -> None:
        self.by_device: dict[int, int] = {}
        self.overrides: dict[int, list[int]] = {}
        self.active: int | None = None


class StreamLanes:
    """Per-(thread, device) streams plus the caller's stream (see the module docstring)."""

    def __init__(self, driver: Driver, sources: Sequence[StreamSource] = ()):
        self._driver = driver
        self._sources = tuple(sources)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}
        self._all: dict[int, set[int]] = {}
        #: With several devices, something else in the thread (torch's ``cudaSetDevice``) may have
        #: made another device's context current since we last did: then activate on every call.
        self.always_activate = False

    def _mine(self) -> _ThreadStreams:
        mine = getattr(self._local, "streams", None)
        if mine is None:
            mine = self._local.streams = _ThreadStreams()
            weakref.finalize(mine, self._give_back, mine.by_device)
        return mine

    def _give_back(self, by_device: dict[int, int]) -> None:
        with self._lock:
            for index, stream in by_device.items():
                self._free.setdefault(index, []).append(stream)

    def activate(self, index: int) -> _ThreadStreams:
        """Make ``index``'s context current in this thread (a no-op when it already is)."""
        mine = self._mine()
        if mine.active != index or self.always_activate:
            self._driver.activate(index)
            mine.active = index
        return mine

    def current(self, index: int) -> int:
        mine = self.activate(index)
        stack = mine.overrides.get(index)
        if stack:
            return stack[-1]
        for source in self._sources:
            stream = source(index)
            if stream:
                return int(stream)
        own = mine.by_device.get(index)
        if own is None:
            own = mine.by_device[index] = self._new_stream(index)
        return own

    def own(self, index: int) -> int:
        """This thread's own stream on ``index``, ignoring the caller's stream and the sources."""
        mine = self.activate(index)
        own = mine.by_device.get(index)
        if own is None:
            own = mine.by_device[index] = self._new_stream(index)
        return own

    def _new_stream(self, index: int) -> int:
        with self._lock:
            free = self._free.get(index)
            if free:
                return free.pop()
        stream = self._driver.stream_create()
        with self._lock:
            self._all.setdefault(index, set()).add(stream)
        return stream

    def known(self, index: int) -> list[int]:
        """Every stream this object made on ``index`` (for a device-wide wait without a device sync)."""
        with self._lock:
            return sorted(self._all.get(index, ()))

    @contextlib.contextmanager
    def use(self, stream: int, index: int) -> Iterator[int]:
        """Within the block, ``current(index)`` in this thread is ``stream``."""
        mine = self.activate(index)
        stack = mine.overrides.setdefault(index, [])
        stack.append(int(stream))
        try:
            yield int(stream)
        finally:
            stack.pop()
