"""Streams and events: one in-order, profiling command queue per (thread, device), and OpenCL events.

A thread always gets the same queue for a device, so the backend declares ``has_streams = False``
and the core keeps one workspace per thread. Queues are in order: consecutive launches on one
queue see each other's results without events.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from engine.errors import EngineError

__all__ = ["Queue", "Queues", "OpenCLEvent"]


class Queue:
    """A thread's command queue on one device: the plugin's stream object (hashable by identity)."""

    __slots__ = ("device_index", "queue", "_reads", "__weakref__")

    def __init__(self, device_index: int, queue: Any):
        self.device_index = device_index
        self.queue = queue
        self._reads: list[Any] = []

    def keep(self, event: Any) -> None:
        """Hold a non-blocking read's event until it completes: pyopencl waits for the copy when the
        event object is dropped, which would make every read to the host blocking."""
        import pyopencl as cl

        done = cl.command_execution_status.COMPLETE
        self._reads = [e for e in self._reads if e.command_execution_status != done]
        self._reads.append(event)

    def finish(self) -> None:
        self.queue.finish()
        self._reads = []

    def __repr__(self) -> str:
        return f"<opencl queue of opencl:{self.device_index} at {id(self):#x}>"


class Queues:
    """Each thread's queues, and every live queue of a device (for a device-wide ``synchronize``)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._live: dict[int, weakref.WeakSet[Queue]] = {}

    def current(self, device: Any) -> Queue:
        mine: dict[int, Queue] | None = getattr(self._local, "queues", None)
        if mine is None:
            mine = self._local.queues = {}
        queue = mine.get(device.index)
        if queue is None:
            import pyopencl as cl

            handle = cl.CommandQueue(device.context, device.device,
                                     properties=cl.command_queue_properties.PROFILING_ENABLE)
            queue = mine[device.index] = Queue(device.index, handle)
            with self._lock:
                self._live.setdefault(device.index, weakref.WeakSet()).add(queue)
        return queue

    def live(self, device_index: int) -> list[Queue]:
        with self._lock:
            return list(self._live.get(device_index, ()))


class OpenCLEvent:
    """An OpenCL marker event (``engine.backend.Event``); ``queue_for`` maps a stream (or ``None``)
    to the ``Queue`` to use. Markers carry profiling times, so ``elapsed_ms`` is device time."""

    __slots__ = ("device_index", "cl_event", "_queue_for")

    def __init__(self, device_index: int, queue_for: Callable[[Any], Queue]):
        self.device_index = device_index
        self.cl_event: Any = None
        self._queue_for = queue_for

    def record(self, stream: Any = None) -> None:
        import pyopencl as cl

        self.cl_event = cl.enqueue_marker(self._queue_for(stream).queue)

    def wait(self, stream: Any = None) -> None:
        if self.cl_event is None:
            return
        queue = self._queue_for(stream)
        if queue.device_index != self.device_index:
            # An event of another context cannot gate this queue (CL_INVALID_CONTEXT): wait on the host.
            self.cl_event.wait()
            return
        import pyopencl as cl

        cl.enqueue_barrier(queue.queue, wait_for=[self.cl_event])

    def synchronize(self) -> None:
        if self.cl_event is not None:
            self.cl_event.wait()

    def query(self) -> bool:
        if self.cl_event is None:
            return True
        import pyopencl as cl

        return self.cl_event.command_execution_status == cl.command_execution_status.COMPLETE

    def elapsed_ms(self, end: "OpenCLEvent") -> float:
        if self.cl_event is None or getattr(end, "cl_event", None) is None:
            raise EngineError("elapsed_ms needs two recorded opencl events")
        import pyopencl as cl

        try:  # a marker completes when the work queued before it has: its END time is that point
            return (end.cl_event.profile.end - self.cl_event.profile.end) / 1e6
        except cl.Error as exc:
            raise EngineError(f"elapsed_ms on opencl:{self.device_index} needs two completed events "
                              f"(synchronize the end event first): {exc}") from exc

    def __repr__(self) -> str:
        return f"<OpenCLEvent opencl:{self.device_index} {'recorded' if self.cl_event is not None else 'not recorded'}>"
