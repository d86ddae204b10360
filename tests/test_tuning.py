"""Candidate timing, the selection rule, dispatch policies and ahead-of-time tuning (issue 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.runtime.tuning import CandidateTiming, TuningOptions, select_candidate, tune_instruction
from engine.settings import Settings
from support import run_in_threads

# Two candidates with the same result; "heavy" does 8x the passes of "light". heavy is candidate 0,
# so picking light shows the timing worked (the "first" policy and index tie-breaks favour 0).
# The kernel is the tuning benchmark's, so the test and the benchmark measure the same thing.
from engine.testing.two_candidates import WORK_C  # noqa: E402
from engine.testing.two_candidates import work_bundle as work_graph  # noqa: E402

# In place (y is x): y = x + 1, the slow way or the fast way. Run twice, it would add 2.
INC_C = r"""
#include <stdint.h>
int32_t inc_slow(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) {
        float v = x[i];
        for (int p = 0; p < 16; p++) v = 0.5f * v + 0.5f * x[i];
        y[i] = v + 1.0f;
    }
    return 0;
}
int32_t inc_fast(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + 1.0f;
    return 0;
}
"""

GRID_C = r"""
#include <stdint.h>
/* y[n, m] = x[n, m] * 2 (two candidates, same result). */
int32_t dbl_a(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0] * sym[1]; i++) y[i] = x[i] * 2.0f;
    return 0;
}
int32_t dbl_b(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = sym[0] * sym[1] - 1; i >= 0; i--) y[i] = x[i] + x[i];
    return 0;
}
"""


@pytest.fixture
def fresh_registry(tmp_path) -> Registry:
    from support import make_registry

    return make_registry(tmp_path / "cache")


@pytest.fixture(scope="module")
def work_bundle(tmp_path_factory, registry) -> Path:
    return work_graph(registry, tmp_path_factory.mktemp("work") / "work.cgb")


def test_cheaper_candidate_wins_10_of_10_and_survives_save_load_in_another_process(work_bundle, fresh_registry,
                                                                                   tmp_path):
    graph = engine.load_compiled_graph(work_bundle, registry=fresh_registry)
    sizes = [4096 * k for k in range(1, 11)]  # 10 independent tunings (one per key)
    rows = graph.tune(n=sizes)
    picks = [rows[(n,)][0] for n in sizes]
    assert picks == [1] * 10, (picks, graph.tuning_results())
    for n in sizes:
        (t,) = graph.tuning_results()[(n,)]
        assert t.chosen == 1 and t.medians_ms[0] > t.medians_ms[1]

    saved = tmp_path / "tuned.cgb"
    graph.save(saved, save_dispatch_table=True)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, sys, numpy as np, engine
        graph = engine.load_compiled_graph(sys.argv[1], dispatch_policy="error")
        x = np.arange(40960, dtype=np.float32)
        y = graph(x).numpy()
        print(json.dumps({"row": graph.dispatch_table[(40960,)], "ok": bool((y == x).all()),
                          "slow": graph.run_stats().slow_runs, "source": graph.dispatch_table.source((40960,))}))
    """), str(saved)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "child-cache")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"row": [1], "ok": True, "slow": 0, "source": "bundle"}


def test_selection_rule():
    # lowest median wins; within the tie tolerance the lowest index wins; dropped candidates never win
    assert select_candidate([1.0, 0.5, 0.7], [0, 1, 2], 0.02) == 1
    assert select_candidate([1.0, 1.01, 0.995], [0, 1, 2], 0.02) == 0
    assert select_candidate([1.0, 1.01, 0.9], [0, 1, 2], 0.02) == 2
    assert select_candidate([0.1, 1.0, 1.0], [1, 2], 0.0) == 1


