"""Dispatch rows persisted under the cache directory; corrupt caches and bundle tables (issue 4)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.bundle.dispatch_text import parse_dispatch_table
from engine.bundle.reader import BundleArchive
from engine.bundle.save import write_bundle
from engine.bundle.writer import copy_members
from engine.plugins import Registry
from engine.runtime.dispatch_cache import DispatchCache, DispatchCacheWarning
from engine.runtime.tuning import TuningOptions
from engine.settings import Settings

TWO_WAY_C = r"""
#include <stdint.h>
/* y[n] = x[n] + 1, two ways (candidates), so the graph has something to tune. */
int32_t up(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + 1.0f;
    return 0;
}
int32_t down(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = sym[0] - 1; i >= 0; i--) y[i] = x[i] + 1.0f;
    return 0;
}
"""


def _registry(cache: Path, **settings) -> Registry:
    registry = Registry(Settings(cache_dir=cache, **settings))
    registry.load_entry_points()
    return registry


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, registry) -> Path:
    b = GraphBuilder("two_way", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("plus_one", entries=["up", "down"], source=TWO_WAY_C)
    (h,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    (y,) = b.call(k, [h], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    path = tmp_path_factory.mktemp("two_way") / "two_way.cgb"
    b.save(path)
    return path


def _load(bundle: Path, cache: Path, **kw) -> engine.CompiledGraph:
    graph = engine.load_compiled_graph(bundle, registry=_registry(cache), **kw)
    graph.tuning = TuningOptions(min_sample_ms=0.05)  # quick tuning: these tests are about files
    return graph


def _run(graph: engine.CompiledGraph, n: int) -> None:
    x = np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(graph(x).numpy(), x + 2)


def test_rows_tuned_at_run_time_persist_under_the_bundle_identity(bundle, tmp_path):
    graph = _load(bundle, tmp_path)
    path = tmp_path / "dispatch" / f"{graph.identity}.{graph.device_tag}.txt"
    assert graph.dispatch_cache is not None and graph.dispatch_cache.path == path
    _run(graph, 10)
    _run(graph, 20)
    rows = parse_dispatch_table(path.read_text(), symbols=["n"], candidates_per_task=[2])
    assert rows == {(10,): graph.dispatch_table[(10,)], (20,): graph.dispatch_table[(20,)]}
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # no temporary file left behind

    again = _load(bundle, tmp_path)  # a new process would see the same: the rows come from the file
    assert again.dispatch_table.rows() == rows and again.dispatch_table.source((10,)) == "cache"
    _run(again, 10)
    assert again.run_stats().slow_runs == 0 and again.tuning_results() == {}


def test_bundle_rows_come_first_then_cache_rows_and_save_writes_the_merged_table(bundle, tmp_path):
    graph = _load(bundle, tmp_path / "a")
    graph.dispatch_table.record((8,), (1,))
    graph.save(tmp_path / "with_table.cgb", save_dispatch_table=True)
    cache = tmp_path / "b"
    (cache / "dispatch").mkdir(parents=True)
    (cache / "dispatch" / f"{graph.identity}.{graph.device_tag}.txt").write_text("n\n8 0\n9 1\n")
    loaded = _load(tmp_path / "with_table.cgb", cache)
    assert loaded.identity == graph.identity
    assert loaded.dispatch_table.rows() == {(8,): (1,), (9,): (1,)}  # the bundle's 8 wins over the cache's
    assert (loaded.dispatch_table.source((8,)), loaded.dispatch_table.source((9,))) == ("bundle", "cache")
    loaded.save(tmp_path / "merged.cgb", save_dispatch_table=True)
    text = BundleArchive.open(tmp_path / "merged.cgb").read("dispatch_table.txt").decode()
    assert text == "n\n8 1\n9 1\n"


def test_caching_can_be_switched_off(bundle, tmp_path):
    registry = Registry(Settings.from_env({"ENGINE_CACHE_DIR": str(tmp_path), "ENGINE_DISPATCH_CACHE": "0"}))
    registry.load_entry_points()
    graph = engine.load_compiled_graph(bundle, registry=registry)
    assert graph.dispatch_cache is None
    _run(graph, 5)
    assert not (tmp_path / "dispatch").exists() and not (tmp_path / "traces").exists()


CORRUPT = {
    "truncated": lambda good: good[: len(good) - 3],           # the last row loses its last field
    "garbled": lambda good: b"\x8f\xff\x00garbage\x01\n" + good,  # not even text
    "wrong header": lambda good: b"batch\n" + good.split(b"\n", 1)[1],
    "index out of range": lambda good: good + b"30 7\n",
    "duplicate key": lambda good: good + good.split(b"\n")[1] + b"\n",
    "empty": lambda good: b"",
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_corrupt_cache_file_is_reported_once_ignored_and_repaired(bundle, tmp_path, kind):
    first = _load(bundle, tmp_path)
    for n in (11, 12):
        _run(first, n)
    path = first.dispatch_cache.path
    path.write_bytes(CORRUPT[kind](path.read_bytes()))

    with pytest.warns(DispatchCacheWarning, match=r"dispatch cache .*ignored") as record:
        graph = _load(bundle, tmp_path)
    assert len(record) == 1 and str(path) in str(record[0].message)
    assert len(graph.dispatch_table) == 0 and graph.dispatch_cache.problems
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchCacheWarning)  # reported once: tuning and storing again stays quiet
        _run(graph, 11)  # retuned ...
        _run(graph, 13)
    assert graph.run_stats().slow_runs == 2
    rows = parse_dispatch_table(path.read_text(), symbols=["n"], candidates_per_task=[2])  # ... and repaired
    assert set(rows) == {(11,), (13,)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchCacheWarning)
        assert set(_load(bundle, tmp_path).dispatch_table) == {(11,), (13,)}


def test_an_unwritable_cache_is_reported_and_tuning_still_works(bundle, tmp_path):
    (tmp_path / "dispatch").write_text("a file where the dispatch cache directory should be")
    graph = _load(bundle, tmp_path)
    with pytest.warns(DispatchCacheWarning, match="cannot be written"):
        _run(graph, 7)
    assert (7,) in graph.dispatch_table
    _run(graph, 7)
    assert graph.run_stats().slow_runs == 1


BAD_TABLES = {
    b"n\n4 0\n5 1 0\n": r"line 3 has 3 fields, expected 1 symbol values and 1 candidate indices",
    b"n\n4 0\n5 x\n": r"line 3 has a non-integer field",
    b"n\n4 2\n": r"line 2: task 0 has 2 candidates, the row picks 2",
    b"n\n4 0\n4 1\n": r"line 3 repeats the key of line 2",
    b"batch\n4 0\n": r"line 1 names symbols \['batch'\]",
    b"n\n-4 0\n": r"line 2: negative symbol value",
    b"n\n4 0\n\xff\xfe 1\n": r"not UTF-8: .* at line 3",
    b"": r"empty dispatch table",
}


@pytest.mark.parametrize("table", sorted(BAD_TABLES), ids=lambda t: BAD_TABLES[t][:24])
def test_a_bad_table_inside_a_bundle_is_refused_naming_the_line(bundle, tmp_path, table):
    target = tmp_path / "bad.cgb"
    with BundleArchive.open(bundle) as archive:
        write_bundle(target, copy_members(archive, {"dispatch_table.txt": table}), engine_version="0.1.0")
    with pytest.raises(engine.BundleError, match=BAD_TABLES[table]) as info:
        engine.load_compiled_graph(target, registry=_registry(tmp_path / "cache"))
    assert info.value.member == "dispatch_table.txt"


def _store_many(cache_dir: str, identity: str, worker: int, count: int, start_at: float) -> None:
    cache = DispatchCache(cache_dir, identity, ["n"], [2, 3])
    while time.time() < start_at:
        time.sleep(0.001)
    for i in range(count):
        cache.store({(worker * 1000 + i,): (i % 2, i % 3)})


def test_concurrent_stores_lose_no_rows(tmp_path):
    ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
    start_at = time.time() + 0.3
    procs = [ctx.Process(target=_store_many, args=(str(tmp_path), "abc", w, 40, start_at)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    rows = parse_dispatch_table((tmp_path / "dispatch" / "abc.txt").read_text(), symbols=["n"],
                                candidates_per_task=[2, 3])
    assert set(rows) == {(w * 1000 + i,) for w in range(4) for i in range(40)}
    assert not [p for p in (tmp_path / "dispatch").iterdir() if ".tmp-" in p.name]


WORKER = """
import json, os, sys, time, numpy as np, engine
from engine.runtime.tuning import TuningOptions
bundle, keys, go = sys.argv[1], [int(k) for k in sys.argv[2].split(",")], sys.argv[3]
graph = engine.load_compiled_graph(bundle)
graph.tuning = TuningOptions(min_sample_ms=0.05)
print("ready", flush=True)
while not os.path.exists(go):                # start together: every process is loaded by now
    time.sleep(0.001)
