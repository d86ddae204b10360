"""CPU kernels that link a library shipped in a wheel (``engine_cpu.libraries``).

A kernel names the library by provider (compile option ``link`` and the source line
``// engine-cpu: link NAME``); it is linked with no rpath (``DT_NEEDED`` is the bare soname) and the
loader opens the provider's file before the kernel, in this process or another, from memory or
from the file store, from the ``elf-so`` or from the ``c-source`` compiled at load.

Two libraries: OpenBLAS from the ``scipy-openblas32`` wheel (the BLAS candidate of issue 13; those
tests are skipped, with the reason, where the wheel is not installed), and a small library built
here with its own soname in a directory no loader searches, served by a provider registered in
the test (so the mechanism is also checked without the wheel). A machine without the wheel is
made for real in a child process: ``sys.modules["scipy_openblas32"] = None`` makes its import fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import attrs
import numpy as np
import pytest

from engine.backend import CandidateSpec
from engine.build import GraphBuilder
from engine_cpu import CpuBackend, LibraryRegistry, LibraryUnavailableError, LinkedLibrary, UnknownLibraryError
from engine_cpu.compiler import LinkDirectiveError
from engine_cpu.elf import read_dynamic

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects are Linux's")

try:
    import scipy_openblas32  # noqa: F401
    HAVE_OPENBLAS = True
except ImportError:
    HAVE_OPENBLAS = False
needs_openblas = pytest.mark.skipif(not HAVE_OPENBLAS, reason="the scipy-openblas32 wheel is not installed "
                                    "(pip install scipy-openblas32)")

M, K, N = 6, 5, 7

SGEMM = r"""
// engine-cpu: link scipy_openblas32
#include <stdint.h>
#include <cblas.h>
int32_t ENTRY(void *const *t, const int64_t *sym, void *ws) {
    (void)sym; (void)ws;
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 6, 7, 5, 1.0f, (const float *)t[0], 5,
                      (const float *)t[1], 7, 0.0f, (float *)t[2], 7);
    return 0;
}
"""

PLAIN = r"""
#include <stdint.h>
int32_t mm_plain(void *const *t, const int64_t *sym, void *ws) {
    (void)sym; (void)ws;
    const float *a = t[0], *b = t[1]; float *c = t[2];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 7; j++) {
            float s = 0.0f;
            for (int k = 0; k < 5; k++) s += a[i * 5 + k] * b[k * 7 + j];
            c[i * 7 + j] = s;
        }
    return 0;
}
"""


def sgemm_source(entry: str = "mm_blas") -> str:
    return SGEMM.replace("ENTRY", entry)


def operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)


def matmul_builder(registry, source: str | None, entry: str = "mm_blas", binaries=()) -> GraphBuilder:
    b = GraphBuilder("blas_mm", registry=registry)
    a = b.input("a", "float32", (M, K))
    w = b.input("b", "float32", (K, N))
    if source is not None:
        options = {"link": ["scipy_openblas32"]} if "engine-cpu: link" in source else {}
        k = b.kernel("mm", entries=[entry], source=source, options=options)
    else:
        k = b.kernel("mm", entries=[entry], binaries=list(binaries))
    (c,) = b.call(k, [a, w], [("float32", (M, N))])
    b.output(c, "c")
    return b


def elf_member(bundle: Path) -> bytes:
    with zipfile.ZipFile(bundle) as z:
        names = [n for n in z.namelist() if n.endswith(".so")]
        assert len(names) == 1, names
        return z.read(names[0])


def readelf_dynamic(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


# A child process: loads a bundle, runs it, prints what it saw as JSON on the last line.
CHILD = textwrap.dedent(r"""
    import json, logging, os, sys
    bundle, cache, how = sys.argv[1], sys.argv[2], sys.argv[3]
    if "no-wheel" in how:
        sys.modules["scipy_openblas32"] = None   # the import system then raises ImportError
    import numpy as np
    import engine
    from engine.plugins import Registry
    from engine.settings import Settings
    from engine_cpu import CpuBackend
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])

    logging.getLogger("engine").addHandler(Keep(logging.WARNING))
    registry = Registry(Settings(cache_dir=cache, autoload_plugins=False))
    registry.register_backend(CpuBackend(cache_dir=cache, from_memory="file-store" not in how), distribution="test")
    rng = np.random.default_rng(7)
    a = rng.standard_normal((6, 5), dtype=np.float32)
    b = rng.standard_normal((5, 7), dtype=np.float32)
    try:
        graph = engine.load_compiled_graph(bundle, registry=registry,
                                           dispatch_policy="tune" if "tune" in how else "first")
    except engine.errors.EngineError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                          "library": getattr(exc, "library", None), "install_hint": getattr(exc, "install_hint", None),
                          "records": records}))
        sys.exit(0)
    out = graph(a, b).numpy()
    with open("/proc/self/maps") as f:
        maps = sorted({" ".join(line.split()[5:]) for line in f if len(line.split()) >= 6})
    print(json.dumps({"max_error": float(np.abs(out - a @ b).max()),
                      "unavailable": [dict(t.unavailable) for t in graph.compiled_tasks],
                      "device_tag": graph.device_tag,
                      "maps": maps, "records": records}))
