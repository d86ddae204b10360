"""Streams, events and timing: the ordering the core relies on instead of device-wide waits."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from engine.testing.buffers import pattern
from engine.testing.checks import bytes_differ, check, lacks

conformance = pytest.mark.conformance

BIG = 64 << 20


def big_pattern() -> np.ndarray:
    return np.resize(pattern(4099, 43), BIG)


@conformance("stream.current")
def test_current_stream(backend, device_index):
    first, second = backend.current_stream(device_index), backend.current_stream(device_index)
    try:
        hash(first)
    except TypeError as exc:
        check(False, "stream.current", "a hashable stream", f"{type(first).__name__}: {exc}")
    check(first == second, "stream.current", "the same stream on two calls in one thread", f"{first!r} != {second!r}")


@conformance("stream.synchronize")
def test_synchronize(backend, device_index, memory):
    data = big_pattern()
    src, dst = memory.upload(data), memory.alloc(BIG)
    backend.copy_device(dst.ptr, src.ptr, BIG, memory.stream)
    backend.synchronize(device_index, memory.stream)
    backend.synchronize(device_index)
    got = memory.read(dst.ptr, BIG)
    check(got == data.tobytes(), "stream.synchronize", "a 64 MiB device copy done after synchronize",
          lambda: bytes_differ(data, got))


@conformance("event.unrecorded")
def test_unrecorded_event(backend, device_index):
    event = backend.create_event(device_index)
    check(event.query() is True, "event.unrecorded", "query() is True for an event never recorded",
          repr(event.query()))
    event.synchronize()


@conformance("event.completes")
def test_event_completes(backend, device_index, memory):
    data = big_pattern()
    src, dst = memory.upload(data), memory.alloc(BIG)
    memory.sync()
    backend.copy_device(dst.ptr, src.ptr, BIG, memory.stream)
    event = backend.create_event(device_index)
    event.record(memory.stream)
    event.synchronize()
    done = event.query()
    check(done is True, "event.completes", "query() is True after record() and synchronize()", repr(done))
    got = memory.read(dst.ptr, BIG)
    check(got == data.tobytes(), "event.completes", "the copy recorded before the event to be done",
          lambda: bytes_differ(data, got))


@conformance("event.elapsed")
def test_elapsed(backend, device_index, memory):
    src, dst = memory.upload(big_pattern()), memory.alloc(BIG)
    memory.sync()
    start, end = backend.create_event(device_index), backend.create_event(device_index)
    start.record(memory.stream)
    backend.copy_device(dst.ptr, src.ptr, BIG, memory.stream)
    end.record(memory.stream)
    end.synchronize()
    ms = start.elapsed_ms(end)
    check(isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0, "event.elapsed",
          "a finite elapsed_ms >= 0 around a 64 MiB copy", repr(ms))


@conformance("event.orders_streams")
def test_wait_orders_streams(backend, device_index, memory):
    """Stream 1 copies 64 MiB into ``mid`` and records an event; stream 2 (a second thread's) waits
    for it and copies ``mid`` onward. Without the wait, stream 2 can read ``mid`` half-written."""
    data = big_pattern()
    first = memory.stream
    src, mid, dst = memory.upload(data), memory.alloc(BIG), memory.alloc(BIG)
    backend.memset(mid.ptr, 0, BIG, first)
    backend.memset(dst.ptr, 0, BIG, first)
    memory.sync()
    backend.copy_device(mid.ptr, src.ptr, BIG, first)
    event = backend.create_event(device_index)
    event.record(first)
    outcome: dict[str, object] = {}

    def second_thread() -> None:
        try:
            second = backend.current_stream(device_index)
            if second == first:
                outcome["same"] = repr(second)
                return
            event.wait(second)
            backend.copy_device(dst.ptr, mid.ptr, BIG, second)
            backend.synchronize(device_index, second)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=second_thread)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    if "same" in outcome:
        lacks("second_stream", f"a second thread's current_stream() is the first thread's ({outcome['same']})")
    got = memory.read(dst.ptr, BIG)
    check(got == data.tobytes(), "event.orders_streams",
          "the copy on the second stream, queued after wait(event), to see the first stream's copy",
          lambda: bytes_differ(data, got))


@conformance("timing.samples")
def test_time_busy(backend, device_index, kit, memory):
    n, iters = 4096, 256
    kernel = kit.kernel("busy")
    x = (np.arange(n) % 1000).astype(np.float32)
    xs, ys = memory.upload(x), memory.alloc(n * 4)
    stream = memory.stream

    def run_busy() -> None:
        kit.launch(kernel, [xs.ptr, ys.ptr], [n, iters], None, stream)

    samples = backend.time(run_busy, stream=stream, warmup=1, repeat=5, device_index=device_index)
    check(isinstance(samples, list) and len(samples) == 5, "timing.samples", "a list of repeat=5 samples",
          repr(samples))
    check(all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in samples), "timing.samples",
          "every sample finite and > 0 milliseconds", repr(samples))
    got = memory.read_array(ys.ptr, np.float32, n)
    check(np.array_equal(got, x + np.float32(iters)), "timing.samples", "the timed busy kernel to compute x + iters",
          lambda: f"{int(np.sum(got != x + iters))} of {n} values wrong")
