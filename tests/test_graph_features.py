"""Hooks, reference weights.npz, in-place graph outputs, multi-kind plans, threads, policies, CLI."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.demo.mlp import mlp_weights, reference_mlp
from support import run_in_threads


@pytest.fixture
def fresh_registry(tmp_path):
    """A registry whose cache directory is this test's own: no dispatch rows tuned by other tests."""
    from support import make_registry

    return make_registry(tmp_path / "cache")

SCALE_C = r"""
#include <stdint.h>
/* y = x * w (w has one element per column); in place when share_map says so. */
int32_t scale(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *w = t[1]; float *y = t[2];
    for (int64_t i = 0; i < sym[0] * 3; i++) y[i] = x[i] * w[i % 3];
    return 0;
}
int32_t add_one(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0] * 3; i++) y[i] = x[i] + 1.0f;
    return 0;
}
"""


def _scale_graph(registry, *, in_place_input=False, device="cpu", copy_to=None) -> GraphBuilder:
    b = GraphBuilder("scale", registry=registry)
    x = b.input("x", "float32", ["n", 3], device=device)
    w = b.weight("w", np.array([1.0, 2.0, 3.0], np.float32), device=device)
    scale = b.kernel("scale", entries=["scale"], source=SCALE_C, device=device)
    (y,) = b.call(scale, [x, w], [("float32", ["n", 3])], symbols=["n"], share_map={0: 0} if in_place_input else None)
    if copy_to is not None:
        y = b.copy(y, copy_to)
        add = b.kernel("add_one", entries=["add_one"], source=SCALE_C, device=copy_to)
        (y,) = b.call(add, [y], [("float32", ["n", 3])], symbols=["n"])
        y = b.copy(y, device)
    b.output(y, "y")
    return b