half = len(keys) // 2
for n in keys[:half]:                       # tuned at run time: one locked store per key
    x = np.arange(n, dtype=np.float32)
    assert (graph(x).numpy() == x + 2).all()
graph.tune(n=keys[half:])                    # tuned ahead of time: stored in batches
print(json.dumps(sorted(k[0] for k in graph.tuning_results())))
"""


def test_four_processes_tuning_new_keys_of_one_bundle_at_once(bundle, tmp_path):
    cache = tmp_path / "shared-cache"
    env = {**os.environ, "ENGINE_CACHE_DIR": str(cache)}
    go = tmp_path / "go"
    keys = {w: [100 * (w + 1) + i for i in range(8)] for w in range(4)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), str(bundle),
                               ",".join(map(str, keys[w])), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for w in range(4)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
    finally:
        go.touch()
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    for w, (out, _) in enumerate(outs):
        assert json.loads(out.splitlines()[-1]) == keys[w]  # each tuned its own keys
    graph = _load(bundle, cache)
    text = graph.dispatch_cache.path.read_text()
    rows = parse_dispatch_table(text, symbols=["n"], candidates_per_task=[2])  # valid ...
    assert set(rows) == {(k,) for ks in keys.values() for k in ks}  # ... and holds every key
    assert set(graph.dispatch_table) == set(rows)


def test_rows_are_kept_per_device_model(bundle, tmp_path):
    """A choice tuned on one device model is not served on another (different device tag)."""
    graph = _load(bundle, tmp_path)
    _run(graph, 10)
    other = tmp_path / "dispatch" / f"{graph.identity}.{'0' * 16}.txt"
    other.write_text("n\n77 0\n")  # as if another machine (another CPU model) had tuned n=77
    again = _load(bundle, tmp_path)
    assert (10,) in again.dispatch_table.rows() and (77,) not in again.dispatch_table.rows()
