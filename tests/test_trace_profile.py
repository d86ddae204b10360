"""Chrome traces and per-instruction profiles of the chosen candidates (issue 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp
from engine.runtime.profile import Profile, ProfileRow
from engine.runtime.tuning import TuningOptions

KERNELS = ["matmul_1", "bias_relu", "matmul_2", "bias_add", "softmax"]


@pytest.fixture
def fresh_registry(tmp_path):
    from support import make_registry

    return make_registry(tmp_path / "cache")


@pytest.fixture
def graph(mlp_bundle, fresh_registry):
    g = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    g.tuning = TuningOptions(min_sample_ms=0.2)
    return g


def _kernel_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel"]


def _check_chrome_trace(trace: dict) -> None:
    """The Trace Event Format's JSON object form, as Perfetto reads it."""
    assert json.loads(json.dumps(trace)) == trace  # plain JSON
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0
    for track in {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}:  # no overlap on a track
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                       if e["ph"] == "X" and (e["pid"], e["tid"]) == track)
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_trace_is_a_valid_chrome_trace_of_the_chosen_candidates(graph, tmp_path):
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    path = tmp_path / "out" / "trace.json"
    trace = graph.trace([x], path=path)
    _check_chrome_trace(trace)
    assert json.loads(path.read_text()) == trace
    events = _kernel_events(trace)
    assert [e["name"] for e in events] == KERNELS
    choice = graph.dispatch_table[(16,)]  # the trace's run tuned the key first
    for pos, e in enumerate(events):
        args = e["args"]
        assert args["instruction"] == pos and args["candidate"] == choice[args["task"]]
        assert args["entry"] == graph.compiled_tasks[args["task"]].meta.candidates[args["candidate"]].entry
        assert args["device"] == "cpu"
    assert events[0]["args"]["inputs"] == [[16, 64], [64, 128]] and events[0]["args"]["outputs"] == [[16, 128]]
    assert events[4]["args"]["outputs"] == [[16, 10]]
    assert trace["otherData"]["key"] == {"batch": 16} and trace["otherData"]["choices"] == list(choice)
    tuning = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "tuning"]
    assert [e["name"] for e in tuning] == ["tune matmul_1", "tune matmul_2"]
    assert graph.trace([x])["otherData"]["choices"] == list(choice)  # a known key: nothing is tuned
    assert not [e for e in graph.trace([x])["traceEvents"] if e.get("cat") == "tuning"]


def test_every_tuned_key_leaves_a_trace_in_the_cache_when_asked(graph, fresh_registry):
    graph.tuning = TuningOptions(min_sample_ms=0.2, write_traces=True)  # off by default (issue 14)
    for batch in (3, 5):  # tuned at run time: one file per key
        graph.run_async([np.ones((batch, 64), np.float32)])
    folder = Path(fresh_registry.settings.cache_dir) / "traces" / graph.identity
    assert graph.trace_dir == folder
    assert sorted(p.name for p in folder.iterdir()) == ["batch=3.json", "batch=5.json"]
    trace = json.loads((folder / "batch=5.json").read_text())
    _check_chrome_trace(trace)
    assert [e["name"] for e in _kernel_events(trace)] == KERNELS
    tuning = {e["name"]: e["args"] for e in trace["traceEvents"] if e.get("cat") == "tuning"}
    assert set(tuning) == {"tune matmul_1", "tune matmul_2"}
    assert tuning["tune matmul_1"]["chosen"] == graph.dispatch_table[(5,)][0]
    assert len(tuning["tune matmul_1"]["medians_ms"]) == 2

    graph.tune(batch=[3, 7, 9])  # ahead of time: one file for the grid, one process per new key
    (session,) = [p for p in folder.iterdir() if p.name.startswith("tune-")]
    assert graph.last_tune_trace == session
    trace = json.loads(session.read_text())
    _check_chrome_trace(trace)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["batch=7", "batch=9"]
    for pid in names:
        assert [e["name"] for e in _kernel_events(trace) if e["pid"] == pid] == KERNELS
    assert trace["otherData"]["keys"] == [{"batch": 7}, {"batch": 9}]


def test_profile_rows_table_and_json(graph):
    x = np.ones((8, 64), np.float32)
    graph.run_async([x])
    profile = graph.profile([x], warmup=1, repeat=4)
    assert isinstance(profile, Profile) and profile.key == (8,)
    assert [r.kernel for r in profile.rows] == KERNELS
    choice = graph.dispatch_table[(8,)]
    for pos, row in enumerate(profile.rows):
        assert isinstance(row, ProfileRow) and row.instruction == pos and row.candidate == choice[row.task]
        assert len(row.samples) == 4 and 0 < row.min_ms <= row.median_ms
    assert profile.rows[2].input_shapes == ((8, 128), (128, 10)) and profile.rows[2].output_shapes == ((8, 10),)
    assert profile.total_ms == pytest.approx(sum(r.median_ms for r in profile.rows))
    doc = json.loads(json.dumps(profile.to_json()))
    assert doc["key"] == {"batch": 8} and len(doc["rows"]) == 5 and doc["rows"][0]["kernel"] == "matmul_1"
    text = str(profile)
    lines = text.splitlines()
    assert lines[0].startswith("profile at batch=8") and "median ms" in lines[1] and "total" in lines[-1]
    assert len({len(line) for line in lines[1:3]}) == 1  # header and rule are aligned
    assert graph.run_stats().slow_runs == 1  # profiling is not a slow-path run
    with pytest.raises(ValueError, match="repeat"):
        graph.profile([x], repeat=0)


def test_trace_and_profile_leave_results_and_inputs_unchanged(fresh_registry):
    w = mlp_weights()
    graph = engine.load_compiled_graph(build_mlp(registry=fresh_registry).to_bytes(), registry=fresh_registry)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    keep = x.copy()
    graph.trace([x], warmup=3)  # bias_relu and bias_add write in place: warmed up on clones
    graph.profile([x], warmup=2, repeat=5)
    np.testing.assert_array_equal(x, keep)
    np.testing.assert_allclose(graph(x).numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)


ADD_IN_PLACE_C = r"""
#include <stdint.h>
int32_t add_one(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + 1.0f;
    return 0;
}
"""


def test_profiling_a_graph_that_writes_into_its_input_applies_it_once(fresh_registry):
    b = GraphBuilder("inplace", registry=fresh_registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("add_one", entries=["add_one"], source=ADD_IN_PLACE_C)
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"], share_map={0: 0})
    b.output(y, "y")
    graph = b.build()
    x = np.zeros(100, np.float32)
    graph.profile([x], warmup=3, repeat=7)
    np.testing.assert_array_equal(x, 1.0)  # the real run wrote once; timing ran on a clone
    graph.trace([x], warmup=3)
    np.testing.assert_array_equal(x, 2.0)


def test_trace_and_profile_time_the_same_instructions(graph):
    x = np.ones((256, 64), np.float32)  # large enough that each matmul takes a measurable time
    graph.run_async([x])
    traced: dict[int, list[float]] = {}
    for _ in range(5):
        for e in _kernel_events(graph.trace([x])):
            traced.setdefault(e["args"]["instruction"], []).append(e["dur"] / 1e3)
    profile = graph.profile([x], warmup=2, repeat=15)
    # Both time the same instructions of the same run, each with a positive, finite duration (how
    # close the two clocks agree is for benchmarks, not for an assert on a shared machine).
    assert set(traced) == {row.instruction for row in profile.rows}
    assert all(0 < d < float("inf") for v in traced.values() for d in v)
    assert all(0 < row.min_ms <= row.median_ms < float("inf") for row in profile.rows)
