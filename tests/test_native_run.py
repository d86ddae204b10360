"""The native run path (``engine.runtime.native``, issue 16) against the Python path it replaces.

Two registries differ only in ``Settings.native_run``; the same bundle loaded on each must give the
same outputs and the same errors (type and message) for every bad input, while the native one
really runs natively (its lane holds a ``NativeLane``, its prepared runs a ``KeyRun`` that counts
its runs). The output pool hands a buffer out again only when the caller has let go of it in every
form; memory stays flat when outputs are dropped (measured in a subprocess from /proc/self/statm).
A subprocess runs a representative part of the suite's run-path tests with ``ENGINE_NATIVE_RUN=0``.

``./scripts/test`` sets ENGINE_REQUIRE_NATIVE=1: there the extension must have been built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.runtime import native
from engine.settings import Settings

from support import run_in_threads

REPO = Path(__file__).resolve().parents[1]

if native.unavailable() is not None:
    if os.environ.get("ENGINE_REQUIRE_NATIVE") == "1":
        raise RuntimeError(f"the native run path is unavailable (ENGINE_REQUIRE_NATIVE=1): {native.unavailable()}")
    pytestmark = pytest.mark.skip(reason=f"the native run path is unavailable: {native.unavailable()}")

SOURCE = r"""
#include <stdint.h>
/* z = x + y over n rows of 4 */
int32_t add(void *const *t, const int64_t *s, void *ws) {
    const float *x = t[0], *y = t[1]; float *z = t[2];
    for (int64_t i = 0; i < s[0] * 4; i++) z[i] = x[i] + y[i];
    return 0;
}
/* w = 2 z + 1, staged through the workspace; fails with code 42 when z[0] is negative */
int32_t twice(void *const *t, const int64_t *s, void *ws) {
    const float *z = t[0]; float *w = t[1], *tmp = ws;
    if (s[0] > 0 && z[0] < 0) return 42;
    for (int64_t i = 0; i < s[0] * 4; i++) tmp[i] = 2 * z[i];
    for (int64_t i = 0; i < s[0] * 4; i++) w[i] = tmp[i] + 1;
    return 0;
}
"""


def build(registry: Registry):
    b = GraphBuilder("native_pair", registry=registry)
    x = b.input("x", "float32", ["n", 4])
    y = b.input("y", "float32", ["n", 4])
    add = b.kernel("add", entries=["add"], source=SOURCE)
    twice = b.kernel("twice", entries=["twice"], source=SOURCE)
    (z,) = b.call(add, [x, y], [("float32", ["n", 4])], symbols=["n"])
    (w,) = b.call(twice, [z], [("float32", ["n", 4])], symbols=["n"], workspace="n * 16")
    b.output(z, "z")
    b.output(w, "w")
    return b


def expected(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = x + y
    return z, 2 * z + 1


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, registry) -> Path:
    path = tmp_path_factory.mktemp("native") / "pair.cgb"
    build(registry).save(path)
    return path


def registry_with(session_cache: Path, native_run: bool) -> Registry:
    registry = Registry(Settings(cache_dir=session_cache, native_run=native_run))
    registry.load_entry_points()
    return registry


@pytest.fixture(scope="module")
def registries(session_cache):
    return registry_with(session_cache, True), registry_with(session_cache, False)


@pytest.fixture()
def graphs(bundle, registries):
    """The same bundle on the native path and on the Python path, both prepared at n=8, 2 and 3 (the
    workspace sized for n=8 first, so that the smaller keys keep their prepared runs)."""
    on = engine.load_compiled_graph(bundle, registry=registries[0])
    off = engine.load_compiled_graph(bundle, registry=registries[1])
    for graph in (on, off):
        for n in (8, 2, 3):
            graph.run_async(inputs(n))
    assert on.runtime.native_run and not off.runtime.native_run
    assert on.runtime.lane().native.keys() == 3 and off.runtime.lane().native is None
    return on, off


def inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Non-negative, so that the kernel that fails on a negative z[0] does not.
    return [rng.random((n, 4), np.float32) + 1, rng.random((n, 4), np.float32)]


def native_runs(graph, n: int) -> int:
    """Runs made by the KeyRun of the calling thread's prepared run at n (public attributes only)."""
    return graph.runtime.lane().runs[(n,)].native.runs


def test_switch_is_read_into_settings() -> None:
    assert Settings.from_env({}).native_run is True
    assert Settings.from_env({"ENGINE_NATIVE_RUN": "0"}).native_run is False
    assert Settings.from_env({"ENGINE_NATIVE_RUN": "1"}).native_run is True


