"""Tests of the CPU device plugin (``engine-cpu``) with real compiled C, real files, real processes.

Every test builds its own ``CpuBackend(cache_dir=tmp_path)`` so caches never leak between tests.
The plugin speaks device contract v2: pointers are host addresses (``int``), ``None`` is the null
workspace, and binary selection is ``BackendBase.load_kernel``'s.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.backend import API_VERSION, BinaryPayload, CandidateSpec, KernelBase, PreparedLaunch
from engine.errors import DeviceUnavailableError, KernelError, Unsupported
from engine.plugins import Registry
from engine.settings import Settings

from engine_cpu import CompilerError, CpuBackend, CpuFusedLaunch, CpuKernel, CpuPreparedLaunch, host_target
from engine_cpu.plugin import engine_backends
from engine_cpu.program import ProgramLoader
from support import check_reference_kernels

KERNELS = r"""
#include <stdint.h>

int32_t vadd(void *const *t, const int64_t *s, void *ws) {
    const float *a = t[0], *b = t[1];
    float *c = t[2];
    for (int64_t i = 0; i < s[0]; ++i) c[i] = a[i] + b[i];
    return 0;
}

/* out = 3 * in, staged through the workspace. */
int32_t triple_ws(void *const *t, const int64_t *s, void *ws) {
    const float *in = t[0];
    float *out = t[1], *tmp = ws;
    if (ws == 0) return 11;
    for (int64_t i = 0; i < s[0]; ++i) tmp[i] = in[i] * 2.0f;
    for (int64_t i = 0; i < s[0]; ++i) out[i] = tmp[i] + in[i];
    return 0;
}

int32_t ws_is_null(void *const *t, const int64_t *s, void *ws) { return ws == 0 ? 0 : 9; }

int32_t fail7(void *const *t, const int64_t *s, void *ws) { return 7; }

int32_t fail5(void *const *t, const int64_t *s, void *ws) { return 5; }

int32_t mul2(void *const *t, const int64_t *s, void *ws) {
    const float *a = t[0]; float *b = t[1];
    for (int64_t i = 0; i < s[0]; ++i) b[i] = a[i] * 2.0f;
    return 0;
}

int32_t add1(void *const *t, const int64_t *s, void *ws) {
    const float *a = t[0]; float *b = t[1];
    for (int64_t i = 0; i < s[0]; ++i) b[i] = a[i] + 1.0f;
    return 0;
}

int32_t square(void *const *t, const int64_t *s, void *ws) {
    const float *a = t[0]; float *b = t[1];
    for (int64_t i = 0; i < s[0]; ++i) b[i] = a[i] * a[i];
    return 0;
}
"""

HANDSHAKE = r"""
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <time.h>

/* Spin until *flag becomes 1 (set by set_flag on another thread); give up with code 1 after ~60 s. */
int32_t wait_for_flag(void *const *t, const int64_t *s, void *ws) {
    volatile int32_t *flag = t[0];
    struct timespec ms = {0, 1000000L};
    for (int i = 0; i < 60000; i++) {
        if (*flag == 1) return 0;
        nanosleep(&ms, 0);
    }
    return 1;
}
int32_t set_flag(void *const *t, const int64_t *s, void *ws) {
    volatile int32_t *flag = t[0];
    *flag = 1;
    return 0;
}
"""

OPENMP = r"""
#include <stdint.h>
#include <omp.h>

int32_t omp_vadd(void *const *t, const int64_t *s, void *ws) {
    const double *a = t[0], *b = t[1];
    double *c = t[2];
    #pragma omp parallel for
    for (int64_t i = 0; i < s[0]; ++i) c[i] = a[i] + b[i];
    return 0;
}

