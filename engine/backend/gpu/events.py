"""Driver events as ``engine.backend.Event``: recorded on a stream without the host waiting.

Timing (``Backend.time``, which the tuner calls) is the device time between two of these recorded
around the work, so it measures the kernels and not the Python that queued them. The handle is
destroyed when the event is collected (``weakref.finalize``, errors at interpreter exit ignored).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from engine.backend.gpu.driver import Driver
from engine.errors import EngineError

__all__ = ["GpuEvent"]


def _destroy(driver: Driver, handle: int) -> None:
    try:
        driver.event_destroy(handle)
    except Exception:  # noqa: BLE001 - the driver may be gone at interpreter exit
        pass


class GpuEvent:
    """An event of device ``device_index``; ``stream_for(None)`` gives the current stream."""

    __slots__ = ("device_index", "handle", "recorded", "_driver", "_stream_for", "__weakref__")

    def __init__(self, driver: Driver, device_index: int, stream_for: Callable[[Any], int]):
        self._driver = driver
        self.device_index = device_index
        self._stream_for = stream_for
        self.handle = driver.event_create()
        self.recorded = False
        weakref.finalize(self, _destroy, driver, self.handle)

    def record(self, stream: Any = None) -> None:
        self._driver.event_record(self.handle, self._stream_for(stream))
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        if self.recorded:
            self._driver.stream_wait_event(self._stream_for(stream), self.handle)

    def synchronize(self) -> None:
        if self.recorded:
            self._driver.event_synchronize(self.handle)

    def query(self) -> bool:
        return not self.recorded or self._driver.event_query(self.handle)

    def elapsed_ms(self, end: "GpuEvent") -> float:
        if not (self.recorded and isinstance(end, GpuEvent) and end.recorded):
            raise EngineError("elapsed_ms needs two recorded events of the same GPU backend")
        return self._driver.event_elapsed_ms(self.handle, end.handle)

    def __repr__(self) -> str:
        return f"<GpuEvent device {self.device_index} {'recorded' if self.recorded else 'not recorded'}>"
