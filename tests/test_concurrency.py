"""Concurrent runs (issue 3): per-thread workspaces, graphs that share nothing, no growth, no leak.

The graphs are random DAGs of C kernels that fill their scratch with garbage and write some outputs
in place, so two runs sharing a workspace byte would corrupt each other's results. Kernels run
through ctypes, which releases the GIL: the threads really overlap.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import engine

from engine.testing import random_dags  # noqa: E402
from support import run_in_threads  # noqa: E402

THREADS = 8
RUNS = 200


def _graph(registry, seed: int, n_ops: int = 24):
    spec = random_dags.random_dag(seed, n_ops=n_ops)
    assert any(op.scratch != "0" for op in spec.ops) and any(op.in_place for op in spec.ops)
    return spec, random_dags.build_dag(spec, registry).build()


@pytest.fixture(scope="module")
def graphs(registry):
    return [_graph(registry, 5), _graph(registry, 12)]


def _job(spec: random_dags.DagSpec, rng: np.random.Generator) -> tuple[dict[str, int], list[np.ndarray]]:
    """Symbol values (1..16: several keys per graph) and random inputs for one run."""
    env = {s: int(rng.integers(1, 17)) for s in spec.symbols}
    return env, random_dags.random_inputs(spec, env, rng)


def _inputs(spec: random_dags.DagSpec, rng: np.random.Generator) -> list[np.ndarray]:
    return _job(spec, rng)[1]


def _run(graph, xs: list[np.ndarray]) -> list[np.ndarray]:
    return [t.numpy().copy() for t in graph.run_async([x.copy() for x in xs])]


def _check(got: list[np.ndarray], want: list[np.ndarray], where: str) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"output {k}, {where}")


def test_eight_threads_running_one_graph_match_the_serial_results(graphs):
    spec, graph = graphs[0]
    jobs = [[_job(spec, np.random.default_rng(1000 * i + r)) for r in range(RUNS)] for i in range(THREADS)]
    serial = [[_run(graph, xs) for _, xs in thread_jobs] for thread_jobs in jobs]
    for (env, xs), want in zip(jobs[0][:40], serial[0][:40]):  # the serial results are themselves right
        _check(want, random_dags.reference(spec, env, xs), f"serial vs numpy at {env}")

    def work(i: int) -> None:
        for r, (_, xs) in enumerate(jobs[i]):
            _check(_run(graph, xs), serial[i][r], f"thread {i} run {r}")

    run_in_threads(work, THREADS)


def test_two_graphs_interleaved_across_threads_match_the_serial_results(graphs):
    (spec_a, a), (spec_b, b) = graphs
    jobs = []
    for i in range(THREADS):
        rng = np.random.default_rng(77 + i)
        jobs.append([(a, _inputs(spec_a, rng)) if r % 2 == (i % 2) else (b, _inputs(spec_b, rng))
                     for r in range(RUNS)])
    serial = [[_run(g, xs) for g, xs in thread_jobs] for thread_jobs in jobs]

    def work(i: int) -> None:
        for r, (g, xs) in enumerate(jobs[i]):
            _check(_run(g, xs), serial[i][r], f"thread {i} run {r}")

    run_in_threads(work, THREADS)


def test_each_thread_has_its_own_workspaces(graphs):
    spec, graph = graphs[0]
    seen: dict[int, dict[str, int]] = {}
    keep = []
    xs = _inputs(spec, np.random.default_rng(3))

    def work(i: int) -> None:
        _run(graph, xs)
        lane = graph.runtime.lane()
        seen[i] = {k: w.base for k, w in lane.workspaces.items()}
        keep.append(lane.workspaces)  # keep them alive so that addresses cannot be reused

    run_in_threads(work, 4)
    addrs = [a for ws in seen.values() for a in ws.values()]
    assert len(addrs) == 4 and len(set(addrs)) == 4


def test_two_graphs_of_one_bundle_share_no_mutable_state(graphs, registry):
    spec, graph = graphs[0]
    twin = engine.load_compiled_graph(graph.to_bytes(), registry=registry)
    xs = _inputs(spec, np.random.default_rng(4))
    want = _run(graph, xs)

    workspaces = []

    def work(i: int) -> None:
        g = graph if i % 2 else twin
        for _ in range(50):
            _check(_run(g, xs), want, f"thread {i}")
        workspaces.append(g.runtime.lane().workspaces["cpu"])

    run_in_threads(work, 4)
    key = graph.runtime.binder.bind(xs)[2]
    assert graph.runtime is not twin.runtime and graph.runtime.key_plan(key) is not twin.runtime.key_plan(key)
    assert len({w.base for w in workspaces}) == 4


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_workspace_stops_growing_at_the_largest_key_and_memory_stays_flat(registry):
    spec, graph = _graph(registry, 21, n_ops=12)
    (symbol, *_) = spec.symbols
    rng = np.random.default_rng(0)
    sizes = [int(v) for v in rng.integers(1, 33, 10_000)]
    inputs = {}
    for n in set(sizes):
        env = {s: n for s in spec.symbols}
        inputs[n] = random_dags.random_inputs(spec, env, rng)
    largest_at = sizes.index(max(sizes))
    history = []
    rss_warm = None
    for r, n in enumerate(sizes):
        graph.run_async(inputs[n])
        history.append({k: w.nbytes for k, w in graph.runtime.lane().workspaces.items()})
        if r == 1000:
            gc.collect()
            rss_warm = _rss()
    gc.collect()
    grown = _rss() - rss_warm
    final = history[-1]
    assert all(h == final for h in history[max(largest_at, 0):])
    keys = {tuple(n for _ in spec.symbols) for n in sizes}
    assert final["cpu"] == max(graph.runtime.key_plan(k).workspace_bytes["cpu"] for k in keys)
    assert graph.run_stats().prepared_runs <= len(keys) * 8  # re-prepared only when the workspace grew
    assert grown < 4 << 20, f"resident memory grew by {grown} bytes over 9,000 runs"


def test_workspaces_are_released_with_the_thread_and_the_graph(registry):
    spec, graph = _graph(registry, 5)
    xs = _inputs(spec, np.random.default_rng(9))
    refs = []

    def work(i: int) -> None:
        _run(graph, xs)
        refs.append(weakref.ref(graph.runtime.lane().workspaces["cpu"].storages[0].owner))

    run_in_threads(work, 2)
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the threads ended: their workspaces went with them
    _run(graph, xs)
    ref = weakref.ref(graph.runtime.lane().workspaces["cpu"].storages[0].owner)
    del graph
    gc.collect()
    assert ref() is None