def test_both_paths_give_identical_outputs(graphs, registries) -> None:
    on, off = graphs
    before = native_runs(on, 3)
    for n, seed in [(3, 1), (2, 2), (3, 3), (7, 4), (7, 5), (0, 6), (1, 7)]:
        args = inputs(n, seed)
        a = on.run_async(args)
        b = off.run_async(args)
        assert [t.shape for t in a] == [t.shape for t in b] == [(n, 4), (n, 4)]
        want = expected(*args)
        for got_on, got_off, w in zip(a, b, want):
            np.testing.assert_array_equal(got_on.numpy(), got_off.numpy())
            np.testing.assert_allclose(got_on.numpy(), w, rtol=1e-6)
        # engine Tensors as inputs: bound in Python, then the same native launches
        t_args = [engine.asarray(x, registry=registries[0]) for x in args]
        for got, w in zip(on.run_async(t_args), want):
            np.testing.assert_allclose(got.numpy(), w, rtol=1e-6)
    assert native_runs(on, 3) == before + 4  # two runs at n=3, each with arrays and with Tensors
    stats = on.run_stats()
    assert stats.fast_runs >= 8


def test_outputs_into_caller_buffers_on_both_paths(graphs) -> None:
    on, off = graphs
    before = native_runs(on, 3)
    for graph in (on, off):
        for seed in range(3):
            args = inputs(3, seed)
            outs = [np.empty((3, 4), np.float32), np.empty((3, 4), np.float32)]
            result = graph.run_async(args, outputs=outs)
            for out, got, w in zip(outs, result, expected(*args)):
                np.testing.assert_allclose(out, w, rtol=1e-6)
                assert got.numpy().ctypes.data == out.ctypes.data  # the result views the caller's buffer
            again = graph.run_async(inputs(3, 9), outputs=outs)  # the same buffers once more
            np.testing.assert_allclose(outs[0], expected(*inputs(3, 9))[0], rtol=1e-6)
            assert again[1].numpy().ctypes.data == outs[1].ctypes.data
    assert native_runs(on, 3) == before + 6  # into the caller's buffers natively too


def _error(graph, args, **kwargs) -> tuple[type, str]:
    with pytest.raises(engine.EngineError) as info:
        graph.run_async(args, **kwargs)
    return type(info.value), str(info.value)


def bad_cases(registry2) -> list[tuple[str, list, dict]]:
    good = inputs(3)
    on_other = engine.asarray(np.zeros((3, 4), np.float32), device="hostdev", registry=registry2)
    ro = np.empty((3, 4), np.float32)
    ro.flags.writeable = False
    ok_out = np.empty((3, 4), np.float32)
    return [
        ("count", good[:1], {}),
        ("too many", good + good[:1], {}),
        ("shape", [good[0], np.zeros((3, 5), np.float32)], {}),
        ("rank", [np.zeros(12, np.float32), good[1]], {}),
        ("dtype", [good[0], good[1].astype(np.float64)], {}),
        ("byte order", [good[0], good[1].astype(">f4")], {}),
        ("device", [on_other, good[1]], {}),
        ("inconsistent symbols", [good[0], np.zeros((2, 4), np.float32)], {}),
        ("non-contiguous", [np.zeros((4, 3), np.float32).T, good[1]], {}),
        ("foreign object", [[[0.0] * 4] * 3, good[1]], {}),
        ("outputs count", good, {"outputs": [ok_out]}),
        ("outputs shape", good, {"outputs": [ok_out, np.empty((2, 4), np.float32)]}),
        ("outputs dtype", good, {"outputs": [ok_out, np.empty((3, 4), np.float64)]}),
        ("outputs non-contiguous", good, {"outputs": [ok_out, np.empty((4, 3), np.float32).T]}),
        ("outputs read-only", good, {"outputs": [ok_out, ro]}),
        ("outputs foreign", good, {"outputs": [ok_out, "buffer"]}),
    ]


def test_both_paths_give_identical_errors_for_bad_inputs(graphs, registry2) -> None:
    on, off = graphs
    for name, args, kwargs in bad_cases(registry2):
        got_on = _error(on, args, **kwargs)
        got_off = _error(off, args, **kwargs)
        assert got_on == got_off, name
        assert got_on[0] is engine.InputError, name
    # still good afterwards, and still native
    before = native_runs(on, 3)
    np.testing.assert_allclose(on.run_async(inputs(3))[1].numpy(), expected(*inputs(3))[1], rtol=1e-6)
    assert native_runs(on, 3) == before + 1


