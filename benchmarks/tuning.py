"""Tuning: selection accuracy, the tuning machinery's overhead, and the slow path after tune().

Workloads (real C kernels through the CPU plugin):

* ``work``: one kernel ``y = x`` over ``float32[n]`` with two candidates of the same result,
  ``heavy`` (64 passes, candidate 0) and ``light`` (8 passes): one does several times the work;
* ``mlp``: the demo MLP (``engine.demo.mlp``), two tasks with two candidates each, three with one.

Figures:

* **selection accuracy**: ``trials`` independent graphs (fresh caches) each tune ``work`` at one
  key; how many picked ``light``. Then the tuned graph is saved with ``save_dispatch_table=True``
  and loaded in another process under the ``error`` policy: the row must be the same and the run
  must not tune.
* **tuning overhead**: ``graph.tune(...)`` over a range of keys on a fresh cache, wall time
  against the wall time spent inside ``Backend.time`` (the candidates' own timed runs, warmup
  included). Overhead = everything else: planning the key, zero inputs, interpreting the plan,
  cloning, the real run, recording, the cache file and the Chrome trace of the grid. Target <= 10%
  of the tuning time. Median over rounds; also given with ``write_traces=False``.
* **slow path after tune**: after ``tune(batch=range(...))``, one run per key of the range under
  the ``error`` policy; ``run_stats().slow_runs`` must not move (target 0 slow runs).
* **first call at a new key**, per policy (informative): the stall that ``tune`` causes and that
  ``first``, ``nearest`` and ahead-of-time tuning avoid.

Run: ``python benchmarks/tuning.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from engine.testing.two_candidates import work_bundle  # noqa: E402

NAME = "tuning"
OVERHEAD_TARGET = 0.10


def _rounded(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}") if x else 0.0


def registry_at(cache: Path, **settings):
    from engine.plugins import Registry
    from engine.settings import Settings

    registry = Registry(Settings(cache_dir=cache, **settings))
    registry.load_entry_points()
    return registry


def mlp_bundle(registry, path: Path) -> Path:
    from engine.demo.mlp import build_mlp

    build_mlp(registry=registry).save(path)
    return path


def selection(bundle: Path, trials: int, key: int, work_dir: Path) -> dict:
    import numpy as np

    import engine

    picks, ratios = [], []
    tuned = None
    for t in range(trials):
        graph = engine.load_compiled_graph(bundle, registry=registry_at(work_dir / f"sel-{t}"))
        row = graph.tune(n=[key])[(key,)]
        (timing,) = graph.tuning_results()[(key,)]
        picks.append(row[0])
        ratios.append(timing.medians_ms[0] / timing.medians_ms[1])
        tuned = graph
    saved = work_dir / "work-tuned.cgb"
    tuned.save(saved, save_dispatch_table=True)
    x = np.arange(key, dtype=np.float32)
    np.save(work_dir / "x.npy", x)
    script = textwrap.dedent("""
        import json, sys, numpy as np, engine
        graph = engine.load_compiled_graph(sys.argv[1], dispatch_policy="error")
        x = np.load(sys.argv[2])
        ok = bool((graph(x).numpy() == x).all())
        print(json.dumps({"row": list(graph.dispatch_table[(len(x),)]), "ok": ok,
                          "slow": graph.run_stats().slow_runs}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(saved), str(work_dir / "x.npy")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "ENGINE_CACHE_DIR": str(work_dir / "child")})
    if proc.returncode != 0:
        C.fail(f"the saved graph did not run in another process:\n{proc.stderr}")
    child = json.loads(proc.stdout.splitlines()[-1])
    return {"picks_light": sum(p == 1 for p in picks), "trials": trials,
            "heavy_over_light_median": round(statistics.median(ratios), 2), "child": child,
            "survives": child["row"] == [1] and child["ok"] and child["slow"] == 0}


def overhead_round(bundle: Path, cache: Path, symbol: str, keys: list[int], traces: bool) -> dict:
    import attrs

    import engine

    graph = engine.load_compiled_graph(bundle, registry=registry_at(cache))
    graph.tuning = attrs.evolve(graph.tuning, write_traces=traces)
    t0 = time.perf_counter()
    graph.tune(**{symbol: keys})
    wall = time.perf_counter() - t0
    stats = graph.tuning_stats()
    if stats.keys != len(keys):
        C.fail(f"tune() tuned {stats.keys} keys, expected {len(keys)}")
    return {"wall_s": wall, "timed_s": stats.timed_s, "overhead": (wall - stats.timed_s) / wall,
            "per_key_overhead_ms": (wall - stats.timed_s) / len(keys) * 1e3, "candidates": stats.candidates_timed}


def no_slow_path(bundle: Path, cache: Path, keys: list[int]) -> dict:
    import numpy as np

    import engine

    graph = engine.load_compiled_graph(bundle, registry=registry_at(cache))
    graph.tune(batch=keys)
    before = graph.run_stats()
    graph.dispatch_policy = "error"  # an untuned key would raise instead of going slow
    for b in keys:
        graph.run_async([np.ones((b, 64), np.float32)])
    after = graph.run_stats()
    return {"keys": len(keys), "slow_runs": after.slow_runs - before.slow_runs,
            "prepared_runs": after.prepared_runs - before.prepared_runs}