""")


def run_child(bundle: Path, cache: Path, how: str) -> dict:
    env = dict(os.environ, ENGINE_PLUGINS_AUTOLOAD="0")
    env.pop("ENGINE_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(bundle), str(cache), how], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- OpenBLAS from the scipy-openblas32 wheel -------------------------------------------------------------------
@needs_openblas
def test_sgemm_kernel_matches_numpy_and_carries_no_rpath(registry, tmp_path):
    builder = matmul_builder(registry, sgemm_source())
    a, b = operands()
    np.testing.assert_allclose(builder.build()(a, b).numpy(), a @ b, rtol=1e-5, atol=1e-5)
    bundle = tmp_path / "blas.cgb"
    builder.save(bundle)
    so = tmp_path / "kernel.so"
    so.write_bytes(elf_member(bundle))
    info = read_dynamic(so.read_bytes())
    assert "libscipy_openblas.so" in info.needed
    assert info.rpath is None and info.runpath is None
    # The system's own reader agrees: the soname is needed, and no search path points anywhere.
    if shutil.which("readelf"):
        dynamic = readelf_dynamic(so)
        assert "Shared library: [libscipy_openblas.so]" in dynamic
        assert "RPATH" not in dynamic and "RUNPATH" not in dynamic
        assert "site-packages" not in dynamic


@needs_openblas
@pytest.mark.parametrize("how", ["memory", "file-store"])
def test_elf_so_bundle_loads_in_another_process(registry, tmp_path, how):
    bundle = tmp_path / "blas.cgb"
    matmul_builder(registry, sgemm_source()).save(bundle)
    cache = tmp_path / "child-cache"
    seen = run_child(bundle, cache, how)
    assert seen["max_error"] < 1e-4
    assert seen["records"] == []
    wheel_lib = Path(scipy_openblas32.get_lib_dir()) / "libscipy_openblas.so"
    assert str(wheel_lib.resolve()) in {str(Path(m).resolve()) for m in seen["maps"] if m.startswith("/")}
    stored = list((cache / "cpu" / "so").glob("*.so"))
    if how == "memory":
        assert any(m.startswith("/memfd:engine-") for m in seen["maps"])
        assert stored == []  # loaded from memory: nothing written
    else:
        assert len(stored) == 1 and str(stored[0]) in seen["maps"]


@needs_openblas
def test_c_source_bundle_compiles_with_the_library_at_load(registry, tmp_path):
    bundle = tmp_path / "blas-source.cgb"
    source = {"format": "c-source", "target": "any", "path": "mm.c", "data": sgemm_source().encode()}
    matmul_builder(registry, None, binaries=[source]).save(bundle)
    cache = tmp_path / "child-cache"
    seen = run_child(bundle, cache, "memory")
    assert seen["max_error"] < 1e-4
    built = list((cache / "cpu" / "build").glob("*.so"))
    assert len(built) == 1
    assert "libscipy_openblas.so" in read_dynamic(built[0].read_bytes()).needed


def mixed_bundle(registry, tmp_path: Path) -> Path:
    """A kernel with two candidates: 0 calls OpenBLAS from a source of its own (``entry_code``: its
    own binaries, so only it needs the wheel), 1 is plain C from the kernel's source."""
    b = GraphBuilder("blas_mm", registry=registry)
    a = b.input("a", "float32", (M, K))
    w = b.input("b", "float32", (K, N))
    k = b.kernel("mm", entries=["mm_blas", "mm_plain"], source=PLAIN,
                 entry_code={"mm_blas": (sgemm_source(), {"link": ["scipy_openblas32"]})})
    (c,) = b.call(k, [a, w], [("float32", (M, N))])
    b.output(c, "c")
    path = tmp_path / "mixed.cgb"
    b.save(path)
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("kernels/0/meta.json"))
    blas, plain = ([x["path"] for x in cand["binaries"]] for cand in meta["candidates"])
    assert sorted(blas) == ["mm.mm_blas.c", "mm.mm_blas.so"] and sorted(plain) == ["mm.c", "mm.so"]
    return path


