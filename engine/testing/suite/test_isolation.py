"""Many threads at once: one backend object serves every thread, each with its own stream,
buffers and workspace, and kernels run concurrently (the core shares nothing between threads)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.testing.buffers import DeviceMemory
from engine.testing.checks import check, values_differ

conformance = pytest.mark.conformance

THREADS = 8
ROUNDS = 6
N = 1 << 15


@conformance("isolation.threads")
def test_threads(backend, device_index, kit):
    """Each round: every thread writes its inputs, all wait, all launch scale_ws then add, all wait,
    all read back. A buffer or workspace shared between threads shows as another thread's values."""
    scale, add = kit.kernel("scale_ws"), kit.kernel("add")
    barrier = threading.Barrier(THREADS, timeout=120)
    failures: list[str] = []
    errors: list[BaseException] = []

    def work(t: int) -> None:
        stream = backend.current_stream(device_index)
        memory = DeviceMemory(backend, device_index, stream)
        try:
            xs, ys, ws, zs = (memory.alloc(N * 4) for _ in range(4))
            for r in range(ROUNDS):
                x = (np.arange(N, dtype=np.float32) % 251) * np.float32(t + 1) + np.float32(r)
                memory.write(xs.ptr, x)
                memory.sync()
                barrier.wait()
                kit.launch(scale, [xs.ptr, ys.ptr], [N], ws.ptr, stream)
                kit.launch(add, [xs.ptr, ys.ptr, zs.ptr], [N], None, stream)
                memory.sync()
                barrier.wait()
                z = memory.read_array(zs.ptr, np.float32, N)
                want = x + (np.float32(2) * x + np.float32(1))
                problem = values_differ(want, z)
                if problem is not None:
                    failures.append(f"thread {t} round {r}: {problem}")
        except threading.BrokenBarrierError:
            pass  # another thread failed; its error is reported
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            barrier.abort()
        finally:
            memory.close()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    check(not failures, "isolation.threads", f"{THREADS} threads x {ROUNDS} rounds of scale_ws + add, all correct",
          lambda: f"{len(failures)} wrong results; {'; '.join(failures[:3])}")