int32_t omp_threads(void *const *t, const int64_t *s, void *ws) {
    int32_t *out = t[0];
    out[0] = omp_get_max_threads();
    return 0;
}
"""


# -- helpers -----------------------------------------------------------------------------------
def c_source(source: str, path: str = "kernels.c") -> BinaryPayload:
    return BinaryPayload("c-source", "any", path, source.encode())


def spec_for(binaries, entry: str, *, name: str | None = None, inputs: int = 1, outputs: int = 1,
             symbols: tuple[str, ...] = ("n",), workspace: bool = False, index: int = 0) -> CandidateSpec:
    if isinstance(binaries, BinaryPayload):
        binaries = (binaries,)
    return CandidateSpec(name or entry, index, entry, tuple(binaries), None, inputs, outputs, symbols,
                         workspace)


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.fixture
def backend(tmp_path: Path) -> CpuBackend:
    return CpuBackend(cache_dir=tmp_path)


@pytest.fixture
def kernels_so(backend: CpuBackend) -> BinaryPayload:
    (payload,) = backend.compile(KERNELS, "c", {"entry": "kernels"})
    return payload


# -- declaration and discovery -----------------------------------------------------------------
def test_backend_declares_the_contract(backend: CpuBackend) -> None:
    assert backend.kind == "cpu"
    assert backend.workspace_slot == 0
    assert backend.api_version == API_VERSION == (2, 0)
    assert backend.dlpack_device_type == 1
    assert backend.formats == ("elf-so", "c-source")
    assert backend.languages == ("c",)
    assert backend.alignment == 64
    assert backend.host_accessible is True
    avail = backend.availability()
    assert avail.available and avail.device_count == 1 and backend.device_count() == 1
    assert len(avail.device_names) == 1 and "cores" in avail.device_names[0]
    assert backend.device() == "cpu"
    assert backend.current_stream() is None
    backend.synchronize()
    backend.synchronize(0, None)


def test_host_target_is_normalised_machine_and_os() -> None:
    machine, _, system = host_target().partition("-")
    assert machine == {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                                  platform.machine().lower())
    if sys.platform.startswith("linux"):
        assert system == "linux"


def test_discovered_through_the_entry_point(tmp_path: Path) -> None:
    registry = Registry(Settings(cache_dir=tmp_path))
    assert isinstance(registry.backend("cpu"), CpuBackend)
    (row,) = [d for d in registry.devices() if d.kind == "cpu"]
    assert row.available and row.device_count == 1
    assert row.distribution == "engine-cpu"
    assert row.workspace_slot == 0
    assert not [f for f in registry.failures() if "cpu" in f.kinds or f.distribution == "engine-cpu"]


def test_plugin_hook_is_cheap_and_reads_thread_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine.settings import Settings

    monkeypatch.setenv("ENGINE_CPU_NUM_THREADS", "3")
    (b,) = engine_backends(Settings.from_env({"ENGINE_CACHE_DIR": str(tmp_path / "from-settings")}))
    assert isinstance(b, CpuBackend) and b.num_threads == 3
    assert b.cache_dir == tmp_path / "from-settings"  # the registry's settings, not os.environ
    assert not (tmp_path / "from-settings").exists()  # construction creates nothing
    monkeypatch.setenv("ENGINE_CPU_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="ENGINE_CPU_NUM_THREADS"):
        CpuBackend(cache_dir=tmp_path)
    monkeypatch.delenv("ENGINE_CPU_NUM_THREADS")
    assert CpuBackend(cache_dir=tmp_path).num_threads is None


# -- allocator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000, 1 << 20])
def test_allocations_are_aligned_host_memory(backend: CpuBackend, nbytes: int) -> None:
    storage = backend.allocate(nbytes)
    assert storage.ptr % 64 == 0 and storage.ptr != 0
    assert storage.nbytes == nbytes and storage.device == "cpu"
    assert len(storage.host_view) == nbytes and not storage.readonly
    view = np.frombuffer(storage.host_view, dtype=np.uint8)
    if nbytes:
        assert view.ctypes.data == storage.ptr
        view[:] = 0xAB
        assert ctypes.string_at(storage.ptr, 1) == b"\xab"
    storage.close()
    storage.close()  # safe twice


def test_copies_and_memset_round_trip(backend: CpuBackend) -> None:
    src = np.arange(256, dtype=np.float32)
    a = backend.allocate(src.nbytes)
    b = backend.allocate(src.nbytes)
    backend.copy_from_host(a.ptr, addr(src), src.nbytes)
    a_view = np.frombuffer(a.host_view, dtype=np.float32)
    np.testing.assert_array_equal(a_view, src)
    backend.copy_device(b.ptr, a.ptr, src.nbytes)
    out = np.empty_like(src)
    backend.copy_to_host(addr(out), b.ptr, src.nbytes)
    np.testing.assert_array_equal(out, src)
    backend.memset(b.ptr, 0, 16)
    backend.memset(b.ptr + 16, 0xFF, 4)
    b_bytes = np.frombuffer(b.host_view, dtype=np.uint8)
    assert not b_bytes[:16].any() and (b_bytes[16:20] == 0xFF).all()
    np.testing.assert_array_equal(np.frombuffer(b.host_view, dtype=np.float32)[5:], src[5:])
    backend.copy_from_host(a.ptr, addr(src), 0)  # zero bytes is a no-op


def test_allocator_refuses_bad_arguments(backend: CpuBackend) -> None:
    with pytest.raises(ValueError):
        backend.allocate(-1)
    with pytest.raises(DeviceUnavailableError, match="cpu:1"):
        backend.allocate(16, device_index=1)
    s = backend.allocate(16)
    with pytest.raises(ValueError, match="byte"):
        backend.memset(s.ptr, 256, 16)
    with pytest.raises(ValueError, match="non-negative"):
        backend.copy_device(s.ptr, s.ptr, -5)


def test_prepare_allocation_gives_fresh_aligned_storages(backend: CpuBackend) -> None:
    allocate = backend.prepare_allocation(100, 0, None)
    first, second = allocate(), allocate()
    for storage in (first, second):
        assert storage.ptr % 64 == 0 and storage.nbytes == 100 and storage.device == "cpu"
        assert len(storage.host_view) == 100 and storage.stream is None
    assert first.ptr != second.ptr
    assert backend.prepare_allocation(0)().nbytes == 0
    with pytest.raises(ValueError, match="non-negative int"):
        backend.prepare_allocation(-1)
    with pytest.raises(ValueError, match="non-negative int"):
        backend.prepare_allocation(True)
    with pytest.raises(DeviceUnavailableError, match="cpu:1"):
        backend.prepare_allocation(16, device_index=1)


def test_events_on_a_synchronous_device(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernel = backend.load_kernel(spec_for(kernels_so, "mul2"))
    x = np.ones(64, np.float32)
    start, end = backend.create_event(0), backend.create_event(0)
    start.record(None)
    kernel.launch([addr(x), addr(x)], [64], None, None)
    end.record(None)
    end.wait(None)
    end.synchronize()
    assert start.query() and end.query()
    assert start.elapsed_ms(end) >= 0
    np.testing.assert_array_equal(x, 2)  # the work recorded before the event is done


# -- compiler ----------------------------------------------------------------------------------
def test_compile_gives_a_portable_elf_payload(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    assert kernels_so.format == "elf-so" and kernels_so.target == host_target()
    assert kernels_so.path == "kernels.so"
    assert bytes(kernels_so.data[:4]) == b"\x7fELF"
    flags = backend.compiler.flags_for(None)
    assert "-march=native" not in flags and {"-O3", "-shared", "-fPIC", "-std=c11"} <= set(flags)
    assert "-fopenmp" in backend.compiler.flags_for({"openmp": True})
    assert backend.compiler.flags_for({"flags": ["-march=native"]})[-1] == "-march=native"
    with pytest.raises(ValueError, match="unknown cpu compile option"):
        backend.compile(KERNELS, "c", {"opnemp": True})
    with pytest.raises(Unsupported):
        backend.compile(KERNELS, "cuda")


def test_compile_error_carries_the_compiler_log(backend: CpuBackend) -> None:
    with pytest.raises(KernelError) as info:
        backend.compile("int32_t broken(void) { return undeclared_name; }\n", "c")
    assert isinstance(info.value, CompilerError)
    assert "undeclared_name" in info.value.log and "error" in info.value.log
    assert "undeclared_name" in str(info.value)
    # The same through a bundle's c-source: the message also names kernel and candidate.
    spec = spec_for(c_source("int f( {", "bad.c"), "f", name="broken_kernel")
    with pytest.raises(CompilerError, match=r"kernel 'broken_kernel' candidate 0.*bad\.c") as info:
        backend.load_kernel(spec)
    assert info.value.log


def test_compile_cache_hit_skips_the_compiler(tmp_path: Path) -> None:
    first = CpuBackend(cache_dir=tmp_path)
    (a,) = first.compile(KERNELS, "c")
    first.compile(KERNELS, "c")
    assert first.compiler.invocations == 1
    second = CpuBackend(cache_dir=tmp_path)  # fresh process state, same disk cache
    (b,) = second.compile(KERNELS, "c")
    assert second.compiler.invocations == 0
    assert bytes(a.data) == bytes(b.data)
    (so,) = (tmp_path / "cpu" / "build").glob("*.so")
    assert (so.parent / (so.name + ".sha256")).read_text() == hashlib.sha256(so.read_bytes()).hexdigest()
    # Different flags are a different cache entry.
    second.compile(KERNELS, "c", {"flags": ["-O1"]})
    assert second.compiler.invocations == 1


def test_tampered_cache_files_are_detected_and_rebuilt(tmp_path: Path) -> None:
    first = CpuBackend(cache_dir=tmp_path)
    (payload,) = first.compile(KERNELS, "c")
    good = bytes(payload.data)
    (built,) = (tmp_path / "cpu" / "build").glob("*.so")
    built.write_bytes(good[:100] + b"tampered" + good[108:])
    # A stale/corrupt extracted copy under the right content-addressed name (e.g. another tool
    # wrote it). Never tamper with a file this process has mapped: dlopen'ed code lives in it.
    extracted = tmp_path / "cpu" / "so" / (hashlib.sha256(good).hexdigest() + ".so")
    extracted.parent.mkdir(parents=True)
    extracted.write_bytes(b"not the library")

    second = CpuBackend(cache_dir=tmp_path)
    (again,) = second.compile(KERNELS, "c")
    assert second.compiler.invocations == 1  # rebuilt, not trusted
    assert bytes(again.data) == good == built.read_bytes()
    kernel = second.load_kernel(spec_for(again, "vadd", inputs=2))
    # Loaded from memory (the bytes that were hashed): the extracted copy is neither read nor needed.
    assert extracted.read_bytes() == b"not the library"
    x = np.ones(4, np.float32)
    y = np.zeros(4, np.float32)
    kernel.launch([addr(x), addr(x), addr(y)], [4], None, None)
    np.testing.assert_array_equal(y, 2)
    # Where a platform cannot load from memory, the content store re-hashes the copy and rewrites it.
    fallback = ProgramLoader(tmp_path, second.compiler, from_memory=False)
    assert fallback.load_library(good, "the fallback").path == extracted
    assert extracted.read_bytes() == good


CONCURRENT_SCRIPT = textwrap.dedent(r"""
    import sys, time
    from pathlib import Path
    import numpy as np
    from engine.backend import BinaryPayload, CandidateSpec
    from engine_cpu import CpuBackend

    cache, go, source = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]).read_text()
    while not go.exists():
        time.sleep(0.001)
    b = CpuBackend(cache_dir=cache)
    src = BinaryPayload("c-source", "any", "k.c", source.encode())
    (so,) = b.compile(source, "c")
    k1 = b.load_kernel(CandidateSpec("vadd", 0, "vadd", (src,), None, 2, 1, ("n",), False))
    k2 = b.load_kernel(CandidateSpec("vadd", 1, "vadd", (so,), None, 2, 1, ("n",), False))
    x = np.arange(1000, dtype=np.float32)
    for k in (k1, k2):
        y = np.zeros_like(x)
        k.launch([x.ctypes.data, x.ctypes.data, y.ctypes.data], [1000], None, None)
        assert (y == 2 * x).all()
    print("OK", b.compiler.invocations)
