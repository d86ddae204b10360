"""engine on Ray (issue 15): batch inference with Ray Data, serving with Ray Serve, one copy per node.

Every test runs on a local Ray cluster started here (``ray.init(num_cpus=2)``, no dashboard, no
external services) with the real CPU plugin: real actors, real worker processes, a real HTTP proxy
on the loopback address. Memory is measured from ``/proc/<pid>/smaps_rollup`` (PSS) of real
processes; latencies are printed, never asserted.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray integration needs ray[data,serve] (pip install engine[ray])")

import engine  # noqa: E402
import engine.ray  # noqa: E402
from engine.build import GraphBuilder  # noqa: E402
from engine.demo.mlp import build_mlp  # noqa: E402
from engine.ray import ColumnError, GraphPredictor, choose_placement, put_bundle  # noqa: E402

MiB = 1 << 20
ROWS = 10_000
D_IN = 64


# -- the cluster and the bundles ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(session_cache):
    """A 2-CPU local Ray cluster for this module; its workers share the session's kernel cache."""
    # Classes defined here (the probes, the dying predictor) travel to workers by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"ENGINE_CACHE_DIR": str(session_cache)}})
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def preserve_order(cluster):
    ctx = ray.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    yield
    ctx.execution_options.preserve_order = before


def rows(ids: np.ndarray) -> np.ndarray:
    """Row ``i``'s input is a function of ``i`` alone, so results can be checked per row id."""
    return np.sin(ids[:, None] * 0.37 + np.arange(D_IN)[None, :]).astype(np.float32)


def dataset(n: int = ROWS, block: int = 500):
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    tables = []
    for start in range(0, n, block):
        ids = np.arange(start, min(start + block, n))
        tables.append(pa.table({"id": ids, "x": ArrowTensorArray.from_numpy(rows(ids))}))
    return ray.data.from_arrow(tables)


@pytest.fixture(scope="module")
def expected(mlp_bundle, registry) -> np.ndarray:
    """The same graph run in this process, without Ray."""
    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        x = rows(np.arange(ROWS))
        return np.concatenate([graph.run_async([x[i:i + 1000]])[0].numpy().copy() for i in range(0, ROWS, 1000)])


# -- batch inference -----------------------------------------------------------------------------------
def test_batch_inference_matches_in_process(cluster, preserve_order, mlp_bundle, expected):
    ref = put_bundle(mlp_bundle)
    out = dataset().map_batches(GraphPredictor, fn_constructor_args=(ref,), fn_constructor_kwargs={"keep": ["id"]},
                                compute=ray.data.ActorPoolStrategy(size=2), batch_size=500,
                                batch_format="numpy").take_batch(ROWS + 1)
    assert len(out["id"]) == ROWS
    np.testing.assert_array_equal(out["id"], np.arange(ROWS))  # every row once, in order
    np.testing.assert_allclose(out["probs"], expected, rtol=1e-6, atol=0)


class DiesOnce(GraphPredictor):
    """A predictor whose process exits (``os._exit``) in the middle of the job, the first time only."""

    def __init__(self, bundle, marker: str, **kwargs):
        super().__init__(bundle, **kwargs)
        self.marker = marker

    def __call__(self, batch):
        if batch["id"][0] >= ROWS // 2 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return super().__call__(batch)


def test_actor_killed_mid_job_loses_no_rows(cluster, preserve_order, mlp_bundle, expected, tmp_path):
    marker = tmp_path / "died"
    ref = put_bundle(mlp_bundle)
    out = dataset().map_batches(DiesOnce, fn_constructor_args=(ref, str(marker)),
                                fn_constructor_kwargs={"keep": ["id"]},
                                compute=ray.data.ActorPoolStrategy(size=2), batch_size=500, batch_format="numpy",
                                # restart a dead actor and retry its batches (Ray Data's defaults for actor
                                # pools are unlimited; bounded here so that a real failure ends the job)
                                ray_remote_args_fn=lambda: {"max_restarts": 2, "max_task_retries": 2},
                                ).take_batch(ROWS + 1)
    assert marker.exists(), "no actor died: the test did not exercise a restart"
    assert len(out["id"]) == ROWS
    np.testing.assert_array_equal(out["id"], np.arange(ROWS))
    np.testing.assert_allclose(out["probs"], expected, rtol=1e-6, atol=0)


