"""Read-only deployments (issue 14): bundles run when the cache directory or HOME cannot be written.

Each case runs a fresh process (nothing memoized) on the demo MLP bundle (shared objects inside it)
and on a bundle whose kernels are C source only (compiled at load), with the cache directory

* on a tmpfs remounted read-only (``mount -o remount,ro``; needs root or CAP_SYS_ADMIN, skipped
  with the reason elsewhere; root ignores permission bits, so ``chmod`` cannot make a read-only
  directory for it), and
* below a regular file (a file where a directory is expected), which refuses writes for every user;
* the same two for ``HOME`` (no ``ENGINE_CACHE_DIR``, no ``XDG_CACHE_HOME``: the default cache
  ``~/.cache/engine`` cannot be created).

The process must compute the right outputs, print nothing (logging is silent by default), write
nothing, and say in one ``engine.cache`` log record that the cache is read-only when a handler is
attached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine.build import GraphBuilder
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read-only mounts and memfd are Linux's")

SCALE = r"""
#include <stdint.h>
int32_t affine_a(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = 2.0f * x[i] + 1.0f;
    return 0;
}
int32_t affine_b(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = sym[0] - 1; i >= 0; i--) y[i] = x[i] * 2.0f + 1.0f;
    return 0;
}
"""

CHILD = textwrap.dedent(r"""
    import json, logging, sys
    import numpy as np
    bundle, kind, batch, level = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])

    if level != "-":
        logging.getLogger("engine").addHandler(Keep())
        logging.getLogger("engine").setLevel(level)
    import engine
    graph = engine.load_compiled_graph(bundle)
    shape = (batch, 64) if kind == "mlp" else (batch,)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for _ in range(2):  # the first run tunes (its row cannot be stored), the second is prepared
        (y,) = graph.run_async([x])
    print(json.dumps({"x": x.tolist(), "y": y.numpy().tolist(), "records": records}))
""")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, registry) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ro-bundles")
    mlp = folder / "mlp.cgb"
    build_mlp(registry=registry).save(mlp)
    b = GraphBuilder("affine_source_only", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("affine", entries=["affine_a", "affine_b"],
                 binaries=[{"format": "c-source", "target": "any", "path": "affine.c", "data": SCALE.encode()}])
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    source = folder / "source.cgb"
    b.save(source)
    return {"mlp": mlp, "source": source}


def _expected(kind: str, x: np.ndarray) -> np.ndarray:
    return reference_mlp(x, mlp_weights()) if kind == "mlp" else 2 * x + 1


@pytest.fixture
def read_only_dir(tmp_path):
    """Make read-only directories: ``make(how)`` -> a path that cannot be written, by ``how``."""
    mounted: list[Path] = []

    def make(how: str) -> Path:
        if how == "file in the way":
            blocker = tmp_path / "blocker"
            blocker.write_text("a regular file where a directory is expected\n")
            return blocker / "home"
        where = tmp_path / "ro"
        where.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command: cannot make a read-only file system")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1024k,mode=0755", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        (where / "seen-before").write_text("written before the remount\n")
        proc = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs read-only: {proc.stderr.strip()}")
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _tree(path: Path) -> dict[str, bytes | None]:
    if not path.is_dir():
        return {}
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _run_child(bundle: Path, kind: str, env: dict[str, str], *, log: str = "-") -> subprocess.CompletedProcess:
    """Run ``bundle`` in a fresh process; ``log``: the ``engine`` logger's level to record, or "-"."""
    return subprocess.run([sys.executable, "-c", CHILD, str(bundle), kind, "5", log],
                          env=env, capture_output=True, text=True, timeout=600)


