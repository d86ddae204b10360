"""What the core does for devices under contract v2, seen from a device whose memory is handles.

``HandleBackend`` is a real backend on host memory (real copies, the CPU plugin's compiled kernels)
that behaves like an OpenCL-style device towards the core: pointers are ``BufferPtr(buffer,
offset)``, never integers; its current stream is chosen per thread; it records every
``synchronize``, every release (with the stream it was ordered on) and the launch dimensions its
kernels are prepared with; and it can cap its largest allocation. The tests check the core's side
of the contract: only ``ptr + n`` on pointers, launch dimensions evaluated by the core, events
instead of device-wide synchronizes, stream-ordered release, and workspaces split into segments.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import attrs
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import engine
from engine.backend import BackendBase, BufferPtr, KernelBase
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.runtime.memory import plan_blocks, segment_offsets
from engine.runtime.plan import WORKSPACE
from engine.settings import Settings
from engine.storage import Storage
from support import HostKindBackend

CHAIN_C = r"""
#include <stdint.h>
int32_t twice(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] * 2.0f;
    return 0;
}
int32_t add8(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *b = t[1]; float *y = t[2];
    for (int64_t i = 0; i < 8; i++) y[i] = x[i] + b[i];
    return 0;
}
/* y = x * 2 + 1 through the workspace */
int32_t scale_ws(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1]; float *w = ws;
    for (int64_t i = 0; i < sym[0]; i++) w[i] = x[i] * 2.0f;
    for (int64_t i = 0; i < sym[0]; i++) y[i] = w[i] + 1.0f;
    return 0;
}
"""


class _Buffer:
    """A device 'buffer': an aligned host allocation known to the backend by its handle."""

    __slots__ = ("array", "base", "__weakref__")

    def __init__(self, nbytes: int, alignment: int):
        self.array = np.empty(nbytes + alignment, np.uint8)
        address = self.array.ctypes.data
        self.base = address + (-address % alignment)


class HandleBackend(HostKindBackend):
    """Host memory addressed by ``BufferPtr``; records syncs, releases and launch dimensions."""

    kind = "handledev"
    workspace_slot = 11
    has_streams = True

    def __init__(self, cpu: BackendBase, max_alloc: int | None = None):
        super().__init__(cpu)
        self.max_alloc = max_alloc
        self._current = threading.local()
        self._lock = threading.Lock()
        self._buffers: weakref.WeakValueDictionary[int, _Buffer] = weakref.WeakValueDictionary()
        self.syncs: list[tuple[int, object]] = []
        self.releases: list[object] = []
        self.dims: list[object] = []

    # streams
    def use_stream(self, stream: int) -> None:
        self._current.stream = stream

    def current_stream(self, device_index: int = 0) -> object:
        return getattr(self._current, "stream", 0)

    def synchronize(self, device_index: int = 0, stream: object = None) -> None:
        with self._lock:
            self.syncs.append((device_index, stream))

    # memory
    def max_allocation(self, device_index: int = 0) -> int | None:
        return self.max_alloc

    def _allocate(self, nbytes, device_index, stream):
        if self.max_alloc is not None and nbytes > self.max_alloc:
            raise MemoryError(f"{nbytes} bytes is over the device's largest allocation ({self.max_alloc})")
        buffer = _Buffer(nbytes, self.alignment)
        self._buffers[buffer.base] = buffer
        releases = self.releases
        return Storage(self.device(device_index), BufferPtr(buffer), nbytes, owner=buffer, stream=stream,
                       release=releases.append)

    @staticmethod
    def address(ptr: BufferPtr | None) -> int:
        if ptr is None:  # a graph input or output at prepare time: set before any call
            return 0
        assert isinstance(ptr, BufferPtr), f"the core handed a {type(ptr).__name__} to a handle device"
        return ptr.buffer.base + ptr.offset

    def copy_from_host(self, dst, src_host, nbytes, stream=None):
        ctypes.memmove(self.address(dst), src_host, nbytes)

    def copy_to_host(self, dst_host, src, nbytes, stream=None):
        ctypes.memmove(dst_host, self.address(src), nbytes)

    def copy_device(self, dst, src, nbytes, stream=None):
        ctypes.memmove(self.address(dst), self.address(src), nbytes)

    def memset(self, dst, value, nbytes, stream=None):
        ctypes.memset(self.address(dst), value, nbytes)

    def export_pointer(self, ptr):
        return ptr.buffer.base, ptr.offset

    def import_pointer(self, data, byte_offset, device_index=0, owner=None):
        return BufferPtr(self._buffers[data], byte_offset)

    # kernels: the CPU plugin's, called with the addresses behind the handles
    def _load_binary(self, spec, binary, device_index):
        return HandleKernel(spec, binary, self._cpu.load_kernel(attrs.evolve(spec, binaries=(binary,)), 0), self)


class HandleKernel(KernelBase):
    device_name = "handledev"

    def __init__(self, spec, binary, cpu_kernel, backend: HandleBackend):
        super().__init__(spec, binary)
        self.cpu_kernel = cpu_kernel
        self.backend = backend

    def _prepare(self, tensors, symbol_values, workspace, stream, dims):
        self.backend.dims.append(dims)
        address = self.backend.address
        inner = self.cpu_kernel.prepare([address(p) for p in tensors], symbol_values,
                                        None if workspace is None else address(workspace), None, dims)
        return HandleLaunch(inner, address)


class HandleLaunch:
    def __init__(self, inner, address):
        self.inner = inner
        self.call = inner.call
        self._set = inner.set_tensor
        self._address = address
        self.fail = inner.fail

    def set_tensor(self, index, ptr):
        self._set(index, self._address(ptr))


@pytest.fixture()
def handles(tmp_path):
    registry = Registry(Settings(cache_dir=tmp_path), autoload=False)
    import engine_cpu.plugin

    registry.register_plugin(engine_cpu.plugin)
    backend = HandleBackend(registry.backend("cpu"))
    registry.register_backend(backend, distribution="tests")
    return registry, backend


def _chain(registry, device="handledev", *, launch=None):
    """x -> twice -> scale_ws (workspace) -> y, all on ``device``."""
    b = GraphBuilder("chain", registry=registry)
    x = b.input("x", "float32", ["n"], device=device)
    k_twice = b.kernel("twice", entries=["twice"], source=CHAIN_C, device=device, launch=launch)
    k_ws = b.kernel("scale_ws", entries=["scale_ws"], source=CHAIN_C, device=device)
    (h,) = b.call(k_twice, [x], [("float32", ["n"])], symbols=["n"])
    (y,) = b.call(k_ws, [h], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    return b.build()


def _expected(x: np.ndarray) -> np.ndarray:
    return x * 4 + 1


def test_handle_pointers_run_graphs_and_copies(handles):
    registry, backend = handles
    graph = _chain(registry)
    for n in (1, 7, 1000):
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        xd = engine.asarray(x, device="handledev", registry=registry)
        assert isinstance(xd.storage.ptr, BufferPtr)
        (y,) = graph.run_async([xd])
        assert isinstance(y.storage.ptr, BufferPtr)
        np.testing.assert_allclose(y.numpy(), _expected(x), rtol=1e-6)
        np.testing.assert_allclose(y.to("cpu", registry=registry).numpy(), _expected(x), rtol=1e-6)
        assert y.to("handledev", registry=registry) is y
    # the interpreted path (a hook) and a capture compute the same
    seen = []
    graph.register_hook(lambda pos, ins, outs: seen.append([o.numpy().copy() for o in outs]))
    x = np.ones(5, np.float32)
    (y,) = graph.run_async([engine.asarray(x, device="handledev", registry=registry)])
    np.testing.assert_allclose(y.numpy(), _expected(x))
    np.testing.assert_allclose(seen[-1][0], _expected(x))


def test_weights_live_in_device_buffers_and_can_be_replaced(handles):
    registry, backend = handles
    b = GraphBuilder("weighted", registry=registry)
    x = b.input("x", "float32", [8], device="handledev")
    w = b.weight("w", np.arange(8, dtype=np.float32), device="handledev")
    k = b.kernel("add8", entries=["add8"], source=CHAIN_C, device="handledev")
    (y,) = b.call(k, [x, w], [("float32", [8])])
    b.output(y)
    graph = b.build()
    assert isinstance(graph.weights[0].storage.ptr, BufferPtr)
    x = engine.asarray(np.ones(8, np.float32), device="handledev", registry=registry)
    np.testing.assert_array_equal(graph.run_async([x])[0].numpy(), np.arange(8) + 1)
    graph.set_weights([engine.asarray(np.full(8, 5, np.float32), device="handledev", registry=registry)])
    np.testing.assert_array_equal(graph.run_async([x])[0].numpy(), np.full(8, 6))


def test_graphs_mixing_cpu_and_a_handle_device(handles):
    registry, backend = handles
    b = GraphBuilder("mixed", registry=registry)
    x = b.input("x", "float32", ["n"])
    k_cpu = b.kernel("twice", entries=["twice"], source=CHAIN_C)
    k_dev = b.kernel("scale_ws", entries=["scale_ws"], source=CHAIN_C, device="handledev")
    (h,) = b.call(k_cpu, [x], [("float32", ["n"])], symbols=["n"])
    (y,) = b.call(k_dev, [b.copy(h, "handledev")], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    (z,) = b.call(k_cpu, [b.copy(y, "cpu")], [("float32", ["n"])], symbols=["n"])
    b.output(z, "z")
    graph = b.build()
    for n in (3, 300):
        x = np.arange(n, dtype=np.float32)
        (z,) = graph.run_async([x])
        np.testing.assert_allclose(z.numpy(), (x * 4 + 1) * 2)


def test_launch_dimensions_are_evaluated_by_the_core(handles):
    registry, backend = handles
    graph = _chain(registry, launch={"grid": ["ceil_div(n, 4)", 1, 1], "block": [4, 1, 1], "shared_memory": "n * 2"})
    backend.dims.clear()
    x = np.ones(10, np.float32)
    graph.run_async([engine.asarray(x, device="handledev", registry=registry)])
    given = [d for d in backend.dims if d is not None]
    assert given and all(d.grid == (3, 1, 1) and d.block == (4, 1, 1) and d.shared_memory == 20 for d in given)
    assert given[0].global_size == (12, 1, 1)


def test_runs_and_reads_wait_on_streams_not_on_the_device(handles):
    registry, backend = handles
    graph = _chain(registry)
    x = np.arange(64, dtype=np.float32)
    backend.use_stream(7)
    xd = engine.asarray(x, device="handledev", registry=registry)
    graph.run_async([xd])  # prepares the key
    backend.syncs.clear()
    (y,) = graph.run_async([xd])
    np.testing.assert_allclose(y.numpy(), _expected(x))
    y.to("cpu", registry=registry)
    np.from_dlpack(engine.from_dlpack(y.__dlpack__(max_version=(1, 0)), registry=registry).to("cpu", registry=registry))
    assert backend.syncs, "reading device memory waits for something"
    assert all(stream is not None for _, stream in backend.syncs), backend.syncs  # never the whole device
    assert {stream for _, stream in backend.syncs} == {7}


def test_memory_is_released_on_the_stream_that_last_used_it(handles):
    registry, backend = handles
    graph = _chain(registry)
    backend.use_stream(3)
    (y,) = graph.run_async([engine.asarray(np.ones(8, np.float32), device="handledev", registry=registry)])
    assert y.storage.stream == 3
    backend.releases.clear()
    del y
    gc.collect()
    assert backend.releases == [3]  # the fresh output, ordered after the run's stream
    # a workspace that grows is released after the work queued with it
    backend.releases.clear()
    graph.run_async([engine.asarray(np.ones(4096, np.float32), device="handledev", registry=registry)])
    gc.collect()
    assert 3 in backend.releases and None not in backend.releases


def test_a_workspace_over_the_largest_allocation_is_split_into_segments(handles):
    registry, backend = handles
    backend.max_alloc = 4096
    graph = _chain(registry)
    n = 900  # 3,600-byte tensors: the intermediate and the kernel's scratch cannot share one segment
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    (y,) = graph.run_async([engine.asarray(x, device="handledev", registry=registry)])
    np.testing.assert_allclose(y.numpy(), _expected(x), rtol=1e-6)
    plan = graph.runtime.key_plan((n,))
    assert plan.segment_bytes == {"handledev": 4096} and plan.workspace_bytes["handledev"] > 4096
    lane = graph.runtime.lane()
    workspace = lane.workspaces["handledev"]
    assert len(workspace.storages) >= 2 and all(s.nbytes <= 4096 for s in workspace.storages)
    blocks = [(off, plan.nbytes[t]) for t, (where, off, kind) in enumerate(plan.placements) if where == WORKSPACE]
    blocks += [(s[1], s[2]) for s in plan.scratch if s is not None]
    assert all(off // 4096 == (off + size - 1) // 4096 for off, size in blocks if size)


def test_a_block_larger_than_a_segment_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match="a block of 300 bytes is larger than the device's largest allocation "
                                         r"\(256 bytes\)"):
        segment_offsets(np.array([0, 300], np.int64), np.array([300, 10], np.int64), 256)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8), st.integers(1, 64)), min_size=1, max_size=40),
       segment=st.integers(256, 1024))
def test_segmented_plans_keep_blocks_apart_and_inside_one_segment(data, segment):
    starts = [s for s, _, _ in data]
    ends = [s + length for s, length, _ in data]
    sizes = np.array([z * 4 for _, _, z in data], np.int64)
    offsets, _ = plan_blocks(starts, ends, sizes.tolist())
    moved, peak = segment_offsets(np.array(offsets, np.int64), sizes, segment)
    for i in range(len(data)):
        assert moved[i] // segment == (moved[i] + sizes[i] - 1) // segment
        for j in range(i):
            live_together = starts[i] <= ends[j] and starts[j] <= ends[i]
            if live_together:
                assert moved[i] + sizes[i] <= moved[j] or moved[j] + sizes[j] <= moved[i]
    assert peak == int((moved + sizes).max())


def test_a_run_waits_for_inputs_produced_on_another_stream(handles):
    registry, backend = handles
    graph = _chain(registry)
    x = np.arange(16, dtype=np.float32)
    produced = {}

    def producer() -> None:
        backend.use_stream(1)
        (produced["y"],) = graph.run_async([engine.asarray(x, device="handledev", registry=registry)])

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join()
    y = produced["y"]
    assert y.storage.stream == 1
    backend.use_stream(2)
    backend.syncs.clear()
    (z,) = graph.run_async([y])
    assert (0, 1) in backend.syncs  # an event on the producer's stream before the consumer's work
    assert y.storage.stream == 2    # the input's release now follows the run that read it
    np.testing.assert_allclose(z.numpy(), _expected(_expected(x)), rtol=1e-6)


def test_segments_are_the_allocation_cap_rounded_down_to_the_alignment(handles):
    registry, backend = handles
    backend.max_alloc = 4096 + 40  # not a multiple of the 64-byte alignment
    graph = _chain(registry)
    x = np.ones(900, np.float32)
    (y,) = graph.run_async([engine.asarray(x, device="handledev", registry=registry)])
    np.testing.assert_allclose(y.numpy(), _expected(x))
    plan = graph.runtime.key_plan((900,))
    assert plan.segment_bytes == {"handledev": 4096}
    assert all(s.ptr.offset % 64 == 0 and s.ptr.buffer.base % 64 == 0
               for s in graph.runtime.lane().workspaces["handledev"].storages)


class Recorded:
    """A recorded run that counts its replays and whether it was released."""

    def __init__(self, run):
        self.run, self.streams, self.closed = run, [], False

    def replay(self, stream=None):
        self.streams.append(stream)
        self.run()

    def close(self):
        self.closed = True


class CapturingBackend(HandleBackend):
    kind = "capdev"
    workspace_slot = 12

    def capture(self, run_fn, *, stream=None, device_index=0):
        self.recorded = Recorded(run_fn)
        return self.recorded


def test_captures_replay_on_a_stream_and_release_what_the_backend_recorded(tmp_path):
    registry = Registry(Settings(cache_dir=tmp_path), autoload=False)
    import engine_cpu.plugin

    registry.register_plugin(engine_cpu.plugin)
    backend = CapturingBackend(registry.backend("cpu"))
    registry.register_backend(backend, distribution="tests")
    graph = _chain(registry, device="capdev")
    backend.use_stream(4)
    x = engine.asarray(np.arange(6, dtype=np.float32), device="capdev", registry=registry)
    captured = graph.capture(x)
    assert captured.method == "capdev capture"
    captured.replay()
    captured.replay(stream=9)
    # once when captured (the outputs hold the example's results), then the capture's own stream,
    # then the one asked for
    assert backend.recorded.streams == [4, 4, 9]
    assert captured.outputs[0].storage.stream == 9
    np.testing.assert_allclose(captured.outputs[0].numpy(), _expected(np.arange(6)))
    captured.close()
    assert backend.recorded.closed


def test_native_captures_replay_only_on_their_own_streams(handles):
    registry, backend = handles  # HandleBackend cannot record: the replay is its prepared launches
    graph = _chain(registry)
    backend.use_stream(4)
    captured = graph.capture(engine.asarray(np.ones(3, np.float32), device="handledev", registry=registry))
    assert captured.method == "native launches"
    captured.replay(stream=4)
    with pytest.raises(engine.InputError, match="bound to the streams it was captured on"):
        captured.replay(stream=5)
