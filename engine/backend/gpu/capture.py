"""The capture protocol: record a prepared run as a driver graph and replay it on any stream.

``capture(driver, run_fn, stream)`` records the launches ``run_fn`` queues on ``stream`` (in
thread-local capture mode, so other threads keep running their own work meanwhile), instantiates
the graph once and returns a ``GraphReplay``. The launches were prepared on static buffers: the
graph bakes their addresses in, so the captured object must own those buffers and the workspace for
as long as it lives (the core's ``CapturedGraph`` keeps them; nothing here frees them).
``replay(stream)`` is one ``cuGraphLaunch`` on the caller's stream (the capture's by default).
The default streams (CUDA: handles 0, 1 legacy and 2 per-thread) cannot be captured: that is ``Unsupported``, and the core
falls back to replaying the launches themselves.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from engine.backend.gpu.driver import Driver, DriverError
from engine.errors import Unsupported

__all__ = ["GraphReplay", "capture"]


def _destroy_exec(driver: Driver, graph_exec: int) -> None:
    try:
        driver.graph_exec_destroy(graph_exec)
    except Exception:  # noqa: BLE001 - the driver may be gone at interpreter exit
        pass


class GraphReplay:
    """An instantiated graph (``engine.backend.Replayable``)."""

    __slots__ = ("_driver", "_launch", "_finalizer", "stream", "device", "__weakref__")

    def __init__(self, driver: Driver, graph_exec: int, stream: int, device: str):
        self._driver = driver
        self._launch: Callable[[int], int] | None = driver.graph_launcher(graph_exec)
        self._finalizer = weakref.finalize(self, _destroy_exec, driver, graph_exec)
        self.stream = stream
        self.device = device

    def replay(self, stream: Any = None) -> None:
        launch = self._launch
        if launch is None:
            raise Unsupported(f"this {self.device} graph was closed")
        code = launch(self.stream if stream is None else int(stream))
        if code:
            raise DriverError("graph launch", code,
                              self._driver.error_name(code), f"replaying a captured graph on {self.device}")

    def close(self) -> None:
        self._launch = None
        self._finalizer()

    def __repr__(self) -> str:
        return f"<GraphReplay on {self.device} {'closed' if self._launch is None else 'ready'}>"


def capture(driver: Driver, run_fn: Callable[[], None], stream: int, device: str,
            uncapturable: frozenset[int] = frozenset({0})) -> GraphReplay:
    """Record ``run_fn``'s work on ``stream`` and instantiate it (see the module docstring).
    ``uncapturable``: the driver's special stream handles (CUDA: 0, legacy 1, per-thread 2)."""
    if stream in uncapturable:
        raise Unsupported(f"{device}: the default stream ({stream:#x}) cannot be captured; run on a stream of "
                          f"your own (the engine's per-thread stream, or a framework's non-default stream)")
    driver.capture_begin(stream)
    try:
        run_fn()
    except BaseException:
        try:
            driver.graph_destroy(driver.capture_end(stream))
        except Exception:  # noqa: BLE001 - the capture is already invalid; report the first error
            pass
        raise
    graph = driver.capture_end(stream)
    try:
        graph_exec = driver.graph_instantiate(graph)
    finally:
        driver.graph_destroy(graph)
    return GraphReplay(driver, graph_exec, stream, device)