@needs_openblas
def test_without_the_wheel_the_other_candidate_runs(registry, tmp_path):
    bundle = mixed_bundle(registry, tmp_path)
    with_wheel = run_child(bundle, tmp_path / "cache-a", "memory")
    assert with_wheel["max_error"] < 1e-4 and with_wheel["unavailable"] == [{}]
    seen = run_child(bundle, tmp_path / "cache-b", "memory no-wheel")
    assert seen["max_error"] < 1e-4  # policy "first" picked candidate 0, whose place candidate 1 took
    (reasons,) = seen["unavailable"]
    assert list(reasons) == ["0"]
    assert "pip install scipy-openblas32" in reasons["0"] and "candidate 0" in reasons["0"]
    warnings = [r for r in seen["records"] if r[1] == "WARNING"]
    assert len(warnings) == 1 and "scipy_openblas32" in warnings[0][2]
    assert not any(m.endswith("/libscipy_openblas.so") for m in seen["maps"])  # numpy's own copy has another name
    # Rows tuned while candidate 0 ran as a stand-in are cached apart from rows tuned with the wheel.
    assert seen["device_tag"] != with_wheel["device_tag"]
    tuned = run_child(bundle, tmp_path / "cache-b", "memory no-wheel tune")
    assert tuned["max_error"] < 1e-4 and tuned["device_tag"] == seen["device_tag"]


@needs_openblas
@pytest.mark.parametrize("form", ["elf-so", "c-source"])
def test_without_the_wheel_a_kernel_with_only_blas_fails_in_one_line(registry, tmp_path, form):
    bundle = tmp_path / "blas.cgb"
    if form == "elf-so":
        matmul_builder(registry, sgemm_source()).save(bundle)
    else:
        source = {"format": "c-source", "target": "any", "path": "mm.c", "data": sgemm_source().encode()}
        matmul_builder(registry, None, binaries=[source]).save(bundle)
    seen = run_child(bundle, tmp_path / "cache", "memory no-wheel")
    assert seen["error"] == "LibraryUnavailableError"
    message = seen["message"]
    assert "\n" not in message
    assert "kernel 'mm' candidate 0 (entry 'mm_blas')" in message
    assert "'scipy_openblas32'" in message and message.endswith("pip install scipy-openblas32")
    assert seen["library"] == "scipy_openblas32" and seen["install_hint"] == "pip install scipy-openblas32"