""")


def test_concurrent_processes_share_one_cache_safely(tmp_path: Path) -> None:
    cache, go = tmp_path / "cache", tmp_path / "go"
    script, source = tmp_path / "worker.py", tmp_path / "kernels.c"
    script.write_text(CONCURRENT_SCRIPT)
    source.write_text(KERNELS)
    procs = [subprocess.Popen([sys.executable, str(script), str(cache), str(go), str(source)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    time.sleep(0.5)  # let every worker import and start polling
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.startswith("OK")
    # The per-key lock makes the losers wait and reuse the winner's build: one compile in all.
    assert sum(int(out.split()[1]) for out, _ in results) == 1
    names = sorted(p.name for p in (cache / "cpu" / "build").iterdir())
    assert len([n for n in names if n.endswith(".so") and not n.startswith(".")]) == 1, names
    assert not [n for n in names if ".tmp" in n], names  # no temporary left behind
    (built,) = (cache / "cpu" / "build").glob("*.so")
    assert Path(str(built) + ".sha256").read_text() == hashlib.sha256(built.read_bytes()).hexdigest()
    assert not (cache / "cpu" / "so").exists()  # shared objects load from memory: nothing extracted


# -- loading -----------------------------------------------------------------------------------
def test_launch_and_prepared_call_with_patched_tensors(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernel = backend.load_kernel(spec_for(kernels_so, "vadd", inputs=2))
    assert kernel.binary is kernels_so
    a = np.arange(100, dtype=np.float32)
    b = np.full(100, 0.5, np.float32)
    c = np.zeros(100, np.float32)
    kernel.launch([addr(a), addr(b), addr(c)], [100], None, None)
    np.testing.assert_array_equal(c, a + b)

    c2 = np.zeros(100, np.float32)
    prepared = kernel.prepare([addr(a), addr(b), addr(c2)], [50], None, None)
    assert isinstance(kernel, CpuKernel) and isinstance(kernel, KernelBase)
    assert isinstance(prepared, CpuPreparedLaunch) and isinstance(prepared, PreparedLaunch)
    assert prepared.call() == 0
    np.testing.assert_array_equal(c2[:50], (a + b)[:50])
    assert not c2[50:].any()  # the symbol value bound n = 50
    a2 = np.full(100, 10, np.float32)
    c3 = np.zeros(100, np.float32)
    prepared.set_tensor(0, addr(a2))
    prepared.set_tensor(2, addr(c3))
    assert prepared.call() == 0
    np.testing.assert_array_equal(c3[:50], 10.5)
    assert prepared.tensor_addrs() == (addr(a2), addr(b), addr(c3))
    assert prepared.function_addr == kernel.function_addr != 0
    assert prepared.tensor_array_addr and prepared.symbol_array_addr
    assert ctypes.c_void_p.from_address(prepared.tensor_array_addr).value == addr(a2)


def test_a_prepared_call_is_one_ctypes_call_over_prebuilt_arguments(backend: CpuBackend,
                                                                     kernels_so: BinaryPayload) -> None:
    """The fast path's shape, not its speed (speed is benchmarks/dispatch_overhead.py's job): the
    call is a partial over the untyped foreign function whose arguments are ctypes objects built at
    prepare time, so calling it does no Python-level conversion."""
    kernel = backend.load_kernel(spec_for(kernels_so, "ws_is_null", inputs=0, outputs=1, symbols=("n",)))
    x = np.zeros(1, np.float32)
    prepared = kernel.prepare([addr(x)], [1], None, None)
    call = prepared.call
    assert isinstance(call, functools.partial) and not call.keywords
    assert isinstance(call.func, ctypes._CFuncPtr) and call.func.argtypes is None
    tensors, symbols, workspace = call.args
    assert isinstance(tensors, ctypes.Array) and isinstance(symbols, ctypes.Array) and workspace is None
    assert ctypes.cast(call.func, ctypes.c_void_p).value == kernel.function_addr
    assert call() == 0  # ws_is_null returns 0 when it gets no workspace (NULL)


def test_workspace_is_passed_or_null(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    ws = backend.allocate(64 * 4)
    kernel = backend.load_kernel(spec_for(kernels_so, "triple_ws", workspace=True))
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    kernel.launch([addr(x), addr(y)], [64], ws.ptr, None)
    np.testing.assert_array_equal(y, 3 * x)
    for null in (None, 0):  # None is the null pointer; address 0 reads as NULL too
        with pytest.raises(KernelError, match="code 11"):
            kernel.launch([addr(x), addr(y)], [64], null, None)
    no_ws = backend.load_kernel(spec_for(kernels_so, "ws_is_null", inputs=0, outputs=0, symbols=()))
    no_ws.launch([], [], ws.ptr, None)  # has_workspace False: NULL whatever the address
    assert no_ws.prepare([], [], ws.ptr, None).workspace_addr == 0


def test_failure_code_raises_kernel_error_with_context(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    spec = spec_for(kernels_so, "fail7", name="matmul", index=3, inputs=0, outputs=0, symbols=())
    kernel = backend.load_kernel(spec)
    with pytest.raises(KernelError, match=r"kernel 'matmul' candidate 3 \(entry 'fail7'\) on cpu .*code 7"):
        kernel.launch([], [], None, None)
    prepared = kernel.prepare([], [], None, None)
    code = prepared.call()
    assert code == 7
    with pytest.raises(KernelError, match="code 7"):
        prepared.fail(code)


def test_argument_counts_are_checked(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernel = backend.load_kernel(spec_for(kernels_so, "vadd", inputs=2))
    with pytest.raises(KernelError, match="2 tensor pointers, expected 3"):
        kernel.launch([1, 2], [4], None, None)
    with pytest.raises(KernelError, match="0 symbol values, expected 1"):
        kernel.prepare([1, 2, 3], [], None, None)


def test_foreign_elf_is_skipped_for_c_source(backend: CpuBackend) -> None:
    foreign = BinaryPayload("elf-so", "aarch64-linux" if host_target() != "aarch64-linux" else "x86_64-linux",
                            "mm.so", b"\x7fELF not for this machine")
    kernel = backend.load_kernel(spec_for((foreign, c_source(KERNELS)), "vadd", name="matmul", inputs=2))
    assert kernel.binary.format == "c-source"
    a = np.ones(8, np.float32)
    c = np.zeros(8, np.float32)
    kernel.launch([addr(a), addr(a), addr(c)], [8], None, None)
    np.testing.assert_array_equal(c, 2)


def test_foreign_elf_alone_is_refused_clearly(backend: CpuBackend) -> None:
    other = "aarch64-linux" if host_target() != "aarch64-linux" else "x86_64-linux"
    binaries = (BinaryPayload("elf-so", other, "mm.so", b"\x7fELF"),
                BinaryPayload("cubin", "sm_90", "mm.cubin", b"..."))
    with pytest.raises(KernelError) as info:
        backend.load_kernel(spec_for(binaries, "mm", name="matmul"))
    message = str(info.value)
    assert message.startswith("kernel 'matmul' candidate 0 (entry 'mm'): no loadable binary for cpu:0: ")
    assert f"mm.so (elf-so, {other}): this machine is {host_target()}" in message
    assert "mm.cubin (cubin, sm_90): format 'cubin' is not one of cpu's formats" in message
    assert message.endswith("rebuild the bundle or ship a c-source binary")
    with pytest.raises(KernelError, match="no binaries"):
        backend.load_kernel(spec_for((), "mm"))


def test_garbage_and_mismatched_elf_give_kernel_errors(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    garbage = BinaryPayload("elf-so", host_target(), "junk.so", b"\x00garbage" * 100)
    with pytest.raises(KernelError, match=r"junk\.so.*not an ELF shared object"):
        backend.load_kernel(spec_for(garbage, "vadd"))
    data = bytearray(kernels_so.data)
    data[18:20] = (183 if platform.machine() != "aarch64" else 62).to_bytes(2, sys.byteorder)
    relabelled = BinaryPayload("elf-so", host_target(), "liar.so", bytes(data))
    with pytest.raises(KernelError, match=r"liar\.so.*ELF is built for"):
        backend.load_kernel(spec_for(relabelled, "vadd"))
    # Truncated: dlopen would map segments past the end of the file and die of SIGBUS.
    truncated = BinaryPayload("elf-so", host_target(), "short.so", bytes(kernels_so.data[:2000]))
    with pytest.raises(KernelError, match=r"short\.so.*truncated or corrupt"):
        backend.load_kernel(spec_for(truncated, "vadd"))
    if kernels_so.data[4] == 2:  # ELF64: drop the section table so the segment check must catch it
        data = bytearray(kernels_so.data[:2000])
        data[60:62] = b"\0\0"
        cut = BinaryPayload("elf-so", host_target(), "cut.so", bytes(data))
        with pytest.raises(KernelError, match=r"cut\.so.*ELF segment \d+ needs bytes"):
            backend.load_kernel(spec_for(cut, "vadd"))
    # A well-formed object that dlopen itself refuses (unresolved symbol under RTLD_NOW).
    (unresolved,) = backend.compile("int missing_function(void);\n"
                                    "int f(void) { return missing_function(); }\n", "c")
    with pytest.raises(KernelError, match=r"cannot load the shared object.*missing_function"):
        backend.load_kernel(spec_for(unresolved, "f"))


def test_missing_entry_symbol(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    with pytest.raises(KernelError, match=r"kernels\.so \(elf-so, .*\) does not export the entry symbol 'nope'"):
        backend.load_kernel(spec_for(kernels_so, "nope"))


def test_loadable_reports_reasons(backend: CpuBackend) -> None:
    assert backend.loadable("elf-so", host_target()) is None
    assert "this machine is" in backend.loadable("elf-so", "riscv64-linux")
    assert backend.loadable("c-source", "any") is None
    assert "not one of cpu's formats" in backend.loadable("ptx", "compute_80")
    assert "one device" in backend.loadable("elf-so", host_target(), device_index=2)


def test_a_second_cpu_device_is_refused(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    with pytest.raises(KernelError, match=r"no loadable binary for cpu:1: .*one device, cpu:0"):
        backend.load_kernel(spec_for(kernels_so, "vadd", inputs=2), 1)


class _BuggyBackend(CpuBackend):
    """A plugin whose loader has a bug (not a KernelError)."""

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> CpuKernel:
        raise ZeroDivisionError("division by zero in the loader")


def test_a_plugin_bug_in_load_binary_becomes_a_kernel_error(tmp_path: Path) -> None:
    backend = _BuggyBackend(cache_dir=tmp_path)
    spec = spec_for(c_source(KERNELS, "vadd.c"), "vadd", name="matmul", inputs=2)
    with pytest.raises(KernelError) as info:
        backend.load_kernel(spec)
    message = str(info.value)
    assert "kernel 'matmul' candidate 0 (entry 'vadd')" in message
    assert "vadd.c (c-source, any)" in message
    assert "ZeroDivisionError: division by zero in the loader" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_reference_kernels_compute_what_engine_testing_documents(backend: CpuBackend) -> None:
    refs = backend.reference_kernels()
    assert set(refs) == {"add", "scale_ws", "busy", "fail_code", "mlp_matmul", "mlp_bias_relu", "mlp_bias_add",
                         "mlp_softmax"}
    assert all(ref.language == "c" and ref.launch is None for ref in refs.values())
    assert refs["mlp_softmax"].options == {"flags": ["-lm"]}
    assert len(refs["mlp_matmul"].entries) == 2
    check_reference_kernels(backend)


def test_one_library_per_shared_object(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernels = [backend.load_kernel(spec_for(kernels_so, entry, name=f"k{i}"))
               for i, entry in enumerate(["mul2", "add1", "square"] * 100)]
    assert backend.loader.loaded_libraries() == 1
    assert len({id(k.library) for k in kernels}) == 1


# -- concurrency and OpenMP --------------------------------------------------------------------
def test_threads_launch_the_same_kernel_concurrently(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernel = backend.load_kernel(spec_for(kernels_so, "vadd", inputs=2))
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        try:
            n = 10_000 + seed
            a = np.full(n, seed, np.float32)
            b = np.arange(n, dtype=np.float32)
            c = np.zeros(n, np.float32)
            prepared = kernel.prepare([addr(a), addr(b), addr(c)], [n], None, None)
            barrier.wait()
            for i in range(200):
                a[:] = seed + i
                if i % 2:
                    assert prepared.call() == 0
                else:
                    kernel.launch([addr(a), addr(b), addr(c)], [n], None, None)
                np.testing.assert_array_equal(c, b + (seed + i))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_kernel_calls_release_the_gil(backend: CpuBackend) -> None:
    """A kernel that waits for another kernel (on another thread) to set a flag: this only finishes
    when calls release the GIL. No timing: the waiter gives up after a generous bound and says so."""
    kernel = backend.load_kernel(spec_for(c_source(HANDSHAKE), "wait_for_flag", inputs=1, outputs=0, symbols=()))
    setter = backend.load_kernel(spec_for(c_source(HANDSHAKE), "set_flag", inputs=1, outputs=0, symbols=()))
    flag = np.zeros(1, np.int32)
    waiter = kernel.prepare([addr(flag)], [], None, None)
    codes = []
    thread = threading.Thread(target=lambda: codes.append(waiter.call()))
    thread.start()
    assert setter.prepare([addr(flag)], [], None, None).call() == 0  # runs while the waiter spins
    thread.join()
    assert codes == [0], "the waiting kernel gave up: the setter could not run while it held the GIL"


def test_openmp_kernel_with_two_threads(tmp_path: Path) -> None:
    backend = CpuBackend(cache_dir=tmp_path, num_threads=2)
    kernel = backend.load_kernel(spec_for(c_source(OPENMP), "omp_vadd", inputs=2))
    n = 100_003
    a = np.random.default_rng(0).random(n)
    b = np.random.default_rng(1).random(n)
    c = np.zeros(n)
    kernel.launch([addr(a), addr(b), addr(c)], [n], None, None)
    np.testing.assert_array_equal(c, a + b)
    c[:] = 0
    assert kernel.prepare([addr(a), addr(b), addr(c)], [n], None, None).call() == 0
    np.testing.assert_array_equal(c, a + b)
    (payload,) = backend.compile(OPENMP, "c", {"openmp": True})
    assert b"omp_get_max_threads" in bytes(payload.data)


def test_openmp_thread_count_applies_in_loading_and_launching_threads(tmp_path: Path) -> None:
    # libgomp's thread count is per calling thread; fresh threads keep the main thread untouched.
    backend = CpuBackend(cache_dir=tmp_path, num_threads=1)
    spec = spec_for(c_source(OPENMP), "omp_threads", inputs=0, symbols=())
    seen: dict[str, int] = {}

    def load_and_run() -> None:
        kernel = backend.load_kernel(spec)
        out = np.zeros(1, np.int32)
        kernel.launch([addr(out)], [], None, None)
        seen["loader"] = int(out[0])
        seen["kernel"] = kernel  # type: ignore[assignment]

    def run_elsewhere() -> None:
        out = np.zeros(1, np.int32)
        prepared = seen["kernel"].prepare([addr(out)], [], None, None)  # type: ignore[attr-defined]
        prepared.call()
        seen["other"] = int(out[0])

    for target in (load_and_run, run_elsewhere):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert seen["loader"] == 1 and seen["other"] == 1


# -- fusion ------------------------------------------------------------------------------------
def _chain(backend: CpuBackend, payload: BinaryPayload, entries, n: int):
    bufs = [np.arange(n, dtype=np.float32) + 1] + [np.zeros(n, np.float32) for _ in entries]
    launches = []
    for i, entry in enumerate(entries):
        kernel = backend.load_kernel(spec_for(payload, entry, name=f"step{i}"))
        launches.append(kernel.prepare([addr(bufs[i]), addr(bufs[i + 1])], [n], None, None))
    return bufs, launches


def test_fused_chain_matches_individual_calls(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    n = 257
    bufs, launches = _chain(backend, kernels_so, ["mul2", "add1", "square"], n)
    for p in launches:
        assert p.call() == 0
    expected = bufs[-1].copy()
    np.testing.assert_array_equal(expected, (bufs[0] * 2 + 1) ** 2)
    for b in bufs[1:]:
        b[:] = 0
    fused = backend.fuse(launches)
    assert isinstance(fused, CpuFusedLaunch) and len(fused) == 3
    assert fused.call() == 0 and fused.code() == 0
    np.testing.assert_array_equal(bufs[-1], expected)

    # Patching the first launch's input after fusing is seen by the fused call.
    new_input = np.full(n, 3, np.float32)
    launches[0].set_tensor(0, addr(new_input))
    assert fused.call() == 0
    np.testing.assert_array_equal(bufs[-1], 49)


def test_fused_chain_stops_at_the_first_failure(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    n = 16
    bufs, launches = _chain(backend, kernels_so, ["mul2", "fail5", "square"], n)
    bufs[-1][:] = -1
    fused = backend.fuse(launches)
    position = fused.call()
    assert position == 2 and fused.code() == 5
    np.testing.assert_array_equal(bufs[1], bufs[0] * 2)  # the first one ran
    assert (bufs[-1] == -1).all()  # the third did not
    with pytest.raises(KernelError, match=r"kernel 'step1' candidate 0 \(entry 'fail5'\) on cpu .*code 5"):
        launches[position - 1].fail(fused.code())


def test_fuse_refuses_foreign_launches(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    class Foreign:
        call = staticmethod(lambda: 0)

        def set_tensor(self, index: int, addr: int) -> None: ...

        def fail(self, code: int) -> None: ...

    _, launches = _chain(backend, kernels_so, ["mul2"], 4)
    assert backend.fuse([launches[0], Foreign()]) is None
    assert backend.fuse(launches) is not None


def test_time_returns_millisecond_samples(backend: CpuBackend, kernels_so: BinaryPayload) -> None:
    kernel = backend.load_kernel(spec_for(kernels_so, "mul2"))
    x = np.ones(1024, np.float32)
    prepared = kernel.prepare([addr(x), addr(x)], [1024], None, None)
    samples = backend.time(prepared.call, warmup=2, repeat=5)
    assert len(samples) == 5 and all(s >= 0 for s in samples)
