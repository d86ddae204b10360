"""Build, save, load and run compiled graphs end to end with real C kernels (issue 2)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

BATCHES = (1, 3, 64)


@pytest.fixture
def fresh_registry(tmp_path):
    """A registry whose cache directory is this test's own: no dispatch rows tuned by other tests."""
    from support import make_registry

    return make_registry(tmp_path / "cache")


def _run_in_fresh_process(script: str, *args: str, cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = None
    if cache_dir is not None:  # the child's dispatch cache is then only what this test put there
        env = {**os.environ, "ENGINE_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_saved_bundle_runs_in_a_fresh_process(tmp_path, registry, form):
    weights = mlp_weights(seed=3)
    path = tmp_path / ("mlp.cgb" if form == "zip" else "mlp_bundle")
    build_mlp(weights=weights, registry=registry).save(path, form=form)
    assert path.is_file() if form == "zip" else path.is_dir()

    rng = np.random.default_rng(0)
    inputs = {f"x{b}": rng.standard_normal((b, 64)).astype(np.float32) for b in BATCHES}
    np.savez(tmp_path / "inputs.npz", **inputs)
    proc = _run_in_fresh_process("""
        import sys, numpy as np, engine
        graph = engine.load_compiled_graph(sys.argv[1])
        xs = np.load(sys.argv[2])
        out = {k: graph.run_async([xs[k]])[0].numpy() for k in xs.files}
        np.savez(sys.argv[3], **out)
    """, str(path), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz"), cache_dir=tmp_path / "child-cache")
    assert proc.returncode == 0, proc.stderr
    outputs = np.load(tmp_path / "outputs.npz")
    for b in BATCHES:
        got = outputs[f"x{b}"]
        assert got.shape == (b, 10)
        np.testing.assert_allclose(got, reference_mlp(inputs[f"x{b}"], weights), rtol=1e-5, atol=1e-6)


def test_outputs_match_numpy_and_are_fresh_per_run(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    w = mlp_weights()
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    (a,) = graph.run_async([x])
    (b,) = graph.run_async([x * 2])
    np.testing.assert_allclose(a.numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), reference_mlp(x * 2, w), rtol=1e-5, atol=1e-6)
    assert not np.shares_memory(a.numpy(), b.numpy())
    assert np.asarray(a).shape == (5, 10)
    assert graph(x).shape == (5, 10)  # __call__ returns the single output


def test_engine_tensor_and_torch_inputs(mlp_bundle, registry):
    torch = pytest.importorskip("torch")
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    expected = reference_mlp(x, mlp_weights())
    (from_tensor,) = graph.run_async([engine.asarray(x)])
    (from_torch,) = graph.run_async([torch.from_numpy(x)], output_to_torch_tensor=True)
    np.testing.assert_allclose(from_tensor.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert isinstance(from_torch, torch.Tensor)
    np.testing.assert_allclose(from_torch.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_caller_given_outputs_are_written(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    out = np.zeros((2, 10), np.float32)
    (res,) = graph.run_async([x], outputs=[out])
    np.testing.assert_allclose(out, reference_mlp(x, mlp_weights()), rtol=1e-5, atol=1e-6)
    assert np.shares_memory(res.numpy(), out)


def test_tuning_then_fast_path(mlp_bundle, fresh_registry):
    from engine.runtime.tuning import select_candidate

    graph = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    assert len(graph.dispatch_table) == 0
    x = np.ones((7, 64), np.float32)
    graph.run_async([x])
    stats = graph.run_stats()
    assert (stats.slow_runs, stats.fast_runs) == (1, 0)
    assert (7,) in graph.dispatch_table
    choice = graph.dispatch_table[(7,)]
    assert len(choice) == graph.meta.num_kernels
    timings = graph.tuning_results()[(7,)]
    assert {t.task for t in timings} == {i for i, t in enumerate(graph.compiled_tasks) if len(t.candidates) > 1}
    for t in timings:
        assert len(t.medians_ms) == 2 and all(m > 0 for m in t.medians_ms)
        kept = [c for c in range(2) if c not in t.dropped]
        assert t.chosen == choice[t.task] == select_candidate(t.medians_ms, kept, graph.tuning.tie_tolerance)
    for _ in range(5):
        graph.run_async([x])
    stats = graph.run_stats()
    assert stats.slow_runs == 1 and stats.prepared_runs == 1 and stats.fast_runs == 4
    assert graph.dispatch_table[(7,)] == choice


def test_dispatch_table_round_trip_skips_tuning(tmp_path, mlp_bundle, fresh_registry):
    registry = fresh_registry
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    for b in (2, 9):
        graph.run_async([np.ones((b, 64), np.float32)])
    saved = tmp_path / "tuned.cgb"
    engine.save_compiled_graph(graph, saved, save_dispatch_table=True)
    again = engine.load_compiled_graph(saved, registry=registry)
    assert again.dispatch_table.rows() == graph.dispatch_table.rows()
    assert again.identity == graph.identity  # the dispatch table is not part of the identity
    again.run_async([np.ones((9, 64), np.float32)])
    assert again.run_stats().slow_runs == 0 and again.run_stats().prepared_runs == 1


def test_save_without_weights_then_set_weights(tmp_path, registry):
    w = mlp_weights(seed=5)
    graph = build_mlp(weights=w, registry=registry).build()
    path = tmp_path / "noweights.cgb"
    graph.save(path, save_weights=False)
    bare = engine.load_compiled_graph(path, registry=registry)
    assert bare.weights is None
    x = np.ones((2, 64), np.float32)
    with pytest.raises(engine.InputError, match="set_weights"):
        bare.run_async([x])
    bare.set_weights([w["w1"], w["b1"], w["w2"], w["b2"]])
    np.testing.assert_allclose(bare.run_async([x])[0].numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)
    assert "weights: 4 tensors" in str(bare)


def test_set_weights_errors_name_the_problem(mlp_bundle, registry2):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry2)
    w = mlp_weights()
    good = [w["w1"], w["b1"], w["w2"], w["b2"]]
    with pytest.raises(engine.InputError, match="has 4 weights, got 3"):
        graph.set_weights(good[:3])
    with pytest.raises(engine.InputError, match=r"weight 1 \('b1'\): expected dtype float32, got numpy float64"):
        graph.set_weights([good[0], good[1].astype(np.float64), *good[2:]])
    with pytest.raises(engine.InputError, match=r"weight 2 \('w2'\): expected shape \[128, 10\], got \[10, 128\]"):
        graph.set_weights([*good[:2], good[2].T.copy(), good[3]])
    on_other = engine.asarray(good[3], device="hostdev", registry=registry2)
    with pytest.raises(engine.InputError, match=r"weight 3 \('b2'\): expected a tensor on cpu, got one on hostdev"):
        graph.set_weights([*good[:3], on_other])
    # nothing was half-applied: the graph still runs with its original weights
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(graph.run_async([x])[0].numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)


def test_set_weights_changes_results_of_prepared_runs(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    x = np.ones((3, 64), np.float32)
    graph.run_async([x])
    graph.run_async([x])  # fast path prepared with the old weight addresses
    w = mlp_weights(seed=11)
    graph.set_weights([w["w1"], w["b1"], w["w2"], w["b2"]])
    np.testing.assert_allclose(graph.run_async([x])[0].numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)


def test_pickle_round_trip_into_another_process(tmp_path, mlp_bundle, fresh_registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    x = np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32)
    (expected,) = graph.run_async([x])  # tunes batch=6, so the pickle carries a dispatch row
    (tmp_path / "graph.pkl").write_bytes(pickle.dumps(graph))
    np.save(tmp_path / "x.npy", x)
    proc = _run_in_fresh_process("""
        import pickle, sys, json, numpy as np
        graph = pickle.loads(open(sys.argv[1], "rb").read())
        out = graph.run_async([np.load(sys.argv[2])])[0].numpy()
        np.save(sys.argv[3], out)
        print(json.dumps({"slow": graph.run_stats().slow_runs, "keys": len(graph.dispatch_table)}))
    """, str(tmp_path / "graph.pkl"), str(tmp_path / "x.npy"), str(tmp_path / "out.npy"),
        cache_dir=tmp_path / "child-cache")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected.numpy())
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info == {"slow": 0, "keys": 1}


def test_str_table(mlp_bundle, registry):
    text = str(engine.load_compiled_graph(mlp_bundle, registry=registry))
    rows = [line.split() for line in text.splitlines()]
    assert ["input", "x", "float32", "[batch,", "64]", "cpu"] in rows
    assert ["output", "probs", "float32", "[batch,", "10]", "cpu"] in rows
    params = 64 * 128 + 128 + 128 * 10 + 10
    assert f"parameters: {params:,}" in text
    assert "weights: 4 tensors" in text and "symbols: batch" in text


def test_two_graphs_with_different_weights_keep_their_own(tmp_path, registry):
    wa, wb = mlp_weights(seed=1), mlp_weights(seed=2)
    build_mlp(weights=wa, registry=registry).save(tmp_path / "a.cgb")
    build_mlp(weights=wb, registry=registry).save(tmp_path / "b.cgb")
    ga = engine.load_compiled_graph(tmp_path / "a.cgb", registry=registry)
    gb = engine.load_compiled_graph(tmp_path / "b.cgb", registry=registry)
    assert ga.meta.graph_hash == gb.meta.graph_hash  # same structure
    x = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)
    for _ in range(3):  # slow path, prepare, fast path: interleaved
        ra, rb = ga.run_async([x])[0].numpy(), gb.run_async([x])[0].numpy()
        np.testing.assert_allclose(ra, reference_mlp(x, wa), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb, reference_mlp(x, wb), rtol=1e-5, atol=1e-6)


IDENTITY_C = r"""
#include <stdint.h>
#include <string.h>
int32_t copy_bytes(void *const *t, const int64_t *sym, void *ws) {
    memcpy(t[1], t[0], (size_t)(sym[0] * NBYTES));
    return 0;
}
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "int8", "uint64", "bool"])
def test_weights_survive_save_and_load_bit_exact(tmp_path, registry, dtype):
    import ml_dtypes  # noqa: F401 - registers the numpy dtypes

    dt = engine.dtypes.dtype(dtype)
    raw = np.random.default_rng(7).integers(0, 256, size=(37, 5) if dt.nbytes == 1 else (37, 5 * dt.nbytes),
                                            dtype=np.uint8)
    if dtype == "bool":
        raw = raw % 2
    values = raw.view(dt.numpy).reshape(37, 5)
    b = GraphBuilder("identity", registry=registry)
    b.input("n", dtype, ["rows", 5])  # binds the symbol; the kernel copies the weight
    w = b.weight("w", values)
    k = b.kernel("copy", entries=["copy_bytes"], source=f"#define NBYTES {5 * dt.nbytes}\n" + IDENTITY_C)
    (y,) = b.call(k, [w], [(dtype, [37, 5])], symbols=["rows"])
    b.output(y)
    path = tmp_path / f"{dtype}.cgb"
    b.save(path)
    graph = engine.load_compiled_graph(path, registry=registry)
    loaded = graph.weights[0].numpy()
    assert loaded.dtype == dt.numpy and loaded.tobytes() == values.tobytes()
    (out,) = graph.run_async([np.zeros((37, 5), dt.numpy)])
    assert out.numpy().tobytes() == values.tobytes()
    assert not graph.weights[0].numpy().flags.writeable  # weights are read-only, mapped from the bundle


def test_weights_are_memory_mapped_not_copied(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    w1 = graph.weights[0]
    archive = graph.runtime.contents.archive
    offset = archive.data_offset("weights.bin")
    assert offset % 4096 == 0
    base = np.frombuffer(archive.map("weights.bin"), np.uint8)
    assert np.shares_memory(w1.numpy(), base)


def test_caller_given_outputs_are_checked(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(engine.InputError, match=r"outputs\[0\]: expected a C-contiguous float32\[2, 10\] array, got float64"):
        graph.run_async([x], outputs=[np.zeros((2, 10))])
    with pytest.raises(engine.InputError, match=r"got float32\[10, 2\] \(not C-contiguous\)"):
        graph.run_async([x], outputs=[np.zeros((2, 10), np.float32).T])
    frozen = np.zeros((2, 10), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(engine.InputError, match="read-only"):
        graph.run_async([x], outputs=[frozen])
    with pytest.raises(engine.InputError, match="the graph has 1 outputs, got 2"):
        graph.run_async([x], outputs=[np.zeros((2, 10), np.float32)] * 2)