def test_an_unknown_library_name_lists_the_known_ones(tmp_path):
    backend = CpuBackend(cache_dir=tmp_path)
    with pytest.raises(UnknownLibraryError) as info:
        backend.compile(sgemm_source().replace("link scipy_openblas32", "link scipy_openblas23"), "c",
                        {"link": ["scipy_openblas23"]})
    message = str(info.value)
    assert "\n" not in message and "'scipy_openblas23'" in message and "scipy_openblas32" in message
    assert info.value.name == "scipy_openblas23" and "scipy_openblas32" in info.value.known
    # The same name in a source's directive alone (a bundle's c-source) is refused the same way.
    with pytest.raises(UnknownLibraryError):
        backend.compile(sgemm_source().replace("link scipy_openblas32", "link scipy_openblas23"), "c")


@needs_openblas
def test_link_option_needs_the_directive_the_c_source_fallback_reads(tmp_path):
    backend = CpuBackend(cache_dir=tmp_path)
    without = sgemm_source().replace("// engine-cpu: link scipy_openblas32\n", "")
    with pytest.raises(LinkDirectiveError) as info:
        backend.compile(without, "c", {"link": ["scipy_openblas32"]})
    assert info.value.library == "scipy_openblas32" and "// engine-cpu: link scipy_openblas32" in str(info.value)


# -- a library built here, served by a provider registered in the test ----------------------------------------
DEMO_LIB = r"""
int engine_demo_offset(void) { return DEMO_OFFSET; }
"""
DEMO_HEADER = "int engine_demo_offset(void);\n"
DEMO_KERNEL = r"""
// engine-cpu: link engine_demo
#include <stdint.h>
#include <engine_demo.h>
int32_t add_offset(void *const *t, const int64_t *sym, void *ws) {
    (void)ws;
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + (float)engine_demo_offset();
    return 0;
}
"""


@attrs.frozen
class DemoProvider:
    """Serves ``libengine_demo.so`` from a directory of the test (on no loader search path)."""

    directory: Path
    version: str
    name: str = "engine_demo"
    sonames: tuple[str, ...] = ("libengine_demo.so",)
    install_hint: str = "build libengine_demo.so first"

    def locate(self) -> LinkedLibrary:
        path = self.directory / "lib" / "libengine_demo.so.1"
        if not path.exists():
            raise LookupError(f"{path} does not exist")
        return LinkedLibrary(self.name, "libengine_demo.so", path, self.directory / "include", self.version)


def build_demo_library(directory: Path, offset: int) -> Path:
    (directory / "lib").mkdir(parents=True, exist_ok=True)
    (directory / "include").mkdir(exist_ok=True)
    (directory / "include" / "engine_demo.h").write_text(DEMO_HEADER)
    source = directory / "demo.c"
    source.write_text(DEMO_LIB)
    subprocess.run(["cc", "-shared", "-fPIC", f"-DDEMO_OFFSET={offset}", "-Wl,-soname,libengine_demo.so",
                    "-o", str(directory / "lib" / "libengine_demo.so.1"), str(source)], check=True)
    return directory


def demo_backend(cache: Path, provider: DemoProvider, **kwargs) -> CpuBackend:
    libraries = LibraryRegistry(entry_points=False)
    libraries.register(provider)
    return CpuBackend(cache_dir=cache, libraries=libraries, **kwargs)


def run_add_offset(backend: CpuBackend, binaries) -> np.ndarray:
    spec = CandidateSpec("add", 0, "add_offset", tuple(binaries), None, 1, 1, ("n",), False)
    kernel = backend.load_kernel(spec, 0)
    x = np.arange(4, dtype=np.float32)
    y = np.zeros_like(x)
    kernel.launch([x.ctypes.data, y.ctypes.data], [4], None, None)
    return y