def _env(where: str, path: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_CACHE_DIR", "XDG_CACHE_HOME", "HOME")}
    env["TMPDIR"] = str(tmp_path / "tmp")  # compilers need a scratch directory: a writable /tmp
    (tmp_path / "tmp").mkdir(exist_ok=True)
    if where == "cache dir":
        env["ENGINE_CACHE_DIR"] = str(path / "engine-cache")
        env["HOME"] = str(tmp_path / "writable-home")
    else:
        env["HOME"] = str(path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.mark.parametrize("how", ["read-only mount", "file in the way"])
@pytest.mark.parametrize("where", ["cache dir", "HOME"])
@pytest.mark.parametrize("kind", ["mlp", "source"])
def test_bundle_runs_with_an_unwritable_cache_and_writes_nothing(bundles, read_only_dir, tmp_path, how, where, kind):
    path = read_only_dir(how)
    env = _env(where, path, tmp_path)
    before = _tree(path) if path.is_dir() else None
    scratch_before = sorted(os.listdir(tmp_path / "tmp"))

    quiet = _run_child(bundles[kind], kind, env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""  # silent by default: no warnings, no log output
    doc = json.loads(quiet.stdout)
    x = np.array(doc["x"], np.float32)
    np.testing.assert_allclose(np.array(doc["y"], np.float32), _expected(kind, x), rtol=1e-5, atol=1e-6)
    assert doc["records"] == []

    logged = _run_child(bundles[kind], kind, env, log="INFO")
    assert logged.returncode == 0, logged.stderr
    records = json.loads(logged.stdout)["records"]
    read_only = [r for r in records if r[0] == "engine.cache" and "is read-only" in r[2]]
    assert len(read_only) == 1, records  # one line, however many writes were refused
    assert read_only[0][1] == "WARNING"
    assert any(r[0] == "engine.runtime.tuning" and "chose candidates" in r[2] for r in records), records

    if before is not None:
        assert _tree(path) == before
    else:
        assert not path.exists()
    assert sorted(os.listdir(tmp_path / "tmp")) == scratch_before  # compiler scratch removed


def test_a_warm_read_only_cache_serves_compiled_sources_without_compiling(bundles, tmp_path):
    """A cache filled at image-build time and then mounted read-only: sources are not compiled again."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    where = tmp_path / "warm"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4096k,mode=0700", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        env = _env("cache dir", where, tmp_path)
        warm = _run_child(bundles["source"], "source", env)
        assert warm.returncode == 0, warm.stderr
        filled = _tree(where)
        assert any(name.startswith("engine-cache/cpu/build/") and name.endswith(".so") for name in filled)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
        served = _run_child(bundles["source"], "source", env, log="DEBUG")
        assert served.returncode == 0, served.stderr
        records = json.loads(served.stdout)["records"]
        cache = [r[2] for r in records if r[0] == "engine.cache"]
        assert any(": hit " in m for m in cache) and not any(": miss " in m or ": stored " in m for m in cache), cache
        assert [r for r in records if "is read-only" in r[2]] == []  # nothing needed writing: nothing to say
        assert _tree(where) == filled
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


OPENCL_CHILD = textwrap.dedent(r"""
    import sys
    import numpy as np
    import engine
    from engine.demo.mlp import mlp_weights, reference_mlp
    graph = engine.load_compiled_graph(sys.argv[1])
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    (y,) = graph.run_async([engine.asarray(x, device="opencl:0")])
    np.testing.assert_allclose(y.numpy(), reference_mlp(x, mlp_weights()), rtol=1e-4, atol=1e-6)
    print("OK")
""")


@pytest.mark.parametrize("unwritable", ["engine cache", "engine cache and user cache"])
def test_opencl_bundle_runs_with_an_unwritable_cache_dir(tmp_path, registry, unwritable):
    """The OpenCL plugin's program cache tolerates a cache directory that cannot be written, and so
    does the stack below it: PoCL (which reports no device when it cannot create its kernel cache)
    and pyopencl (which raises when it cannot create its own), both under ``$XDG_CACHE_HOME`` —
    a read-only HOME."""
    rows = {r.kind: r for r in registry.devices()}
    if "opencl" not in rows or not rows["opencl"].available:
        pytest.skip(f"no usable OpenCL device: {rows['opencl'].reason if 'opencl' in rows else 'plugin absent'}")
    bundle = tmp_path / "mlp-opencl.cgb"
    build_mlp(registry=registry, device="opencl").save(bundle)
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where a directory is expected\n")
    env = dict(os.environ, ENGINE_CACHE_DIR=str(blocker / "cache"))
    if unwritable == "engine cache and user cache":
        env["XDG_CACHE_HOME"] = str(blocker / "xdg")
        env.pop("POCL_CACHE_DIR", None)
        env.pop("PYOPENCL_NO_CACHE", None)
    done = subprocess.run([sys.executable, "-c", OPENCL_CHILD, str(bundle)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK" and done.stderr == ""


VALUE = r"""
#include <stdint.h>
int32_t value(void) { return VALUE; }
"""


def test_shared_objects_load_from_sealed_memory_files_never_from_the_cache(tmp_path):
    """What runs is the bytes that were hashed: an anonymous sealed file, one per library, kept open
    (a reused ``/proc/self/fd/N`` name would make ``dlopen`` hand back the earlier library)."""
    import ctypes
    import errno

    from engine_cpu import CCompiler
    from engine_cpu.program import ProgramLoader

    compiler = CCompiler(tmp_path)
    loader = ProgramLoader(tmp_path, compiler)
    libraries = []
    for n in range(1, 6):
        _, data = compiler.build(VALUE.replace("VALUE", str(n)), compiler.flags_for({}))
        library = loader.load_library(data, f"value {n}")
        assert str(library.path).startswith("/proc/self/fd/") and library.fd is not None
        assert os.readlink(library.path).startswith("/memfd:")
        with pytest.raises(OSError) as info:  # sealed: nobody can change the code under the library
            os.pwrite(library.fd, b"\0", 0)
        assert info.value.errno == errno.EPERM
        libraries.append(library)
    for n, library in enumerate(libraries, start=1):  # each its own code, the same symbol name
        fn = library.handle["value"]
        fn.restype = ctypes.c_int32
        assert fn() == n
    assert len({lib.fd for lib in libraries}) == 5 and loader.loaded_libraries() == 5
    assert not (tmp_path / "cpu" / "so").exists()
