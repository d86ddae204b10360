"""The demo model end to end on each device kind: fresh processes, save/load, set_weights, pickling,
tuning then the fast path, capture/replay, threads on their own streams, torch tensors, faults.

The model is ``engine.demo.mlp.build_mlp(device=kind)``: the CPU plugin's C kernels on ``cpu``, the
CUDA plugin's reference kernels (CUDA C compiled by NVRTC) on ``cuda``, the HIP plugin's (HIP C
compiled by hiprtc) on ``hip``. Inputs live on the graph's
device (``engine.asarray``), outputs are read back with ``.numpy()`` and compared with numpy's
float64 model (``reference_mlp``) within float32 accumulation error.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

BATCHES = (1, 3, 64)
TOL = {"rtol": 1e-4, "atol": 1e-6}  # float32 sums in another order than numpy's float64 model


def _fresh_process(script: str, *args: str, cache_dir: Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ENGINE_CACHE_DIR": str(cache_dir), **extra_env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _weights_list(w: dict) -> list[np.ndarray]:
    return [w["w1"], w["b1"], w["w2"], w["b2"]]


@pytest.fixture
def fresh_registry(tmp_path):
    """A registry with its own cache: no dispatch rows tuned by other tests."""
    from support import make_registry

    return make_registry(tmp_path / "cache")


@pytest.fixture
def mlp_path(tmp_path, kind, registry) -> Path:
    path = tmp_path / f"mlp-{kind}.cgb"
    build_mlp(registry=registry, device=kind).save(path)
    return path


def test_saved_bundle_runs_in_a_fresh_process_at_each_batch(tmp_path, kind, registry):
    weights = mlp_weights(seed=3)
    path = tmp_path / "mlp.cgb"
    build_mlp(weights=weights, registry=registry, device=kind).save(path)
    rng = np.random.default_rng(0)
    inputs = {f"x{b}": rng.standard_normal((b, 64)).astype(np.float32) for b in BATCHES}
    np.savez(tmp_path / "inputs.npz", **inputs)
    proc = _fresh_process("""
        import sys, numpy as np, engine
        kind = sys.argv[4]
        graph = engine.load_compiled_graph(sys.argv[1], device=kind)
        xs = np.load(sys.argv[2])
        put = (lambda a: a) if kind == "cpu" else (lambda a: engine.asarray(a, device=kind))
        out = {k: graph.run_async([put(xs[k])])[0].numpy() for k in xs.files}
        np.savez(sys.argv[3], **out)
        print(graph.devices[kind])
    """, str(path), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz"), kind,
        cache_dir=tmp_path / "child-cache")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(engine.Device(kind, 0))
    outputs = np.load(tmp_path / "outputs.npz")
    for b in BATCHES:
        got = outputs[f"x{b}"]
        assert got.shape == (b, 10)
        np.testing.assert_allclose(got, reference_mlp(inputs[f"x{b}"], weights), **TOL)


def test_save_load_round_trip_keeps_results_and_identity(tmp_path, kind, mlp_path, registry, on_device):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    (first,) = graph.run_async([on_device(x)])
    assert first.device == engine.Device(kind, 0)
    again_path = tmp_path / "again.cgb"
    graph.save(again_path, save_dispatch_table=True)
    again = engine.load_compiled_graph(again_path, device=kind, registry=registry)
    assert again.identity == graph.identity
    (second,) = again.run_async([on_device(x)])
    np.testing.assert_array_equal(second.numpy(), first.numpy())
    np.testing.assert_allclose(first.numpy(), reference_mlp(x, mlp_weights()), **TOL)
    assert again.run_stats().slow_runs == 0  # the saved dispatch row was used, not re-tuned


def test_outputs_are_fresh_per_run(kind, mlp_path, registry, on_device):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    outs = [graph.run_async([on_device(x * s)])[0] for s in (1, 2, 3)]
    assert len({o.addr for o in outs}) == 3  # three live outputs, three buffers
    for s, out in zip((1, 2, 3), outs):
        np.testing.assert_allclose(out.numpy(), reference_mlp(x * s, mlp_weights()), **TOL)


@pytest.mark.parametrize("weights_on", ["host", "device"])
def test_set_weights_changes_prepared_runs(kind, mlp_path, registry, on_device, weights_on):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    for _ in range(3):  # tuned, prepared, fast path: all bound to the old weights
        graph.run_async([on_device(x)])
    w = mlp_weights(seed=11)
    new = _weights_list(w) if weights_on == "host" else [on_device(a) for a in _weights_list(w)]
    graph.set_weights(new)
    np.testing.assert_allclose(graph.run_async([on_device(x)])[0].numpy(), reference_mlp(x, w), **TOL)


def test_save_without_weights_then_set_weights(tmp_path, kind, registry, on_device):
    w = mlp_weights(seed=5)
    graph = build_mlp(weights=w, registry=registry, device=kind).build(device=kind)
    path = tmp_path / "noweights.cgb"
    graph.save(path, save_weights=False)
    bare = engine.load_compiled_graph(path, device=kind, registry=registry)
    assert bare.weights is None
    x = np.ones((2, 64), np.float32)
    with pytest.raises(engine.InputError, match="set_weights"):
        bare.run_async([on_device(x)])
    bare.set_weights(_weights_list(w))
    np.testing.assert_allclose(bare.run_async([on_device(x)])[0].numpy(), reference_mlp(x, w), **TOL)


def test_pickle_round_trip_into_another_process(tmp_path, kind, mlp_path, fresh_registry, on_device):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=fresh_registry)
    x = np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32)
    (expected,) = graph.run_async([on_device(x)])  # tunes batch=6: the pickle carries the row
    (tmp_path / "graph.pkl").write_bytes(pickle.dumps(graph))
    np.save(tmp_path / "x.npy", x)
    proc = _fresh_process("""
        import pickle, sys, json, numpy as np, engine
        kind = sys.argv[4]
        graph = pickle.loads(open(sys.argv[1], "rb").read())
        x = np.load(sys.argv[2])
        out = graph.run_async([x if kind == "cpu" else engine.asarray(x, device=kind)])[0].numpy()
        np.save(sys.argv[3], out)
        print(json.dumps({"slow": graph.run_stats().slow_runs, "keys": len(graph.dispatch_table),
                          "device": str(graph.devices[kind])}))
    """, str(tmp_path / "graph.pkl"), str(tmp_path / "x.npy"), str(tmp_path / "out.npy"), kind,
        cache_dir=tmp_path / "child-cache")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected.numpy())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"slow": 0, "keys": 1,
                                                                 "device": str(engine.Device(kind, 0))}


def test_tuning_then_fast_path(kind, mlp_path, fresh_registry, on_device):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=fresh_registry)
    assert len(graph.dispatch_table) == 0
    x = on_device(np.ones((7, 64), np.float32))
    graph.run_async([x])
    assert (graph.run_stats().slow_runs, graph.run_stats().fast_runs) == (1, 0)
    choice = graph.dispatch_table[(7,)]
    timings = graph.tuning_results()[(7,)]
    tuned = {i for i, t in enumerate(graph.compiled_tasks) if len(t.candidates) > 1}
    assert tuned and {t.task for t in timings} == tuned  # both matmuls have two candidates
    for t in timings:
        assert len(t.medians_ms) == 2 and all(m > 0 for m in t.medians_ms)
        assert t.chosen == choice[t.task]
    for _ in range(5):
        (out,) = graph.run_async([x])
    stats = graph.run_stats()
    assert (stats.slow_runs, stats.prepared_runs, stats.fast_runs) == (1, 1, 4)
    assert graph.dispatch_table[(7,)] == choice
    np.testing.assert_allclose(out.numpy(), reference_mlp(np.ones((7, 64), np.float32), mlp_weights()), **TOL)


def test_capture_replay_equals_eager_and_sees_new_weights(kind, mlp_path, registry, on_device):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    rng = np.random.default_rng(5)
    x, x2 = (rng.standard_normal((4, 64)).astype(np.float32) for _ in range(2))
    (eager,) = graph.run_async([on_device(x)])  # tunes batch=4 first: capture uses the same choices
    with graph.capture(on_device(x)) as captured:
        assert captured.key == (4,)
        (out,) = captured.outputs
        captured.replay()  # the static outputs hold a result once a replay ran (a CUDA graph's capture runs nothing)
        np.testing.assert_allclose(out.numpy(), eager.numpy(), rtol=1e-6, atol=0)
        result = captured(on_device(x2))  # copies the new input into the static buffer, replays
        assert result is out
        (eager2,) = graph.run_async([on_device(x2)])
        np.testing.assert_allclose(out.numpy(), eager2.numpy(), rtol=1e-6, atol=0)
        if kind != "cpu":
            assert captured.method == f"{kind} capture"
    with pytest.raises(engine.InputError, match="closed"):
        captured.replay()
    if kind == "cuda":
        with graph.cuda_graph(on_device(x)) as cuda_graph:  # the reference runtime's name
            np.testing.assert_allclose(cuda_graph(on_device(x)).numpy(), eager.numpy(), rtol=1e-6, atol=0)


def test_replay_after_set_weights_sees_the_new_weights(kind, mlp_path, registry, on_device):
    """The first set_weights moves the weights out of a read-only mapped bundle (the capture
    prepares again); later ones write into the same buffers (the recorded launches see them)."""
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    x = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32)
    with graph.capture(on_device(x)) as captured:
        for seed in (8, 9, 10):
            w = mlp_weights(seed=seed)
            graph.set_weights(_weights_list(w))
            captured.replay()
            np.testing.assert_allclose(captured.outputs[0].numpy(), reference_mlp(x, w), **TOL)
            (eager,) = graph.run_async([on_device(x)])
            np.testing.assert_allclose(eager.numpy(), reference_mlp(x, w), **TOL)


def test_eight_threads_each_on_their_own_stream(kind, mlp_path, registry, backend):
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    w = mlp_weights()
    streams: dict[int, object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            rng = np.random.default_rng(100 + i)
            streams[i] = backend.current_stream(0)
            barrier.wait()
            for r in range(20):
                x = rng.standard_normal((1 + (i + r) % 9, 64)).astype(np.float32)
                xin = x if kind == "cpu" else engine.asarray(x, device=kind, registry=registry)
                (out,) = graph.run_async([xin])
                np.testing.assert_allclose(out.numpy(), reference_mlp(x, w), **TOL)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]
    if backend.has_streams:
        assert len(set(streams.values())) == 8  # one stream per thread, none shared
        assert backend.current_stream(0) not in set(streams.values())


def test_torch_tensors_in_and_out_without_copies(kind, mlp_path, registry):
    torch = pytest.importorskip("torch")
    if kind != "cpu" and not (torch.cuda.is_available() and (torch.version.hip is not None) == (kind == "hip")):
        pytest.skip(f"torch {torch.__version__} has no {kind.upper()} device here")
    graph = engine.load_compiled_graph(mlp_path, device=kind, registry=registry)
    dev = "cpu" if kind == "cpu" else "cuda:0"  # torch's ROCm build calls its HIP devices "cuda" too
    x = torch.randn(8, 64, device=dev, dtype=torch.float32)
    if kind != "cpu":  # work on torch's current stream must be honoured (no implicit device sync)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
        with torch.cuda.stream(stream):
            x = x * 2
            (out,) = graph.run_async([x])
            out_t = torch.from_dlpack(out)
            y = out_t.sum(dim=1)
        stream.synchronize()
    else:
        (out,) = graph.run_async([x])
        out_t = torch.from_dlpack(out)
        y = out_t.sum(dim=1)
    assert out_t.device.type == ("cpu" if kind == "cpu" else "cuda")
    assert out_t.data_ptr() == out.addr  # the engine's buffer itself, not a copy
    np.testing.assert_allclose(out_t.cpu().numpy(), reference_mlp(x.cpu().numpy(), mlp_weights()), **TOL)
    np.testing.assert_allclose(y.cpu().numpy(), np.ones(8), rtol=1e-5)


FAULT_SCRIPT = """
    import sys, numpy as np, engine
    from engine.build import GraphBuilder
    kind = sys.argv[1]
    b = GraphBuilder("faulty")
    x = b.input("x", "float32", ["n"], device=kind)
    if kind != "cpu":
        import importlib
        ref = importlib.import_module(f"engine_{kind}.reference").fault_kernel()
        k = b.kernel("fault", device=kind, entries=list(ref.entries), source=ref.source, language=ref.language,
                     launch=ref.launch)
    else:
        from engine.testing.c_abi import FAIL_CODE_SOURCE
        k = b.kernel("fault", device=kind, entries=["ref_fail_code"], source=FAIL_CODE_SOURCE)
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(y)
    graph = b.build(device=kind)
    xin = np.ones(1024, np.float32)
    try:
        (out,) = graph.run_async([xin if kind == "cpu" else engine.asarray(xin, device=kind)])
        out.numpy()
    except engine.KernelError as exc:
        print("KernelError:", exc)
        sys.exit(0)
    print("no error")
    sys.exit(1)