@pytest.mark.parametrize("from_memory", [True, False])
def test_a_registered_provider_library_is_found_at_load(tmp_path, from_memory):
    provider = DemoProvider(build_demo_library(tmp_path / "demo", 10), "1.0")
    backend = demo_backend(tmp_path / "cache", provider, from_memory=from_memory)
    (so,) = backend.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    info = read_dynamic(so.data)
    assert info.needed == ("libengine_demo.so",) or "libengine_demo.so" in info.needed
    assert info.rpath is None and info.runpath is None
    np.testing.assert_array_equal(run_add_offset(backend, [so]), np.arange(4) + 10)


def test_the_cache_key_follows_the_library_version_not_its_path(tmp_path):
    demo = build_demo_library(tmp_path / "demo", 3)
    cache = tmp_path / "cache"
    v1 = demo_backend(cache, DemoProvider(demo, "1.0"))
    v1.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    assert v1.compiler.invocations == 1
    again = demo_backend(cache, DemoProvider(demo, "1.0"))
    again.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    assert again.compiler.invocations == 0  # same soname and version: a cache hit
    moved = build_demo_library(tmp_path / "elsewhere", 3)
    same_version_elsewhere = demo_backend(cache, DemoProvider(moved, "1.0"))
    same_version_elsewhere.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    assert same_version_elsewhere.compiler.invocations == 0  # the path is not part of the key
    v2 = demo_backend(cache, DemoProvider(demo, "2.0"))
    v2.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    assert v2.compiler.invocations == 1


def test_a_missing_provider_library_fails_naming_the_candidate_and_the_hint(tmp_path):
    demo = build_demo_library(tmp_path / "demo", 1)
    backend = demo_backend(tmp_path / "cache", DemoProvider(demo, "1.0"))
    (so,) = backend.compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    (demo / "lib" / "libengine_demo.so.1").unlink()
    fresh = demo_backend(tmp_path / "cache", DemoProvider(demo, "1.0"))
    with pytest.raises(LibraryUnavailableError) as info:
        run_add_offset(fresh, [so])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("kernel 'add' candidate 0 (entry 'add_offset')")
    assert message.endswith("build libengine_demo.so first")
    assert info.value.library == "engine_demo" and info.value.soname == "libengine_demo.so"


ENTRY_POINT_CHILD = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    from engine.backend import CandidateSpec
    from engine_cpu import CpuBackend
    from engine.backend import BinaryPayload
    from engine_cpu import host_target
    backend = CpuBackend(cache_dir=sys.argv[1])  # the default registry: built-ins plus entry points
    if sys.argv[2].endswith(".so"):  # a kernel built elsewhere: its provider is found when it fails to open
        with open(sys.argv[2], "rb") as f:
            so = BinaryPayload("elf-so", host_target(), "add.so", f.read())
    else:
        (so,) = backend.compile(sys.argv[2], "c", {"link": ["engine_demo"]})
    spec = CandidateSpec("add", 0, "add_offset", (so,), None, 1, 1, ("n",), False)
    x = np.arange(4, dtype=np.float32); y = np.zeros_like(x)
    backend.load_kernel(spec, 0).launch([x.ctypes.data, y.ctypes.data], [4], None, None)
    print(json.dumps({"names": list(backend.compiler.libraries.names()), "y": y.tolist()}))