def first_call(bundle: Path, work_dir: Path, rounds: int) -> dict:
    import numpy as np

    import engine

    x = np.ones((48, 64), np.float32)
    out: dict[str, list[float]] = {"tune": [], "first": [], "nearest": [], "pre-tuned": [], "fast path": []}
    # One cache for the kernels and the CPU plugin's fused launchers (built once, by this warm-up
    # run), none for dispatch rows: each graph starts with an empty table.
    registry = registry_at(work_dir / "first-call", dispatch_cache=False)
    engine.load_compiled_graph(bundle, registry=registry, dispatch_policy="first").run_async([x])
    for r in range(rounds):
        for policy in ("tune", "first", "nearest", "pre-tuned"):
            graph = engine.load_compiled_graph(bundle, registry=registry)
            if policy == "nearest":
                graph.tune(batch=[32, 64])
            if policy == "pre-tuned":
                graph.tune(batch=[48])
            graph.dispatch_policy = "tune" if policy == "pre-tuned" else policy
            t0 = time.perf_counter()
            graph.run_async([x])
            out[policy].append(time.perf_counter() - t0)
            if policy == "pre-tuned":
                t0 = time.perf_counter()
                graph.run_async([x])
                out["fast path"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer keys and rounds")
    args = ap.parse_args(argv)

    load_start = C.loadavg()
    cache = C.isolated_cache()
    work_dir = Path(tempfile.mkdtemp(prefix="engine-bench-tuning-", dir=cache))
    registry = registry_at(cache / "build")
    bundles = {"work": work_bundle(registry, work_dir / "work.cgb"), "mlp": mlp_bundle(registry, work_dir / "mlp.cgb")}
    rounds = 3 if args.quick else 5
    mlp_keys = list(range(1, 17 if args.quick else 65))
    work_keys = [4096 * k for k in range(1, 9 if args.quick else 17)]

    # 1. which candidate wins, and whether the choice survives save/load into another process
    sel = selection(bundles["work"], 10, 32768, work_dir)

    # 2. overhead of tune() beyond the candidates' timed runs
    cases = {("mlp", True): ("batch", mlp_keys), ("mlp", False): ("batch", mlp_keys),
             ("work", True): ("n", work_keys), ("work", False): ("n", work_keys)}
    results: dict[tuple[str, bool], list[dict]] = {c: [] for c in cases}
    for r in range(rounds):  # interleaved, fresh cache each time
        for (name, traces), (symbol, keys) in cases.items():
            results[(name, traces)].append(
                overhead_round(bundles[name], work_dir / f"ov-{name}-{traces}-{r}", symbol, keys, traces))

    # 3. no slow path after tune() over a range
    slow = no_slow_path(bundles["mlp"], work_dir / "slow", mlp_keys)

    # 4. first call at a new key, per policy
    first = first_call(bundles["mlp"], work_dir, rounds)

    rows, table = [], []
    for (name, traces), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "timed_s", "overhead",
                                                                  "per_key_overhead_ms")}
        keys = cases[(name, traces)][1]
        rows.append({"workload": name, "traces": traces, "keys": len(keys), "rounds": len(runs),
                     "wall_s_median": _rounded(med["wall_s"]), "timed_s_median": _rounded(med["timed_s"]),
                     "overhead_median": _rounded(med["overhead"]),
                     "overhead_min": _rounded(min(r["overhead"] for r in runs)),
                     "overhead_max": _rounded(max(r["overhead"] for r in runs)),
                     "per_key_overhead_ms_median": _rounded(med["per_key_overhead_ms"]),
                     "candidates_timed": runs[0]["candidates"]})
        table.append([name, "yes" if traces else "no", len(keys), f"{med['wall_s'] * 1e3:.1f}",
                      f"{med['timed_s'] * 1e3:.1f}", f"{med['per_key_overhead_ms']:.2f}",
                      f"{100 * med['overhead']:.1f}%",
                      f"{100 * min(r['overhead'] for r in runs):.1f}-{100 * max(r['overhead'] for r in runs):.1f}%"])
    print(C.format_table(["tune()", "traces", "keys", "wall ms", "timed ms", "overhead/key ms", "overhead",
                          "range"], table, title="tuning overhead (median over rounds)"))
    print()
    print(C.format_table(["policy at a new key (mlp, batch=48)", "first call ms"],
                         [[k, f"{v:.2f}"] for k, v in first.items()]))
    print()
    C.warn_if_busy(load_start)

    worst = max(r["overhead_median"] for r in rows if r["traces"])
    summary = [
        {"metric": "cheaper candidate picked", "value": f"{sel['picks_light']}/{sel['trials']}", "unit": "",
         "target": "10/10", "ok": sel["picks_light"] == sel["trials"]},
        {"metric": "choice survives save/load in another process", "value": sel["survives"], "unit": "",
         "target": "True", "ok": bool(sel["survives"])},
        {"metric": "tuning overhead (worst workload, traces on)", "value": round(100 * worst, 1), "unit": "%",
         "target": f"<= {100 * OVERHEAD_TARGET:.0f}%", "ok": worst <= OVERHEAD_TARGET},
        {"metric": "slow runs after tune() over the range", "value": slow["slow_runs"], "unit": "runs",
         "target": "0", "ok": slow["slow_runs"] == 0 and slow["prepared_runs"] == slow["keys"]},
    ]
    C.print_summary(summary)
    C.write_results(NAME, quick=args.quick,
                    params={"rounds": rounds, "mlp_keys": [mlp_keys[0], mlp_keys[-1]],
                            "work_keys": [work_keys[0], work_keys[-1]], "statistic": "median"},
                    rows=rows, summary=summary,
                    notes=[f"selection: {json.dumps(sel)}", f"no slow path: {json.dumps(slow)}",
                           f"first call ms: {json.dumps({k: round(v, 3) for k, v in first.items()})}",
                           f"loadavg at start {load_start}, at end {C.loadavg()}"])
    return {"selection": sel, "rows": rows, "slow": slow, "first_call_ms": first}


if __name__ == "__main__":
    main()
