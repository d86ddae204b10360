"""A bounded cache (issue 14): ``engine cache info|clear|prune``, the size cap kept by the writers while
a 300-key tuning run proceeds, tuning traces only when asked, and eviction that never breaks a
process using what was evicted. Real files, real processes, real compiled kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.cache import cache_info, clear_cache, prune_cache
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp
from engine.plugins import Registry
from engine.settings import Settings, parse_size

SOURCE = r"""
#include <stdint.h>
int32_t twice_a(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = 2.0f * x[i];
    return 0;
}
int32_t twice_b(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = sym[0] - 1; i >= 0; i--) y[i] = x[i] + x[i];
    return 0;
}
"""


def _registry(cache: Path, **settings) -> Registry:
    registry = Registry(Settings(cache_dir=cache, **settings))
    registry.load_entry_points()
    return registry


def _source_bundle(path: Path, registry: Registry, marker: int = 0) -> Path:
    """A bundle whose one kernel is C source only (compiled into the cache's ``cpu/build`` at load);
    ``marker`` makes another source, hence another cache entry."""
    b = GraphBuilder(f"twice_{marker}", registry=registry)
    x = b.input("x", "float32", ["n"])
    src = f"/* {marker} */\n{SOURCE}".encode()
    k = b.kernel("twice", entries=["twice_a", "twice_b"],
                 binaries=[{"format": "c-source", "target": "any", "path": "twice.c", "data": src}])
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    b.save(path)
    return path


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ENGINE_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def _files(cache: Path, kind: str) -> list[Path]:
    return sorted(p for p in (cache / kind).rglob("*") if p.is_file() and not p.name.startswith(".")
                  and not p.name.endswith((".sha256", ".lock")) and ".auth" not in p.parts)


def _fill(cache: Path, registry: Registry, tmp_path: Path, count: int) -> list[Path]:
    """Compile ``count`` distinct sources into the cache (and tune each once); their bundle paths."""
    paths = []
    for i in range(count):
        path = _source_bundle(tmp_path / f"b{i}.cgb", registry, marker=i)
        graph = engine.load_compiled_graph(path, registry=_registry(cache))
        (y,) = graph.run_async([np.arange(4, dtype=np.float32)])
        np.testing.assert_array_equal(y.numpy(), 2 * np.arange(4, dtype=np.float32))
        graph.close()
        paths.append(path)
    return paths


# ---- engine cache info / prune / clear ---------------------------------------------------------
def test_cache_info_counts_each_kind_of_entry(tmp_path, registry):
    cache = tmp_path / "cache"
    _fill(cache, registry, tmp_path, 3)
    done = _cli("cache", "info", "--json", cache=cache)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    kinds = {k["kind"]: k for k in doc["kinds"]}
    builds = _files(cache, "cpu/build")
    assert kinds["cpu/build"]["entries"] == len(builds) >= 3  # one entry per compiled source (+ fusion runner)
    assert kinds["dispatch"]["entries"] == len(_files(cache, "dispatch")) == 3  # one tuned file per bundle
    on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and p.name != "secret"
                  and not p.name.endswith(".lock") and p.name != "CACHEDIR.TAG")
    assert doc["bytes"] == sum(k["bytes"] for k in doc["kinds"]) == on_disk
    assert doc["entries"] == sum(k["entries"] for k in doc["kinds"])
    assert doc["root"] == str(cache) and doc["writable"] and doc["max_bytes"] == Settings().cache_max_bytes
    text = _cli("cache", "info", cache=cache).stdout
    assert str(cache) in text and "cpu/build" in text and "dispatch" in text and "cap 1.0 GiB" in text


def test_prune_older_than_removes_entries_unused_for_that_long(tmp_path, registry):
    cache = tmp_path / "cache"
    _fill(cache, registry, tmp_path, 2)
    builds = _files(cache, "cpu/build")
    old = builds[0]
    week_ago = time.time() - 8 * 86400
    for p in [old, old.with_name(old.name + ".sha256"), old.parent / ".auth" / old.name]:
        os.utime(p, (week_ago, week_ago))
    done = _cli("cache", "prune", "--older-than", "7d", cache=cache)
    assert done.returncode == 0, done.stderr
    assert "removed 1 entry" in done.stdout
    assert not old.exists() and not old.with_name(old.name + ".sha256").exists()
    assert not (old.parent / ".auth" / old.name).exists()  # an entry goes with its side files
    assert _files(cache, "cpu/build") == builds[1:]
    assert (cache / "cpu" / "build" / ".auth" / "secret").exists()


def test_prune_to_a_size_evicts_least_recently_used_first(tmp_path, registry):
    cache = tmp_path / "cache"
    _fill(cache, registry, tmp_path, 4)
    builds = _files(cache, "cpu/build")
    now = time.time()
    for age, path in enumerate(reversed(builds)):  # builds[0] is the least recently used
        for p in [path, path.with_name(path.name + ".sha256"), path.parent / ".auth" / path.name]:
            os.utime(p, (now - 100 * (age + 1), now - 100 * (age + 1)))
    sizes = {p: p.stat().st_size + p.with_name(p.name + ".sha256").stat().st_size
             + (p.parent / ".auth" / p.name).stat().st_size for p in builds}
    total = cache_info(cache).bytes
    limit = total - sizes[builds[0]] - sizes[builds[1]] // 2  # needs the two oldest gone
    result = prune_cache(cache, max_bytes=limit)
    assert result.removed_entries == 2
    assert _files(cache, "cpu/build") == builds[2:]
    assert cache_info(cache).bytes == result.remaining_bytes <= limit


def test_clear_removes_every_entry_and_the_cache_refills(tmp_path, registry):
    cache = tmp_path / "cache"
    paths = _fill(cache, registry, tmp_path, 2)
    done = _cli("cache", "clear", cache=cache)
    assert done.returncode == 0, done.stderr
    assert cache_info(cache).entries == 0
    assert (cache / "cpu" / "build" / ".auth" / "secret").exists()  # the cache's secret stays
    graph = engine.load_compiled_graph(paths[0], registry=_registry(cache))  # rebuilt on the next miss
    (y,) = graph.run_async([np.ones(3, np.float32)])
    np.testing.assert_array_equal(y.numpy(), 2)
    assert cache_info(cache).entries >= 1


@pytest.mark.parametrize("argv, message", [
    (["cache", "prune", "--older-than", "7x"], "--older-than '7x': expected a number and a unit"),
    (["cache", "prune", "--max-bytes", "lots"], "--max-bytes='lots': expected a size in bytes"),
    (["cache", "info", "--older-than", "1d"], "apply to 'engine cache prune'"),
    (["cache", "shrink"], "invalid choice: 'shrink'"),
])
def test_bad_cache_arguments_are_one_line_usage_errors(tmp_path, argv, message):
    done = _cli(*argv, cache=tmp_path / "cache")
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "cache").exists()


def test_prune_and_clear_refuse_a_directory_that_is_not_a_cache(tmp_path):
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "todo.txt").write_text("keep me")
    (home / "thesis.tex").write_text("keep me too")
    for argv in (["cache", "clear"], ["cache", "prune", "--max-bytes", "0"]):
        done = _cli(*argv, cache=home)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert "does not look like an engine cache directory" in done.stderr and "nothing removed" in done.stderr
    assert (home / "thesis.tex").read_text() == "keep me too" and (home / "notes" / "todo.txt").exists()


def test_cache_size_settings():
    assert parse_size("512M", what="x") == 512 << 20 and parse_size("2GiB", what="x") == 2 << 30
    assert parse_size("1000", what="x") == 1000 and parse_size("0", what="x") == 0
    assert Settings.from_env({"ENGINE_CACHE_MAX_BYTES": "64k"}).cache_max_bytes == 65536
    assert Settings.from_env({}).cache_max_bytes == 1 << 30
    with pytest.raises(ValueError, match=r"ENGINE_CACHE_MAX_BYTES='1e9': expected a size in bytes"):
        Settings.from_env({"ENGINE_CACHE_MAX_BYTES": "1e9"})


# ---- the cap while 300 keys are tuned ----------------------------------------------------------
def test_the_cap_holds_while_300_keys_are_tuned_with_traces(tmp_path, registry):
    """The issue's case: every batch size from 1 to 300 tuned at run time, a trace each. The writers
    keep the cache under its cap after every key; an ``engine cache prune`` from another process in
    the middle of the run shrinks it further without disturbing the run."""
    cap = 256 * 1024
    cache = tmp_path / "cache"
    bundle = tmp_path / "mlp.cgb"
    build_mlp(registry=registry).save(bundle)
    graph = engine.load_compiled_graph(bundle, registry=_registry(cache, cache_max_bytes=cap))
    graph.tuning = attrs.evolve(graph.tuning, write_traces=True, warmup=1, repeat=1, min_sample_ms=0.0)
    weights = mlp_weights()
    sizes = []
    for batch in range(1, 301):
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        (y,) = graph.run_async([x])
        if batch % 50 == 0:
            np.testing.assert_allclose(y.numpy(), reference_mlp(x, weights), rtol=1e-4, atol=1e-6)
        sizes.append(cache_info(cache).bytes)
        if batch == 150:
            done = _cli("cache", "prune", "--max-bytes", "64K", cache=cache)
            assert done.returncode == 0, done.stderr
            assert cache_info(cache).bytes <= 64 * 1024
    assert max(sizes) <= cap, max(sizes)
    traces = list((cache / "traces").rglob("*.json"))
    assert 0 < len(traces) < 300  # the oldest traces were evicted ...
    assert any(t.name == "batch=300.json" for t in traces)  # ... the newest kept
    assert sum(p.stat().st_size for p in traces) > cap // 2  # the cap, not something else, bounded them
    assert len(graph.dispatch_table) == 300 and graph.run_stats().tuned_keys == 300
    assert graph.dispatch_cache.path.exists()  # the file being written is the most recently used


def test_tuning_writes_no_traces_unless_asked(tmp_path, registry):
    cache = tmp_path / "cache"
    bundle = tmp_path / "mlp.cgb"
    build_mlp(registry=registry).save(bundle)
    graph = engine.load_compiled_graph(bundle, registry=_registry(cache))
    assert graph.tuning.write_traces is False
    for batch in (2, 3):
        graph.run_async([np.ones((batch, 64), np.float32)])
    graph.tune(batch=[4, 5])
    assert len(graph.dispatch_table) == 4 and not (cache / "traces").exists()
    assert graph.last_tune_trace is None
    graph.tuning = attrs.evolve(graph.tuning, write_traces=True)  # asked for: one per key, one per tune()
    graph.run_async([np.ones((6, 64), np.float32)])
    graph.tune(batch=[7])
    names = sorted(p.name for p in (cache / "traces" / graph.identity).iterdir())
    assert names[0] == "batch=6.json" and len(names) == 2 and names[1].startswith("tune-")


def test_tuning_traces_setting_turns_traces_on(tmp_path, registry):
    cache = tmp_path / "cache"
    bundle = tmp_path / "mlp.cgb"
    build_mlp(registry=registry).save(bundle)
    registry_with_traces = Registry(Settings.from_env({"ENGINE_CACHE_DIR": str(cache), "ENGINE_TUNING_TRACES": "1"}))
    graph = engine.load_compiled_graph(bundle, registry=registry_with_traces)
    assert graph.tuning.write_traces is True
    graph.run_async([np.ones((2, 64), np.float32)])
    assert [p.name for p in (cache / "traces" / graph.identity).iterdir()] == ["batch=2.json"]


def test_a_bad_cache_cap_is_a_one_line_error(tmp_path):
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path), ENGINE_CACHE_MAX_BYTES="lots")
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "cache", "info"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode != 0 and "internal error" not in done.stderr
    assert done.stderr.count("\n") == 1 and "ENGINE_CACHE_MAX_BYTES='lots': expected a size in bytes" in done.stderr


# ---- eviction never breaks a process using an entry ---------------------------------------------
USER = textwrap.dedent(r"""
    import sys
    from pathlib import Path
    import numpy as np
    import engine
    from engine.plugins import Registry
    from engine.settings import Settings
    from engine_cpu import CCompiler
    from engine_cpu.program import ProgramLoader

    bundle, cache = sys.argv[1], Path(sys.argv[2])

    def registry():
        r = Registry(Settings(cache_dir=cache))
        r.load_entry_points()
        return r

    x = np.arange(6, dtype=np.float32)
    graph = engine.load_compiled_graph(bundle, registry=registry())
    # The platform fallback too: a shared object opened by its path in the cache (content store).
    compiler = CCompiler(cache)
    loader = ProgramLoader(cache, compiler, from_memory=False)
    _, so = compiler.build(open(sys.argv[3]).read(), compiler.flags_for({}))
    library = loader.load_library(so, "by path")
    import ctypes
    fn = library.handle["twice_a"]
    fn.restype = ctypes.c_int32

    def call_by_path():
        y = np.zeros_like(x)
        ptrs = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
        n = (ctypes.c_int64 * 1)(len(x))
        assert fn(ptrs, n, None) == 0
        return y

    def check():
        (y,) = graph.run_async([x])
        assert (y.numpy() == 2 * x).all() and (call_by_path() == 2 * x).all()

    check()
    print(library.path, flush=True)
    assert sys.stdin.readline().strip() == "go"  # the parent cleared the cache meanwhile
    check()  # everything this process loaded still runs
    again = engine.load_compiled_graph(bundle, registry=registry())  # a fresh load rebuilds what is gone
    (y,) = again.run_async([x])
    assert (y.numpy() == 2 * x).all()
    print("OK", flush=True)
""")


def test_clearing_the_cache_never_breaks_a_process_using_its_entries(tmp_path, registry):
    cache = tmp_path / "cache"
    bundle = _source_bundle(tmp_path / "b.cgb", registry)
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    user = subprocess.Popen([sys.executable, "-c", USER, str(bundle), str(cache), str(source)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        mapped = Path(user.stdout.readline().strip())  # the child has loaded and run everything
        assert mapped.parent == cache / "cpu" / "so" and mapped.exists()
        assert cache_info(cache).kinds and clear_cache(cache).removed_entries >= 3
        assert not mapped.exists() and _files(cache, "cpu/build") == []
        user.stdin.write("go\n")
        user.stdin.flush()
        out, err = user.communicate(timeout=600)
    finally:
        if user.poll() is None:
            user.kill()
    assert user.returncode == 0, err
    assert out.strip() == "OK"
    assert len(_files(cache, "cpu/build")) >= 1  # the fresh load rebuilt into the cache