def test_tune_instruction_drops_clearly_slower_candidates_and_times_through_backend_time():
    class FakeBackend:
        """Samples are given per candidate: what Backend.time would have measured."""

        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []
            self.current = -1

        def time(self, fn, *, stream=None, warmup, repeat, device_index=0):
            fn()
            self.calls.append((self.current, repeat))
            return [{0: 3.0, 1: 1.0, 2: 1.05}[self.current]] * repeat

    backend = FakeBackend()

    def runner(c):
        def run():
            backend.current = c
        return run

    opts = TuningOptions(warmup=1, repeat=5, min_sample_ms=0.0)
    timing = tune_instruction([runner(0), runner(1), runner(2)], backend, 0, opts, instruction=3, task=1)
    assert isinstance(timing, CandidateTiming)
    assert timing.chosen == 1 and timing.dropped == (0,)
    assert timing.samples == (3, 5, 5) and timing.medians_ms == (3.0, 1.0, 1.05)
    assert (timing.instruction, timing.task) == (3, 1)


def test_tuning_options_are_validated():
    with pytest.raises(ValueError, match="repeat"):
        TuningOptions(repeat=0)
    with pytest.raises(ValueError, match="drop_ratio"):
        TuningOptions(drop_ratio=1.0)
    with pytest.raises(ValueError, match="tie_tolerance"):
        TuningOptions(tie_tolerance=-0.1)
    assert TuningOptions(3, 7).warmup == 3  # positional (warmup, repeat) as before


