"""The default event: correct on any backend, native on none.

``BackendBase.create_event`` returns a ``HostEvent`` unless a plugin overrides it. Recording one
waits on the host for the stream (``Backend.synchronize(device_index, stream)``) and stamps the
host clock, so the event is complete as soon as it is recorded: ``wait`` and ``synchronize`` have
nothing left to do, and ``elapsed_ms`` is host time between two records. On a synchronous device
(the CPU) the stream wait is a no-op and this is exact; a device with queues should override
``create_event`` with its driver's events, which record without blocking.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from engine.errors import EngineError

__all__ = ["HostEvent"]


class HostEvent:
    """An event completed on the host at ``record`` time (see the module docstring)."""

    __slots__ = ("_sync", "_stamp")

    def __init__(self, sync: Callable[[Any], None] | None = None):
        self._sync = sync
        self._stamp: int | None = None

    def record(self, stream: Any = None) -> None:
        if self._sync is not None:
            self._sync(stream)
        self._stamp = time.perf_counter_ns()

    def wait(self, stream: Any = None) -> None:
        """Nothing to do: the event completed when it was recorded."""

    def synchronize(self) -> None:
        """Nothing to do: the event completed when it was recorded."""

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: "HostEvent") -> float:
        if self._stamp is None or getattr(end, "_stamp", None) is None:
            raise EngineError("elapsed_ms needs two recorded events")
        return (end._stamp - self._stamp) / 1e6  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"<HostEvent {'recorded' if self._stamp is not None else 'not recorded'}>"