def test_bad_columns_are_one_line_errors(mlp_bundle):
    predictor = GraphPredictor(str(mlp_bundle))
    x = rows(np.arange(4))
    with pytest.raises(ColumnError, match=r"graph input 'x' reads column 'x', which the batch does not have "
                                          r"\(columns: features\)") as info:
        predictor({"features": x})
    assert (info.value.column, info.value.input) == ("x", "x")
    with pytest.raises(ColumnError, match=r"^column 'x' \(graph input 'x'\): expected dtype float32, got float64; "
                                          r"convert it before, or pass cast=True$"):
        predictor({"x": x.astype(np.float64)})
    cast = GraphPredictor(str(mlp_bundle), cast=True, inputs={"x": "features"}, outputs={"probs": "p"})
    np.testing.assert_allclose(cast({"features": x.astype(np.float64)})["p"], predictor({"x": x})["probs"])
    with pytest.raises(engine.InputError, match="inputs= names graph input 'y', which the graph does not have"):
        GraphPredictor(str(mlp_bundle), inputs={"y": "x"})
    with pytest.raises(engine.InputError, match="put_bundle: expected a bundle path"):
        put_bundle(42)


def test_a_graph_or_directory_bundle_goes_through_the_store_with_its_current_weights(cluster, mlp_bundle,
                                                                                       registry, tmp_path):
    x = rows(np.arange(8))
    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        graph.set_weights([np.asarray(w) * 0.5 for w in graph.weights])
        want = graph.run_async([x])[0].numpy().copy()
        graph.save(tmp_path / "dir", form="dir", save_dispatch_table=True)
        refs = [put_bundle(graph), put_bundle(tmp_path / "dir")]
    for ref in refs:
        with engine.ray.load_graph(ref, registry=registry) as loaded:
            np.testing.assert_allclose(loaded.run_async([x])[0].numpy(), want, rtol=1e-6)


def test_a_directory_bundle_is_stored_as_it_is_and_its_weights_checked_first(cluster, mlp_bundle, registry,
                                                                               tmp_path):
    from engine.bundle.archive import BundleArchive

    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        graph.save(tmp_path / "dir", form="dir")
    files = {str(f.relative_to(tmp_path / "dir")): f.read_bytes() for f in (tmp_path / "dir").rglob("*") if f.is_file()}
    stored = BundleArchive.open(memoryview(ray.get(put_bundle(tmp_path / "dir"))))
    with stored:
        # Member for member the directory's bytes (no dispatch rows or other state of this process added).
        assert {name: bytes(stored.map(name)) for name in stored.names()} == {
            name: data for name, data in files.items() if name != "manifest.json"}
    weights = tmp_path / "dir" / "weights.bin"
    flipped = bytearray(weights.read_bytes())
    flipped[100] ^= 1
    weights.write_bytes(bytes(flipped))
    with pytest.raises(engine.BundleError, match=r"^weights.bin: sha256 mismatch: the weights are corrupted or were "
                                                 r"modified$"):
        put_bundle(tmp_path / "dir")


def test_put_bundle_names_the_temporary_directory_it_cannot_write(cluster, mlp_bundle, registry, tmp_path,
                                                                  monkeypatch):
    import tempfile

    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_directory))  # what TMPDIR sets
    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        with pytest.raises(engine.SaveError, match=rf"^put_bundle: cannot write the zip form of the graph to a "
                                                   rf"temporary file in '{not_a_directory}': a component of the path "
                                                   rf"is not a directory \(.+\); set TMPDIR to a directory with "
                                                   rf"room for the bundle$") as info:
            put_bundle(graph)
    assert info.value.path == str(not_a_directory)