def test_both_paths_give_identical_kernel_errors(graphs) -> None:
    on, off = graphs
    x, y = inputs(3)
    bad = [x - 100, y]
    for _ in range(2):  # a failing kernel leaves the prepared run usable
        assert _error(on, bad) == _error(off, bad)
        kind, message = _error(on, bad)
        assert kind is engine.KernelError and "code 42" in message
    np.testing.assert_allclose(on.run_async([x, y])[0].numpy(), x + y, rtol=1e-6)


def test_kept_outputs_are_distinct_live_objects(graphs) -> None:
    on, _ = graphs
    kept = [on.run_async(inputs(2, seed)) for seed in range(1000)]
    assert len({id(out) for result in kept for out in result}) == 2000
    assert len({out.numpy().ctypes.data for result in kept for out in result}) == 2000
    for seed, (z, w) in enumerate(kept):
        want = expected(*inputs(2, seed))
        np.testing.assert_allclose(z.numpy(), want[0], rtol=1e-6)
        np.testing.assert_allclose(w.numpy(), want[1], rtol=1e-6)


def test_a_buffer_the_caller_holds_in_any_form_is_not_reused(graphs) -> None:
    on, _ = graphs
    probe = inputs(3, 11)
    # Each form of holding an output, and how to read its bytes through what is held.
    forms = {
        "numpy view": (lambda t: t.numpy(), lambda kept: kept),
        "numpy view of a slice": (lambda t: t.numpy()[1:], lambda kept: kept),
        "DLPack consumer": (lambda t: np.from_dlpack(t), lambda kept: kept),
        "storage": (lambda t: t.storage, lambda kept: np.frombuffer(kept.host_view, np.uint8)),
        "memoryview": (lambda t: t.storage.host_view, lambda kept: np.frombuffer(kept, np.uint8)),
        "owner": (lambda t: t.storage.owner, lambda kept: kept),
    }
    for name, (hold, read) in forms.items():
        kept = hold(on.run_async(probe)[0])
        snapshot = np.array(read(kept), copy=True)
        for seed in range(3):  # other runs, their outputs dropped at once
            on.run_async(inputs(3, seed))
        np.testing.assert_array_equal(read(kept), snapshot, err_msg=name)
        del kept
    # once every hold is gone, the pool hands one tensor out again and again
    ids = {id(on.run_async(probe)[0]) for _ in range(5)}
    assert len(ids) == 1
    # a weak reference is a hold too: the pooled tensor is not revived under it
    ref = weakref.ref(on.run_async(probe)[0])
    assert ref() is not None and ref() is not on.run_async(inputs(3, 1))[0]


def test_dropped_outputs_are_reused_and_memory_stays_flat(tmp_path, bundle, session_cache) -> None:
    script = textwrap.dedent(f"""
        import os, numpy as np, engine
        from engine.plugins import Registry
        from engine.settings import Settings
        page = os.sysconf("SC_PAGE_SIZE")
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page
        registry = Registry(Settings(cache_dir={str(session_cache)!r}))
        registry.load_entry_points()
        graph = engine.load_compiled_graph({str(bundle)!r}, registry=registry)
        x = np.ones((4096, 4), np.float32)  # two 64 KiB outputs per run: 1.25 GiB over 10,000 runs if kept
        for _ in range(200):
            graph.run_async([x, x])
        ids = set()
        start = rss()
        for _ in range(10_000):
            out = graph.run_async([x, x])
            ids.add(id(out[0]))
            del out
        grown = rss() - start
        out = graph.run_async([x, x])
        assert float(out[1].numpy()[-1, -1]) == 5.0
        print(grown, len(ids), graph.runtime.native_run)
    """)
    for switch in ("1", "0"):
        env = {**os.environ, "ENGINE_NATIVE_RUN": switch}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        grown, distinct, native_run = proc.stdout.split()
        assert int(grown) < 4 * 1024 * 1024, f"ENGINE_NATIVE_RUN={switch}: RSS grew {int(grown)} bytes"
        assert native_run == ("True" if switch == "1" else "False")
        if switch == "1":
            assert distinct == "1"  # one pooled output, handed out again every run


