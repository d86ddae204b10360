"""Shared test helpers: a second device kind on host memory, registries, small graphs.

``HostKindBackend`` is a real backend (real allocations, real copies, real C kernels through the
CPU plugin) under its own kind name and workspace slot: the shape a third-party plugin takes
(device contract v2), and the second kind that multi-device and wrong-device tests need.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import attrs
import numpy as np

from engine.backend import Availability, BackendBase, BinaryPayload, CandidateSpec, ReferenceKernel, Stream
from engine.plugins import Registry
from engine.settings import Settings
from engine.storage import Storage


class HostKindBackend(BackendBase):
    """Host memory under another kind name; kernels are the CPU plugin's (same ABI).

    Pointers are host addresses (``int``); slot 4, since 0-3 are reserved for the first-party kinds.
    """

    kind = "hostdev"
    workspace_slot = 4
    api_version = (2, 0)
    dlpack_device_type = 14  # an arbitrary non-CPU code: tensors of this kind are copied, not shared
    formats = ("elf-so", "c-source")
    languages = ("c",)
    alignment = 64
    host_accessible = False

    def __init__(self, cpu: BackendBase):
        self._cpu = cpu

    def availability(self) -> Availability:
        return Availability(True, 1, ("host memory posing as a device",))

    def _allocate(self, nbytes: int, device_index: int, stream: Stream) -> Storage:
        buf = np.empty(nbytes + 64, np.uint8)
        addr = buf.ctypes.data
        pad = -addr % 64
        return Storage(self.device(device_index), addr + pad, nbytes, owner=buf, stream=stream)

    def copy_from_host(self, dst, src_host, nbytes, stream=None):
        ctypes.memmove(dst, src_host, nbytes)

    def copy_to_host(self, dst_host, src, nbytes, stream=None):
        ctypes.memmove(dst_host, src, nbytes)

    def copy_device(self, dst, src, nbytes, stream=None):
        ctypes.memmove(dst, src, nbytes)

    def memset(self, dst, value, nbytes, stream=None):
        ctypes.memset(dst, value, nbytes)

    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        return self._cpu.loadable(binary_format, target, 0)

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int):
        # The CPU backend loads this one binary through its public API (selection already happened).
        return self._cpu.load_kernel(attrs.evolve(spec, binaries=(binary,)), 0)

    def compile(self, source, language, options=None):
        return self._cpu.compile(source, language, options)


def run_in_threads(work, n: int) -> None:
    """Run ``work(i)`` for i in 0..n-1 in ``n`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def make_registry(cache_dir: Path, *, with_hostdev: bool = False) -> Registry:
    registry = Registry(Settings(cache_dir=cache_dir))
    registry.load_entry_points()
    if with_hostdev:
        registry.register_backend(HostKindBackend(registry.backend("cpu")), distribution="tests")
    return registry


def run_reference_kernel(backend: BackendBase, ref: ReferenceKernel, entry: str, inputs: list[np.ndarray],
                         output_shapes: list[tuple[int, ...]], symbols: dict[str, int], *,
                         workspace_bytes: int = 0, defines: str = "", name: str = "ref") -> list[np.ndarray]:
    """Compile ``ref`` (with ``defines`` in front), load ``entry`` and run it once on ``backend``.

    Only the backend's public contract is used (compile, load_kernel, allocate, copies, launch),
    so this works for device memory as well as host memory. Float32 inputs and outputs.
    """
    binaries = backend.compile(defines + ref.source, ref.language, ref.options)
    spec = CandidateSpec(name, 0, entry, tuple(binaries), None, len(inputs), len(output_shapes),
                         tuple(symbols), workspace_bytes > 0)
    kernel = backend.load_kernel(spec, 0)
    stream = backend.current_stream(0)
    buffers = []
    for array in inputs:
        array = np.ascontiguousarray(array, np.float32)
        storage = backend.allocate(array.nbytes, 0, stream)
        backend.copy_from_host(storage.ptr, array.ctypes.data, array.nbytes, stream)
        buffers.append(storage)
    outputs = [np.zeros(shape, np.float32) for shape in output_shapes]
    buffers += [backend.allocate(out.nbytes, 0, stream) for out in outputs]
    workspace = backend.allocate(workspace_bytes, 0, stream) if workspace_bytes else None
    kernel.launch([b.ptr for b in buffers], list(symbols.values()),
                  workspace.ptr if workspace is not None else None, stream)
    for out, storage in zip(outputs, buffers[len(inputs):]):
        backend.copy_to_host(out.ctypes.data, storage.ptr, out.nbytes, stream)
    backend.synchronize(0, stream)
    return outputs


def check_reference_kernels(backend: BackendBase) -> None:
    """Run every reference kernel ``backend`` provides and compare with numpy (the semantics that
    ``engine.testing`` documents); ``fail_code`` must raise a ``KernelError`` naming code 7."""
    from engine.errors import KernelError

    refs = backend.reference_kernels()
    assert set(refs) >= {"add", "scale_ws", "busy", "mlp_matmul", "mlp_bias_relu", "mlp_bias_add", "mlp_softmax"}
    rng = np.random.default_rng(7)
    n = 37
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    (z,) = run_reference_kernel(backend, refs["add"], refs["add"].entries[0], [x, y], [(n,)], {"n": n})
    np.testing.assert_array_equal(z, x + y)
    (z,) = run_reference_kernel(backend, refs["scale_ws"], refs["scale_ws"].entries[0], [x], [(n,)], {"n": n},
                                workspace_bytes=n * 4)
    np.testing.assert_array_equal(z, 2 * x + 1)
    (z,) = run_reference_kernel(backend, refs["busy"], refs["busy"].entries[0], [x], [(n,)],
                                {"n": n, "iters": 100})
    expected = x.copy()
    for _ in range(100):
        expected += np.float32(1)
    np.testing.assert_array_equal(z, expected)
    if "fail_code" in refs:
        try:
            run_reference_kernel(backend, refs["fail_code"], refs["fail_code"].entries[0], [x], [(n,)], {"n": n},
                                 name="failing")
        except KernelError as exc:
            assert "kernel 'failing'" in str(exc) and "code 7" in str(exc), exc
        else:
            raise AssertionError("fail_code did not fail")

    batch, k, m = 3, 8, 16
    dims = f"#define K {k}\n#define N {m}\n"
    a = rng.standard_normal((batch, k)).astype(np.float32)
    w = rng.standard_normal((k, m)).astype(np.float32)
    assert len(refs["mlp_matmul"].entries) >= 1
    for entry in refs["mlp_matmul"].entries:
        (c,) = run_reference_kernel(backend, refs["mlp_matmul"], entry, [a, w], [(batch, m)], {"batch": batch},
                                    defines=dims)
        np.testing.assert_allclose(c, a @ w, rtol=1e-5, atol=1e-5)
    h = rng.standard_normal((batch, m)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    (r,) = run_reference_kernel(backend, refs["mlp_bias_relu"], refs["mlp_bias_relu"].entries[0], [h, bias],
                                [(batch, m)], {"batch": batch}, defines=dims)
    np.testing.assert_array_equal(r, np.maximum(h + bias, 0))
    (r,) = run_reference_kernel(backend, refs["mlp_bias_add"], refs["mlp_bias_add"].entries[0], [h, bias],
                                [(batch, m)], {"batch": batch}, defines=dims)
    np.testing.assert_array_equal(r, h + bias)
    (p,) = run_reference_kernel(backend, refs["mlp_softmax"], refs["mlp_softmax"].entries[0], [h], [(batch, m)],
                                {"batch": batch}, workspace_bytes=batch * 4, defines=dims)
    e = np.exp(h.astype(np.float64) - h.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


#: Two candidates with the same result (y = 2x), for chains of many multi-candidate kernels.
TWICE_C = r"""
#include <stdint.h>
int32_t twice_forward(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] * 2.0f;
    return 0;
}
int32_t twice_backward(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = sym[0] - 1; i >= 0; i--) y[i] = x[i] + x[i];
    return 0;
}
int32_t always_fails(void *const *t, const int64_t *sym, void *ws) { return 7; }
"""


def chain_bundle(registry: Registry, path: Path, kernels: int) -> Path:
    """A bundle with many multi-candidate kernels: y = 2**kernels * x through ``kernels`` kernels of
    two candidates each (``double_0``, ``double_1``, ...; entries ``twice_forward``, ``twice_backward``)."""
    from engine.build import GraphBuilder

    b = GraphBuilder("chain", registry=registry)
    x = b.input("x", "float32", ["n"])
    for i in range(kernels):
        k = b.kernel(f"double_{i}", entries=["twice_forward", "twice_backward"], source=TWICE_C)
        (x,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(x, "y")
    b.save(path)
    return path