def test_hooks_see_every_instruction_and_its_intermediates(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    seen = []

    def hook(index, inputs, outputs):
        seen.append((index, [t.shape for t in inputs], [t.numpy().copy() for t in outputs]))

    graph.register_hook(hook)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    for _ in range(2):  # hooks keep the graph interpreted, so every run reports
        seen.clear()
        (probs,) = graph.run_async([x])
        assert [s[0] for s in seen] == [0, 1, 2, 3, 4]
    w = mlp_weights()
    assert seen[0][1] == [(2, 64), (64, 128)]
    np.testing.assert_allclose(seen[0][2][0], x @ w["w1"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(seen[1][2][0], np.maximum(x @ w["w1"] + w["b1"], 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(seen[4][2][0], probs.numpy())


def test_reference_weights_npz_is_read(tmp_path, registry):
    graph = _scale_graph(registry).build()
    graph.save(tmp_path / "bin.cgb")
    with zipfile.ZipFile(tmp_path / "bin.cgb") as z:
        members = {n: z.read(n) for n in z.namelist() if n not in ("weights.bin", "manifest.json")}
    buf = io.BytesIO()
    np.savez(buf, arr_0=np.array([5.0, 6.0, 7.0], np.float32))
    members["weights.npz"] = buf.getvalue()
    from engine.bundle.save import write_bundle
    write_bundle(tmp_path / "npz.cgb", members, engine_version="reference")
    npz_graph = engine.load_compiled_graph(tmp_path / "npz.cgb", registry=registry)
    (y,) = npz_graph.run_async([np.ones((2, 3), np.float32)])
    np.testing.assert_array_equal(y.numpy(), [[5, 6, 7], [5, 6, 7]])
    # saving writes weights.bin, never weights.npz
    npz_graph.save(tmp_path / "resaved.cgb")
    with zipfile.ZipFile(tmp_path / "resaved.cgb") as z:
        assert "weights.bin" in z.namelist() and "weights.npz" not in z.namelist()


def test_in_place_output_reuses_the_input_buffer(registry):
    graph = _scale_graph(registry, in_place_input=True).build()
    assert graph.meta.share_map == {0: 0}
    x = np.ones((2, 3), np.float32)
    for _ in range(2):  # slow path, then fast path
        x[:] = 1
        (y,) = graph.run_async([x])
        np.testing.assert_array_equal(x, [[1, 2, 3], [1, 2, 3]])
        assert np.shares_memory(y.numpy(), x)


def test_two_kinds_with_builtin_copies(registry2):
    graph = _scale_graph(registry2, copy_to="hostdev").build()
    kinds = {t.meta.device for t in graph.compiled_tasks}
    assert kinds == {"cpu", "hostdev"} and sum(t.is_copy for t in graph.compiled_tasks) == 2
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for _ in range(3):
        (y,) = graph.run_async([x])
        np.testing.assert_array_equal(y.numpy(), x * [1, 2, 3] + 1)


def test_threads_share_one_graph(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    w = mlp_weights()

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(30):
            x = rng.standard_normal((int(rng.integers(1, 9)), 64)).astype(np.float32)
            np.testing.assert_allclose(graph.run_async([x])[0].numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)

    run_in_threads(worker, 4)


def test_dispatch_policies(mlp_bundle, fresh_registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    x = np.ones((3, 64), np.float32)
    graph.dispatch_policy = "error"
    with pytest.raises(engine.InputError, match="no dispatch-table entry for batch=3"):
        graph.run_async([x])
    graph.dispatch_policy = "first"
    np.testing.assert_allclose(graph.run_async([x])[0].numpy(), reference_mlp(x, mlp_weights()), rtol=1e-5, atol=1e-6)
    assert graph.run_stats().slow_runs == 0 and len(graph.dispatch_table) == 0  # nothing was timed or recorded
    graph.dispatch_policy = "tune"
    graph.run_async([np.ones((8, 64), np.float32)])
    graph.dispatch_policy = "nearest"
    graph.run_async([np.ones((9, 64), np.float32)])
    assert graph.run_stats().slow_runs == 1 and (9,) not in graph.dispatch_table
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        graph.dispatch_policy = "fastest"


def test_memory_report(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    report = graph.memory_report(batch=64)
    cpu = report[0]
    assert cpu.kind == "cpu" and cpu.lower_bound_bytes <= cpu.planned_bytes <= cpu.no_reuse_bytes
    assert cpu.planned_bytes >= 64 * 128 * 4  # the hidden activation lives in the workspace
    assert "lower bound" in str(report)
    with pytest.raises(engine.InputError, match="needs exactly the symbols"):
        graph.memory_report(seq=3)


def test_cli_devices_and_demo(tmp_path):
    env_run = lambda *args: subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True,  # noqa: E731
                                           text=True, timeout=300)
    devices = env_run("devices")
    assert devices.returncode == 0, devices.stderr
    assert any(line.split()[:2] == ["cpu", "yes"] for line in devices.stdout.splitlines())
    demo = env_run("demo", "--keep", str(tmp_path))
    assert demo.returncode == 0, demo.stderr
    assert "demo passed" in demo.stdout and "batch=64" in demo.stdout
    assert (tmp_path / "mlp.cgb").is_file()
    bad = env_run("frobnicate")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_tune_ahead_of_time_then_no_slow_path(mlp_bundle, fresh_registry, tmp_path):
    registry = fresh_registry
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    progress = []
    rows = graph.tune(batch=[1, 2, 4, 8], progress=lambda done, total, sym: progress.append((done, total, sym)))
    assert set(rows) == {(1,), (2,), (4,), (8,)} and progress[-1] == (4, 4, {"batch": 8})
    assert graph.run_stats().slow_runs == 4
    graph.save(tmp_path / "tuned.cgb", save_dispatch_table=True)
    loaded = engine.load_compiled_graph(tmp_path / "tuned.cgb", registry=registry)
    loaded.dispatch_policy = "error"  # production setting: any untuned key would raise
    for batch in (1, 2, 4, 8):
        loaded.run_async([np.ones((batch, 64), np.float32)])
    assert loaded.run_stats().slow_runs == 0 and loaded.run_stats().prepared_runs == 4
    with pytest.raises(engine.InputError, match="needs values for exactly the symbols"):
        graph.tune(seq=[1])


def test_example_script_runs(tmp_path):
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "mlp_classifier.py"
    env = {**__import__("os").environ, "ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "predicted classes:" in proc.stdout and (tmp_path / "mlp-tuned.cgb").is_file()
    assert "slow_runs=0" in proc.stdout