""")

PROVIDER_MODULE = textwrap.dedent('''
    from pathlib import Path
    from engine_cpu import LinkedLibrary

    class _Provider:
        name = "engine_demo"
        sonames = ("libengine_demo.so",)
        install_hint = "pip install engine-demo"

        def locate(self):
            root = Path(__file__).resolve().parent / "demo"
            return LinkedLibrary(self.name, "libengine_demo.so", root / "lib" / "libengine_demo.so.1",
                                 root / "include", "0.1")

    PROVIDER = _Provider()
''')


def test_a_distribution_adds_a_provider_through_the_entry_point_group(tmp_path):
    """A distribution installed on ``sys.path`` (a real ``.dist-info`` read by importlib.metadata)
    declares its provider in ``engine_cpu.libraries``; a default ``CpuBackend`` finds it."""
    site = tmp_path / "site"
    build_demo_library(site / "demo", 5)
    (site / "engine_demo_provider.py").write_text(PROVIDER_MODULE)
    info = site / "engine_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[engine_cpu.libraries]\nengine_demo = engine_demo_provider:PROVIDER\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    (built,) = demo_backend(tmp_path / "parent-cache", DemoProvider(build_demo_library(tmp_path / "v", 1), "0.1")
                            ).compile(DEMO_KERNEL, "c", {"link": ["engine_demo"]})
    (tmp_path / "add.so").write_bytes(built.data)
    for kernel in (DEMO_KERNEL, str(tmp_path / "add.so")):
        proc = subprocess.run([sys.executable, "-c", ENTRY_POINT_CHILD, str(tmp_path / "cache"), kernel],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert "engine_demo" in seen["names"] and "scipy_openblas32" in seen["names"]
        assert seen["y"] == [5.0, 6.0, 7.0, 8.0]  # the entry point's library (offset 5) was the one opened


# -- engine_onnx's gemm_blas routine -----------------------------------------------------------------------------
GEMM_ENTRY = r"""
int32_t mm(void *const *t, const int64_t *sym, void *ws) {
    (void)ws;
    gemm_blas(sym[0], sym[1], sym[2], (const float *)t[0], sym[2], (const float *)t[1], sym[1], (float *)t[2], sym[1]);
    return 0;
}
"""


@needs_openblas
@pytest.mark.parametrize("variant", ["bands", "openblas-threads"])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_blas_matches_numpy(tmp_path, variant, threads):
    """``gemm_blas`` through a graph: the kernel spec carries the ``link`` option its preamble's line
    asks for; odd sizes put a partial band on the last thread."""
    from engine.plugins import Registry
    from engine.settings import Settings
    from engine_onnx.codegen import HEADER, KernelSpec
    from engine_onnx.ops.gemm_blas import GEMM_BLAS_PREAMBLE, GEMM_BLAS_OPTIONS, blas_available

    assert blas_available() is None
    define = "#define GEMM_BLAS_OPENBLAS_THREADS 1\n" if variant == "openblas-threads" else ""
    spec = KernelSpec("mm", define + HEADER + GEMM_BLAS_PREAMBLE + GEMM_ENTRY, ("mm",), ("m", "n", "k"))
    assert spec.options["link"] == GEMM_BLAS_OPTIONS["link"] and spec.options["openmp"] is True
    registry = Registry(Settings(cache_dir=tmp_path, autoload_plugins=False))
    registry.register_backend(CpuBackend(cache_dir=tmp_path, num_threads=threads), distribution="test")
    b = GraphBuilder("gemm_blas", registry=registry)
    a = b.input("a", "float32", ["m", "k"])
    w = b.input("b", "float32", ["k", "n"])
    k = b.kernel("mm", entries=list(spec.entries), source=spec.source, options=spec.options)
    (c,) = b.call(k, [a, w], [("float32", ["m", "n"])], symbols=list(spec.symbols))
    b.output(c, "c")
    graph = b.build()
    rng = np.random.default_rng(3)
    for m, kk, n in [(37, 70, 53), (64, 576, 49), (3, 5, 2)]:
        x = rng.standard_normal((m, kk), dtype=np.float32)
        y = rng.standard_normal((kk, n), dtype=np.float32)
        np.testing.assert_allclose(graph(x, y).numpy(), x @ y, rtol=1e-4, atol=1e-4 * np.sqrt(kk))


def test_blas_available_says_why_not_without_the_wheel():
    child = ("import sys; sys.modules['scipy_openblas32'] = None\n"
             "from engine_onnx.ops.gemm_blas import blas_available\nprint(blas_available())")
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("pip install scipy-openblas32")
    assert "'scipy_openblas32'" in proc.stdout
