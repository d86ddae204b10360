"""Batch inference on Ray Data: throughput with 1 and 2 actors beside the same loop without Ray.

One graph (an MLP large enough that a batch is real work: 256 -> 1024 -> 10, float32), the same
batches three ways, in alternating rounds:

* ``in-process``: a Python loop calling ``run_async`` on each batch, in this process, no Ray;
* ``1 process``/``2 processes, no Ray``: the same loop split over plain processes (spawned, timed
  from a barrier): the floor that says what two cores give right now, beside Ray's scaling;
* ``ray, 1 actor`` and ``ray, 2 actors``: ``Dataset.map_batches(engine.ray.GraphPredictor,
  compute=ActorPoolStrategy(size=N))`` over the same rows (blocks already in the object store).

Throughput is taken in the steady state: each batch's result carries the time it finished, and the
rate is counted from the first finished batch to the last (actor start-up and graph loading are
reported apart, as the end-to-end time). Ray's per-batch overhead is measured twice: as (1-actor
time per batch) - (in-process time per batch), and directly with a UDF that returns its input
(no graph). Target: 2 actors >= 1.8x one actor on this 2-core machine.

Run: ``python benchmarks/ray_batch.py [--quick]`` (needs ``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

D_IN, HIDDEN, CLASSES = 256, 1024, 10


def make_dataset(ray, n_rows: int, batch: int):
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n_rows, D_IN)).astype(np.float32)
    tables = [pa.table({"id": np.arange(s, min(s + batch, n_rows)), "x": ArrowTensorArray.from_numpy(x[s:s + batch])})
              for s in range(0, n_rows, batch)]
    return x, ray.data.from_arrow(tables).materialize()


class Stamped:
    """``GraphPredictor`` that also returns when each batch finished (for the steady-state rate)."""

    def __init__(self, bundle):
        from engine.ray import GraphPredictor

        self.inner = GraphPredictor(bundle)

    def __call__(self, batch):
        out = self.inner({"x": batch["x"]})
        out["done"] = np.full(len(batch["x"]), time.time())
        return out


class Echo:
    """No graph: what Ray Data costs per batch on its own."""

    def __call__(self, batch):
        return {"id": batch["id"], "done": np.full(len(batch["id"]), time.time())}


def _process_worker(bundle: str, cache: str, n_rows: int, batch: int, part: int, parts: int, barrier, results) -> None:
    """One process of the no-Ray floor: its share of the batches, timed between the barrier and the end."""
    import os

    os.environ["ENGINE_CACHE_DIR"] = cache
    import engine

    x = np.random.default_rng(0).standard_normal((n_rows, D_IN)).astype(np.float32)
    graph = engine.load_compiled_graph(bundle)
    graph.run_async([x[:batch]])
    barrier.wait()
    start = time.time()
    for s in range(part * batch, n_rows, parts * batch):
        graph.run_async([x[s:s + batch]])
    results.put((start, time.time()))


def processes_run(bundle: Path, cache: Path, n_rows: int, batch: int, parts: int) -> dict[str, float]:
    """The same loop split over ``parts`` plain processes (no Ray): what the machine gives right now."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(parts), ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(str(bundle), str(cache), n_rows, batch, k, parts, barrier,
                                                        results)) for k in range(parts)]
    for p in procs:
        p.start()
    spans = [results.get() for _ in procs]
    for p in procs:
        p.join()
    total = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"rows_per_s": n_rows / total, "s_per_batch": total * parts / (n_rows // batch), "end_to_end_s": total,
            "rows": n_rows}


def steady_rate(done: np.ndarray, batch: int) -> tuple[float, float]:
    """(rows per second, seconds per batch) between the first and the last finished batch."""
    stamps = np.unique(done)
    if len(stamps) < 3:
        return float("nan"), float("nan")
    span = stamps[-1] - stamps[0]
    return (len(stamps) - 1) * batch / span, span / (len(stamps) - 1)