def test_placement_follows_ray_resources():
    cpu = choose_placement(None, [], None, ["cpu"])
    assert cpu.device is None and "no GPU" in cpu.reason
    assert choose_placement(None, ["3"], "3", ["cpu", "cuda"]).device == "cuda:0"
    assert choose_placement(None, ["3"], "1,3", ["cpu", "cuda"]).device == "cuda:1"
    assert choose_placement(None, [2], None, ["cpu", "cuda"]).device == "cuda:2"
    no_plugin = choose_placement(None, ["0"], "0", ["cpu", "opencl"])
    assert no_plugin.device is None and "no engine plugin provides 'cuda'" in no_plugin.reason
    assert choose_placement("cuda:1", [], None, ["cpu"]).device == "cuda:1"


# -- one copy of the weights per node ------------------------------------------------------------------
_LIBRARY = re.compile(r"\.so(\.[0-9.]+)?$")


def smaps(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps`` summed over its mappings, in bytes (Pss: shared pages divided among the
    processes mapping them), with two parts of the Pss apart: ``PssLibraries``, that of its
    shared-library mappings, and ``PssAnonymous``, that of mappings backed by no file (the heap).

    Libraries are what the weights' count leaves out: their Pss moves whenever any other process on
    the machine (another test worker, a compiler, a forked child) maps or drops the same library,
    which says nothing about copies of the weights. One read gives all three, so they agree."""
    out: dict[str, int] = {"PssLibraries": 0, "PssAnonymous": 0}
    kind = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and not parts[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            name = parts[5] if len(parts) >= 6 else ""
            kind = ("PssLibraries" if _LIBRARY.search(name) else
                    "PssAnonymous" if not name.startswith("/") else "")
        elif len(parts) == 3 and parts[2] == "kB":
            field, size = parts[0].rstrip(":"), int(parts[1]) * 1024
            out[field] = out.get(field, 0) + size
            if kind and field == "Pss":
                out[kind] += size
    return out


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``: pid -> command name."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        children.setdefault(int(rest.split()[1]), []).append((int(entry), name))
    found, todo = {}, [pid]
    while todo:
        for child, name in children.get(todo.pop(), []):
            found[child] = name
            todo.append(child)
    return found


@ray.remote(num_cpus=0)
class Probe:
    """An actor that loads a graph through the integration and runs it once (touching every weight)."""

    def __init__(self):
        self.predictor = None

    def pid(self) -> int:
        return os.getpid()

    def load(self, sources: list, column: str, rows: int) -> list:
        self.predictor = GraphPredictor(sources[0], dispatch_policy="first")  # sources: not resolved by Ray
        sig = self.predictor.graph.meta.inputs[0]
        x = np.ones((rows, *(e.constant for e in sig.shape[1:])), np.float32)
        (out,) = self.predictor({column: x}).values()
        return out.tolist()

    def drop(self) -> None:
        self.predictor.graph.close()
        self.predictor = None


@pytest.fixture
def probes(cluster):
    """Four fresh actors (fresh processes: an actor that mapped an earlier, freed object would see the
    store reuse its pages, and its RSS would not grow), the driver and the raylet."""
    actors = [Probe.remote() for _ in range(4)]
    pids = ray.get([a.pid.remote() for a in actors])
    raylet = [pid for pid, name in descendants(os.getpid()).items() if name == "raylet"]
    assert len(raylet) == 1, "the local raylet (which holds the object store) was not found"
    yield actors, [os.getpid(), *raylet, *pids], pids
    for actor in actors:
        ray.kill(actor)


def load_everywhere(probes, source, column: str, n: int) -> tuple[int, int, list[int], list[int], list]:
    """Load ``source`` in the 4 probes (a ``str`` by path, otherwise through the object store) and run it.

    Returns the growth of Σ PSS over {driver, raylet, the 4 actors}, shared libraries left out
    (``smaps``), and so is the driver's anonymous memory: the raylet and the driver map the object
    store, and pages the store reuses from an earlier, freed object do not grow it. The driver's
    heap is the second figure instead: the most ``put_bundle`` held allocated at once, counted by
    ``tracemalloc`` (what the C allocator keeps of freed memory depends on everything the long-lived
    test process did before, and so says nothing of this put). Then each actor's growth of RSS (it
    touched the weights) and of private memory (a copy would be private), in bytes, and the actors'
    results.
    """
    actors, fixed, pids = probes
    before = [smaps(p) for p in fixed]
    tracemalloc.start()
    try:
        ref = put_bundle(source) if not isinstance(source, str) else source
        gc.collect()  # whatever put_bundle left to the collector: the node's steady state is without it
        heap_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    results = ray.get([a.load.remote([ref], column, n) for a in actors])
    gc.collect()
    after = [smaps(p) for p in fixed]
    ray.get([a.drop.remote() for a in actors])
    counted = [a["Pss"] - a["PssLibraries"] - (a["PssAnonymous"] if i == 0 else 0) for i, a in enumerate(after)]
    counted_before = [b["Pss"] - b["PssLibraries"] - (b["PssAnonymous"] if i == 0 else 0)
                      for i, b in enumerate(before)]
    growth = [a - b for a, b in zip(counted, counted_before)]
    print(f"\nPss growth without libraries (the driver's: without its heap), MiB: driver {growth[0] / MiB:.1f}, "
          f"raylet {growth[1] / MiB:.1f}, actors {', '.join(f'{g / MiB:.1f}' for g in growth[2:])}; "
          f"the driver's anonymous Pss growth {(after[0]['PssAnonymous'] - before[0]['PssAnonymous']) / MiB:.1f} MiB, "
          f"put_bundle's heap peak {heap_peak / MiB:.1f} MiB")
    rss = [a["Rss"] - b["Rss"] for a, b in zip(after[2:], before[2:])]
    private = [(a["Private_Clean"] + a["Private_Dirty"]) - (b["Private_Clean"] + b["Private_Dirty"])
               for a, b in zip(after[2:], before[2:])]
    return sum(growth), heap_peak, rss, private, results


def check_one_copy(what: str, total: int, heap_peak: int, rss: list[int], private: list[int], nbytes: int) -> None:
    print(f"\n{what}: node PSS growth {total / MiB:.1f} MiB ({total / nbytes:.2f} copies); actors' RSS growth "
          f"{', '.join(f'{r / MiB:.1f}' for r in rss)} MiB, private growth "
          f"{', '.join(f'{p / MiB:.1f}' for p in private)} MiB")
    assert all(r > 0.9 * nbytes for r in rss), f"an actor did not map the weights: RSS growth {rss}"
    assert all(p < nbytes / 4 for p in private), f"an actor holds a private copy: private growth {private}"
    # Reading a bundle streams through bounded chunks; a copy of the weights would be all of them.
    assert heap_peak < nbytes / 2, f"put_bundle held {heap_peak} bytes of the driver's heap at once"
    assert total < 2 * nbytes, f"node memory grew by {total / nbytes:.2f} copies of the weights"


@pytest.mark.slow
def test_four_actors_share_one_copy_of_256_mib(probes, tmp_path_factory, registry):
    path = tmp_path_factory.mktemp("big") / "big.cgb"
    build_mlp(d_in=8192, hidden=8192, classes=10, registry=registry).save(path)
    weights = 8192 * 8192 * 4
    with engine.load_compiled_graph(path, registry=registry, dispatch_policy="first") as graph:
        want = graph.run_async([np.ones((2, 8192), np.float32)])[0].numpy().tolist()
    total, heap_peak, rss, private, results = load_everywhere(probes, path, "x", 2)
    assert all(np.allclose(r, want, rtol=1e-5) for r in results)
    check_one_copy("256 MiB bundle, 4 actors", total, heap_peak, rss, private, weights)


BYTESUM = r"""
#include <stdint.h>
/* y[n] = x[n] + (sum of every byte of w) mod 65521: reads each weight byte once, whatever its dtype. */
int32_t bytesum(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; const uint8_t *w = t[1]; float *y = t[2]; int64_t n = sym[0];
    uint64_t s = 0;
    for (int64_t i = 0; i < NBYTES; i++) s += w[i];
    float add = (float)(s % 65521);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] + add;
    return 0;
}
"""


def bytesum_bundle(path: Path, dtype: engine.DType, nbytes: int, registry, form: str = "zip") -> float:
    """A graph with one weight of ``dtype`` (random bytes); returns the value it adds to x."""
    raw = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    if dtype.numpy == np.dtype(bool):
        raw &= 1
    w = raw.view(dtype.numpy).reshape(1024, -1)
    b = GraphBuilder("bytesum", registry=registry)
    x = b.input("x", "float32", ["n"])
    wv = b.weight("w", w)
    k = b.kernel("bytesum", entries=["bytesum"], source=f"#define NBYTES {nbytes}\n" + BYTESUM)
    (y,) = b.call(k, [x, wv], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    b.save(path, form=form)
    return float(int(raw.sum(dtype=np.uint64)) % 65521)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, form, via", [
    ("int8", "zip", "object store"),
    ("float16", "zip", "object store"),
    ("bfloat16", "zip", "object store"),
    ("float64", "dir", "object store"),
    ("uint16", "dir", "path"),
])
def test_one_copy_for_every_dtype_and_directory_bundles(probes, tmp_path, registry, dtype, form, via):
    nbytes = 64 * MiB
    path = tmp_path / ("b.cgb" if form == "zip" else "b")
    add = bytesum_bundle(path, getattr(engine, dtype), nbytes, registry, form)
    total, heap_peak, rss, private, results = load_everywhere(probes, str(path) if via == "path" else path, "x", 3)
    assert all(r == [1.0 + add] * 3 for r in results)
    check_one_copy(f"{dtype}, {form} form, via {via}", total, heap_peak, rss, private, nbytes)


# -- serving --------------------------------------------------------------------------------------------
def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_answers_500_requests_from_8_clients_batched(cluster, mlp_bundle, registry):
    from ray import serve

    import engine.ray.serve as engine_serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        handle = serve.run(engine_serve.app(put_bundle(mlp_bundle), max_batch_size=16, batch_wait_timeout_s=0.01),
                           name="mlp", route_prefix="/mlp")
        url = f"http://127.0.0.1:{port}/mlp"
        n, clients = 500, 8
        x = rows(np.arange(n))
        with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
            want = graph.run_async([x])[0].numpy().copy()
        replies: list = [None] * n
        latency = [0.0] * n

        def client(k: int) -> None:
            for i in range(k, n, clients):
                start = time.perf_counter()
                replies[i] = post(url, {"inputs": {"x": [x[i].tolist()]}})
                latency[i] = time.perf_counter() - start

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(status == 200 for status, _ in replies), [r for r in replies if r[0] != 200][:1]
        got = np.array([body["outputs"]["probs"][0] for _, body in replies], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        sizes = [body["batch_requests"] for _, body in replies]
        stats = json.loads(urllib.request.urlopen(url, timeout=60).read())
        print(f"\nServe: {n} requests from {clients} clients: p50 {np.percentile(latency, 50) * 1e3:.1f} ms, "
              f"p99 {np.percentile(latency, 99) * 1e3:.1f} ms; {stats['batches']} batches, largest "
              f"{stats['largest_batch']} requests, mean {np.mean(sizes):.2f}")
        assert max(sizes) > 1, "no two requests were ever batched together"
        assert stats["requests"] == n and stats["batches"] < n

        status, body = post(url, {"inputs": {"y": [[0.0] * D_IN]}})
        assert status == 400 and body["error"] == "unknown input 'y'; the graph's inputs are x"
        status, body = post(url, {"inputs": {"x": [[0.0] * 3]}})
        assert status == 400 and body["error"] == "input 'x': dimension 1 must be 64, got 3 (shape [batch, 64])"
        reply = handle.predict.remote({"x": x[:3]}).result()
        np.testing.assert_allclose(reply.outputs["probs"], want[:3], rtol=1e-6, atol=0)
        with pytest.raises(Exception, match="input 'x': expected dtype float32, got float64"):
            handle.predict.remote({"x": x[:3].astype(np.float64)}).result()
    finally:
        serve.shutdown()
