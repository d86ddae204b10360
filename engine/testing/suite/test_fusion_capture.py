"""Optional speed-ups must not change results: fused launches and captured runs equal eager ones."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import Unsupported
from engine.testing.checks import check, lacks, values_differ

conformance = pytest.mark.conformance

N = 4097


def two_launches(kit, memory):
    """add (x, y -> z) then scale_ws (z -> w), prepared on static buffers; returns (launches, buffers)."""
    add, scale = kit.kernel("add"), kit.kernel("scale_ws")
    xs, ys, zs, w, ws = (memory.alloc(N * 4) for _ in range(5))
    launches = [kit.prepare(add, [xs.ptr, ys.ptr, zs.ptr], [N], None, memory.stream),
                kit.prepare(scale, [zs.ptr, w.ptr], [N], ws.ptr, memory.stream)]
    return launches, (xs, ys, zs, w)


def expected(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.float32(2) * (x + y) + np.float32(1)


def inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)


@conformance("fusion.equals_eager")
def test_fused_equals_eager(backend, kit, memory):
    launches, (xs, ys, zs, w) = two_launches(kit, memory)
    fused = backend.fuse(launches)
    if fused is None:
        lacks("fuse", f"the {backend.kind} backend's fuse() returned None")
    x, y = inputs(11)
    memory.write(xs.ptr, x)
    memory.write(ys.ptr, y)
    for launch in launches:
        check(launch.call() == 0, "fusion.equals_eager", "the eager launches to return 0", "a failure code")
    eager = memory.read_array(w.ptr, np.float32, N)
    backend.memset(w.ptr, 0, N * 4, memory.stream)
    backend.memset(zs.ptr, 0, N * 4, memory.stream)
    code = fused.call()
    check(code == 0, "fusion.equals_eager", "the fused call to return 0", code)
    got = memory.read_array(w.ptr, np.float32, N)
    check(values_differ(eager, got) is None, "fusion.equals_eager", "the fused run to equal the eager run",
          lambda: values_differ(eager, got))
    check(values_differ(expected(x, y), got) is None, "fusion.equals_eager", "2 * (x + y) + 1",
          lambda: values_differ(expected(x, y), got))


@conformance("fusion.failure_position")
def test_fused_failure_position(backend, kit, memory):
    add, failing = kit.kernel("add"), kit.kernel("fail_code")
    bufs = [memory.alloc(N * 4) for _ in range(5)]
    launches = [kit.prepare(add, [b.ptr for b in bufs[:3]], [N], None, memory.stream),
                kit.prepare(failing, [bufs[3].ptr, bufs[4].ptr], [N], None, memory.stream)]
    fused = backend.fuse(launches)
    if fused is None:
        lacks("fuse", f"the {backend.kind} backend's fuse() returned None")
    position = fused.call()
    check(position == 2, "fusion.failure_position", "call() to return 2 (the failing launch's 1-based position)",
          position)
    check(fused.code() == 7, "fusion.failure_position", "code() to give the failing launch's code 7", fused.code())


@conformance("capture.replay")
def test_capture_replay(backend, device_index, kit, memory):
    launches, (xs, ys, zs, w) = two_launches(kit, memory)
    x0, y0 = inputs(12)
    memory.write(xs.ptr, x0)
    memory.write(ys.ptr, y0)
    memory.sync()
    codes: list[int] = []

    def run() -> None:
        codes.extend(launch.call() for launch in launches)

    try:
        replayable = backend.capture(run, stream=memory.stream, device_index=device_index)
    except Unsupported as exc:
        lacks("capture", str(exc))
    try:
        x, y = inputs(13)
        memory.write(xs.ptr, x)
        memory.write(ys.ptr, y)
        replayable.replay(memory.stream)
        got = memory.read_array(w.ptr, np.float32, N)
        check(not any(codes), "capture.replay", "the captured launches to return 0", codes)
        check(values_differ(expected(x, y), got) is None, "capture.replay",
              "a replay after new inputs to equal the eager result on them", lambda: values_differ(expected(x, y), got))
    finally:
        replayable.close()