"""


FAULT_STATUS = {"cuda": "CUDA_ERROR_ILLEGAL_ADDRESS", "hip": "hipErrorIllegalAddress"}


def test_kernel_fault_is_a_kernel_error(tmp_path, kind):
    # A device fault leaves a CUDA context unusable (a sticky error), so it happens in its own process.
    proc = _fresh_process(FAULT_SCRIPT, kind, cache_dir=tmp_path / "cache")
    if kind == "hip" and proc.returncode < 0:
        # ROCm's HSA runtime usually aborts the process on a GPU memory fault before HIP can report
        # it (docs/hip.md §6): the one outcome besides a KernelError that is accepted, and it must say so.
        assert "Memory access fault" in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("KernelError: ") and len(line) > len("KernelError: ")
    if kind == "cpu":
        assert "kernel 'fault'" in line and "error code 7" in line
        return
    status = FAULT_STATUS[kind]
    assert status in line, line
    # The plugin's debug mode checks every launch, so the error names the kernel that faulted.
    proc = _fresh_process(FAULT_SCRIPT, kind, cache_dir=tmp_path / "cache", **{f"ENGINE_{kind.upper()}_SYNC": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert f"kernel 'fault' candidate 0 (entry 'fault') on {kind}:0" in line and status in line


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_kind", ["cuda", "hip"])
def test_host_arrays_in_and_out_of_a_model_on_the_gpu(registry, gpu_kind):
    """``build_mlp(device=gpu_kind, io_device="cpu")``: numpy in, numpy out, the kernels on the GPU,
    builtin copies between the kinds at both ends."""
    w = mlp_weights(seed=9)
    graph = build_mlp(weights=w, registry=registry, device=gpu_kind, io_device="cpu").build()
    assert set(graph.devices) == {"cpu", gpu_kind}
    for batch in BATCHES:
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        (probs,) = graph.run_async([x])
        assert probs.device == engine.Device("cpu", 0)
        np.testing.assert_allclose(probs.numpy(), reference_mlp(x, w), **TOL)


def test_engine_demo_on_the_device(tmp_path, kind):
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "demo", "--device", kind, "--keep", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("demo passed")
    assert f"on {engine.Device(kind, 0)}" in proc.stdout.splitlines()[0]
    assert (tmp_path / "mlp.cgb").is_file()