def ray_run(ray, ds, fn, args, actors: int, batch: int) -> dict[str, float]:
    start = time.perf_counter()
    out = ds.map_batches(fn, fn_constructor_args=args, compute=ray.data.ActorPoolStrategy(size=actors),
                         batch_size=batch, batch_format="numpy").take_batch(10 ** 9, batch_format="numpy")
    total = time.perf_counter() - start
    rate, per_batch = steady_rate(out["done"], batch)
    return {"rows_per_s": rate, "s_per_batch": per_batch, "end_to_end_s": total, "rows": len(out["done"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and one round")
    ap.add_argument("--batch-size", type=int, default=5000,
                    help="rows per batch (default 5000: Ray's fixed per-batch cost is then a few per cent)")
    args = ap.parse_args(argv)
    try:
        import ray
    except ImportError:
        print("ray is not installed: pip install -e '.[ray]'; skipped")
        return 0
    import engine
    import engine.ray
    from engine.demo.mlp import build_mlp

    cache = C.isolated_cache()
    load_start = C.loadavg()
    n_rows, batch, rounds = (20_000, 1000, 1) if args.quick else (60_000, args.batch_size, 2)
    bundle = cache / "mlp-ray.cgb"
    build_mlp(d_in=D_IN, hidden=HIDDEN, classes=CLASSES).save(bundle)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        x, ds = make_dataset(ray, n_rows, batch)
        ref = engine.ray.put_bundle(bundle)
        graph = engine.load_compiled_graph(bundle)
        graph.run_async([x[:batch]])  # tune this batch size, as every actor does on its first batch

        def in_process() -> dict[str, float]:
            start = time.perf_counter()
            for s in range(0, n_rows, batch):
                graph.run_async([x[s:s + batch]])
            total = time.perf_counter() - start
            return {"rows_per_s": n_rows / total, "s_per_batch": total / (n_rows // batch), "end_to_end_s": total,
                    "rows": n_rows}

        cases = {"in-process": in_process,
                 "1 process, no Ray": lambda: processes_run(bundle, cache, n_rows, batch, 1),
                 "2 processes, no Ray": lambda: processes_run(bundle, cache, n_rows, batch, 2),
                 "ray, 1 actor": lambda: ray_run(ray, ds, Stamped, (ref,), 1, batch),
                 "ray, 2 actors": lambda: ray_run(ray, ds, Stamped, (ref,), 2, batch),
                 "ray, echo UDF, 1 actor": lambda: ray_run(ray, ds, Echo, (), 1, batch)}
        results: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
        for r in range(rounds):
            for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
                results[name].append(cases[name]())
    finally:
        ray.shutdown()

    best = {k: max(v, key=lambda m: m["rows_per_s"]) for k, v in results.items()}
    one, two, local = best["ray, 1 actor"], best["ray, 2 actors"], best["in-process"]
    scaling = two["rows_per_s"] / one["rows_per_s"]
    overhead = one["s_per_batch"] - local["s_per_batch"]
    echo = best["ray, echo UDF, 1 actor"]["s_per_batch"]
    rows = [{"case": k, "rows_per_s": int(round(m["rows_per_s"])), "ms_per_batch": round(m["s_per_batch"] * 1e3, 2),
             "end_to_end_s": round(m["end_to_end_s"], 2), "rows": int(m["rows"]),
             "vs_in_process": round(m["rows_per_s"] / local["rows_per_s"], 2)} for k, m in best.items()]
    print(C.format_table(["case", "rows/s (steady)", "ms/batch", "end to end s", "rows", "x in-process"],
                         [[r["case"], r["rows_per_s"], r["ms_per_batch"], r["end_to_end_s"], r["rows"],
                           r["vs_in_process"]] for r in rows],
                         title=f"{n_rows} rows in batches of {batch}, MLP {D_IN}-{HIDDEN}-{CLASSES}, best of {rounds}"))
    floor = best["2 processes, no Ray"]["rows_per_s"] / best["1 process, no Ray"]["rows_per_s"]
    summary = [
        {"metric": "2 actors / 1 actor (throughput)", "value": round(scaling, 2), "unit": "x", "target": ">= 1.8",
         "ok": bool(scaling >= 1.8)},
        {"metric": "floor: 2 processes / 1 process, no Ray, same rounds", "value": round(floor, 2), "unit": "x"},
        {"metric": "1 actor / in-process loop", "value": round(one["rows_per_s"] / local["rows_per_s"], 2),
         "unit": "x"},
        {"metric": "Ray per-batch overhead (1 actor - in-process)", "value": round(overhead * 1e3, 2), "unit": "ms"},
        {"metric": "Ray per-batch time, echo UDF", "value": round(echo * 1e3, 2), "unit": "ms"},
    ]
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    C.write_results("ray_batch", quick=args.quick,
                    params={"rows": n_rows, "batch": batch, "rounds": rounds, "model": f"mlp {D_IN}-{HIDDEN}-{CLASSES}",
                            "ray": ray.__version__},
                    rows=rows, summary=summary,
                    notes=[f"load average {load_start} at start, {C.loadavg()} at end (2 cores shared)"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