def _inc_graph(registry: Registry, *, on_input: bool):
    b = GraphBuilder("inc", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("inc", entries=["inc_slow", "inc_fast"], source=INC_C)
    src = x
    if not on_input:  # an intermediate written in place: y = inc(inc(x)) with both in place
        k0 = b.kernel("inc0", entries=["inc_fast"], source=INC_C)
        (src,) = b.call(k0, [x], [("float32", ["n"])], symbols=["n"])
    (y,) = b.call(k, [src], [("float32", ["n"])], symbols=["n"], share_map={0: 0})
    b.output(y, "y")
    return b.build()


@pytest.mark.parametrize("on_input", [False, True])
def test_in_place_candidates_are_timed_on_clones(fresh_registry, on_input):
    graph = _inc_graph(fresh_registry, on_input=on_input)
    x = np.arange(20000, dtype=np.float32)
    original = x.copy()
    y = graph(x).numpy()
    (timing,) = graph.tuning_results()[(20000,)]
    assert sum(timing.samples) >= 6  # the in-place kernel ran many times while timed ...
    expected = original + (1 if on_input else 2)
    np.testing.assert_array_equal(y, expected)  # ... yet the result saw exactly one application
    if on_input:  # written in place into the graph input, once
        np.testing.assert_array_equal(x, expected)
    else:
        np.testing.assert_array_equal(x, original)


def test_policies_each_do_what_they_say(work_bundle, fresh_registry):
    graph = engine.load_compiled_graph(work_bundle, registry=fresh_registry)
    x = np.ones(8192, np.float32)

    def used(g, arr):  # the candidate the run used, read from a trace of it
        (event,) = [e for e in g.trace([arr])["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel"]
        return event["args"]["candidate"]

    graph.dispatch_policy = "error"
    with pytest.raises(engine.InputError, match=r"no dispatch-table entry for n=8192 .*'error'"):
        graph.run_async([x])
    with pytest.raises(engine.InputError, match="n=8192"):
        graph.trace([x])

    graph.dispatch_policy = "first"
    np.testing.assert_array_equal(graph(x).numpy(), x)
    assert used(graph, x) == 0
    assert graph.tuning_results() == {} and len(graph.dispatch_table) == 0  # nothing timed, nothing recorded

    graph.dispatch_policy = "nearest"  # nothing tuned yet: nearest falls back to tuning
    graph.run_async([np.ones(4096, np.float32)])
    assert graph.dispatch_table[(4096,)] == (1,) and graph.dispatch_table.source((4096,)) == "tuned"
    graph.dispatch_table.record((100000,), (0,))  # a manual row far away
    assert used(graph, np.ones(5000, np.float32)) == 1  # nearest to 4096
    assert used(graph, np.ones(90000, np.float32)) == 0  # nearest to 100000
    assert (5000,) not in graph.dispatch_table and (90000,) not in graph.dispatch_table
    assert set(graph.tuning_results()) == {(4096,)}

    graph.dispatch_policy = "tune"  # the keys served by other policies are tuned now
    slow = graph.run_stats().slow_runs
    graph.run_async([x])
    assert graph.run_stats().slow_runs == slow + 1 and graph.dispatch_table[(8192,)] == (1,)
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        graph.dispatch_policy = "fastest"


def test_policy_from_the_environment_and_at_load(work_bundle, tmp_path):
    registry = Registry(Settings.from_env({"ENGINE_DISPATCH_POLICY": "error", "ENGINE_CACHE_DIR": str(tmp_path)}))
    registry.load_entry_points()
    graph = engine.load_compiled_graph(work_bundle, registry=registry)
    assert graph.dispatch_policy == "error"
    with pytest.raises(engine.InputError, match="n=3"):
        graph.run_async([np.ones(3, np.float32)])
    first = engine.load_compiled_graph(work_bundle, registry=registry, dispatch_policy="first")
    assert first.dispatch_policy == "first"
    with pytest.raises(ValueError, match="ENGINE_DISPATCH_POLICY"):
        Settings.from_env({"ENGINE_DISPATCH_POLICY": "fastest"})
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        engine.load_compiled_graph(work_bundle, registry=registry, dispatch_policy="fastest")


def test_tune_over_a_grid_then_no_key_takes_the_slow_path(fresh_registry):
    b = GraphBuilder("grid", registry=fresh_registry)
    x = b.input("x", "float32", ["n", "m"])
    k = b.kernel("dbl", entries=["dbl_a", "dbl_b"], source=GRID_C)
    (y,) = b.call(k, [x], [("float32", ["n", "m"])], symbols=["n", "m"])
    b.output(y, "y")
    graph = b.build()
    graph.tuning = attrs.evolve(graph.tuning, min_sample_ms=0.05)  # a quick grid
    seen = []
    rows = graph.tune(progress=lambda done, total, sym: seen.append((done, total, sym)), n=[1, 2, 4], m=range(3, 6))
    assert len(rows) == 9 and len(seen) == 9
    assert seen[0] == (1, 9, {"n": 1, "m": 3}) and seen[-1] == (9, 9, {"n": 4, "m": 5})
    stats = graph.run_stats()
    assert stats.slow_runs == 9 and stats.tuned_keys == 9
    assert graph.tune(n=[1, 2, 4], m=range(3, 6)) == rows  # already tuned: nothing runs
    assert graph.run_stats().slow_runs == 9
    graph.dispatch_policy = "error"
    for n in (1, 2, 4):
        for m in range(3, 6):
            a = np.full((n, m), 1.5, np.float32)
            np.testing.assert_array_equal(graph(a).numpy(), a * 2)
    after = graph.run_stats()
    assert after.slow_runs == 9 and after.prepared_runs == 9  # every key of the grid took the fast path
    with pytest.raises(engine.InputError, match="non-negative integers"):
        graph.tune(n=[-1], m=[1])
    with pytest.raises(engine.InputError, match="no values"):
        graph.tune(n=[], m=[1])


def test_threads_hitting_one_new_key_tune_it_once(work_bundle, fresh_registry):
    graph = engine.load_compiled_graph(work_bundle, registry=fresh_registry)
    x = np.arange(16384, dtype=np.float32)

    def worker(_: int) -> None:
        for _ in range(3):
            np.testing.assert_array_equal(graph(x).numpy(), x)

    run_in_threads(worker, 4)
    assert graph.tuning_stats().keys == 1 and graph.run_stats().slow_runs == 1