def test_threads_on_one_graph_give_correct_results(graphs) -> None:
    on, _ = graphs
    failures: list[str] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        for r in range(200):
            n = 1 + (i + r) % 4
            args = inputs(n, 100 * i + r)
            z, w = on.run_async(args)
            want = expected(*args)
            if not (np.allclose(z.numpy(), want[0], rtol=1e-6) and np.allclose(w.numpy(), want[1], rtol=1e-6)):
                with lock:
                    failures.append(f"thread {i} run {r}")

    run_in_threads(work, 4)
    assert failures == []
    assert on.run_stats().fast_runs >= 4 * 150


def test_workspace_growth_and_new_weights_rebuild_the_native_runs(graphs) -> None:
    on, _ = graphs
    for n in (2, 50, 2, 3, 200, 3):  # larger keys grow the lane's workspace: old native runs are dropped
        args = inputs(n, n)
        np.testing.assert_allclose(on.run_async(args)[1].numpy(), expected(*args)[1], rtol=1e-6)
        np.testing.assert_allclose(on.run_async(args)[1].numpy(), expected(*args)[1], rtol=1e-6)
    calls = []
    on.register_hook(lambda i, ins, outs: calls.append(i))  # hooks run interpreted, never natively
    on.run_async(inputs(3))
    assert calls == [0, 1]


def test_capture_replays_natively(graphs) -> None:
    on, off = graphs
    for graph in (on, off):
        args = inputs(3, 5)
        with graph.capture(*args) as captured:
            captured.replay()
            np.testing.assert_allclose(captured.outputs[1].numpy(), expected(*args)[1], rtol=1e-6)
            new = inputs(3, 6)
            for static, value in zip(captured.inputs, new):
                static.numpy()[...] = value
            captured.replay()
            np.testing.assert_allclose(captured.outputs[0].numpy(), expected(*new)[0], rtol=1e-6)
            with pytest.raises(engine.InputError, match="bound to the streams it was captured on"):
                captured.replay(stream=object())
            results = captured(*inputs(3, 7))
            np.testing.assert_allclose(results[1].numpy(), expected(*inputs(3, 7))[1], rtol=1e-6)


def test_run_path_tests_pass_with_the_switch_off(session_cache) -> None:
    """A representative part of the suite's run-path tests, in a subprocess with ENGINE_NATIVE_RUN=0."""
    env = {**os.environ, "ENGINE_NATIVE_RUN": "0", "ENGINE_CACHE_DIR": str(session_cache / "switch-off")}
    tests = ["tests/test_graph_errors.py", "tests/test_capture.py", "tests/test_concurrency.py",
             "tests/test_graph_end_to_end.py", "tests/test_out_of_memory.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    check = subprocess.run([sys.executable, "-c", "from engine.settings import Settings; "
                            "print(Settings().native_run)"], env=env, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "False"


def test_without_the_extension_the_python_path_runs(bundle, session_cache) -> None:
    """An install without a C compiler has no ``_fastrun``: the same graph runs on the Python path."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["engine.runtime._fastrun"] = None  # what an install without the extension sees
        import numpy as np, engine
        from engine.plugins import Registry
        from engine.runtime import native
        from engine.settings import Settings
        registry = Registry(Settings(cache_dir={str(session_cache)!r}))
        registry.load_entry_points()
        graph = engine.load_compiled_graph({str(bundle)!r}, registry=registry)
        x = np.ones((2, 4), np.float32)
        for _ in range(3):
            z, w = graph.run_async([x, x])
        assert float(w.numpy()[1, 3]) == 5.0 and graph.run_stats().fast_runs == 2
        print(graph.runtime.native_run, graph.runtime.lane().native, native.unavailable())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("False None engine.runtime._fastrun was not built")


def test_a_graph_beyond_the_extensions_limits_keeps_the_python_path(registries) -> None:
    """More outputs than the extension takes (``native.MAX_COUNT``): the plan keeps the Python path."""
    b = GraphBuilder("many_outputs", registry=registries[0])
    x = b.input("x", "float32", ["n", 4])
    y = b.input("y", "float32", ["n", 4])
    add = b.kernel("add", entries=["add"], source=SOURCE)
    for k in range(native.MAX_COUNT + 1):
        (z,) = b.call(add, [x, y], [("float32", ["n", 4])], symbols=["n"])
        b.output(z, f"z{k}")
    graph = b.build()
    args = inputs(2)
    for _ in range(3):
        result = graph.run_async(args)
    assert len(result) == native.MAX_COUNT + 1
    for z in result:
        np.testing.assert_allclose(z.numpy(), args[0] + args[1], rtol=1e-6)
    assert graph.runtime.native_run and graph.runtime.lane().native is None
    assert graph.runtime.lane().runs[(2,)].native is None and graph.run_stats().fast_runs == 2
