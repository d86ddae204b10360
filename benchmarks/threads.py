"""Concurrent runs of one graph: runs per second with 1, 2 and 4 threads (issue 3).

Each thread calls ``run_async`` on the same loaded graph in a loop, with its own input, for a fixed
time (the threads are released together by a barrier); the figure is all threads' runs divided by
the wall time. Two graphs, both on the CPU plugin, whose kernels are ctypes calls (the GIL is
released while a kernel runs):

* ``overhead``: 8 tiny kernels on 64 floats, about 1 µs of work per kernel. A run is nearly all
  Python (input checks, patching, output allocation), which holds the GIL, so the best a second
  thread can do is keep the total rate: the target is that runs/s does not *fall* as threads are
  added (per-run overhead does not grow with concurrency beyond the interpreter lock);
* ``compute``: 4 kernels of a few hundred µs each (scratch planned in the workspace). The GIL is free
  while they run, so runs/s should grow with threads up to the number of cores.

A **floor** is measured in the same rounds: each thread calls the overhead graph's prepared native
call (the 8 kernels fused into one ctypes call) and allocates one output per iteration, with none
of the engine's Python around it. It shows what the interpreter lock alone does to a loop of
GIL-releasing calls on this machine; the engine's scaling is judged against it.

Each case's runs/s is measured per thread count in rounds, interleaving the counts (1, 2, 4,
then 4, 2, 1, ...); the median round is reported with the load average, since the machine is shared.

Run: ``python benchmarks/threads.py [--quick]`` (results in ``benchmarks/results/threads.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "threads"
THREAD_COUNTS = (1, 2, 4)

SOURCE = r"""
#include <stdint.h>
/* y = x * 1.0001 + 0.5 over n floats */
int32_t tiny(void *const *t, const int64_t *s, void *ws) {
    const float *x = (const float *)t[0]; float *y = (float *)t[1];
    for (int64_t i = 0; i < s[0]; i++) y[i] = x[i] * 1.0001f + 0.5f;
    return 0;
}
/* a dependent multiply-add chain per element, staged through the scratch workspace */
int32_t heavy(void *const *t, const int64_t *s, void *ws) {
    const float *x = (const float *)t[0]; float *y = (float *)t[1]; float *w = (float *)ws;
    for (int64_t i = 0; i < s[0]; i++) {
        float v = x[i];
        for (int r = 0; r < REPS; r++) v = v * 0.999f + 0.001f;
        w[i] = v;
    }
    for (int64_t i = 0; i < s[0]; i++) y[i] = w[i];
    return 0;
}
"""


def build(registry, kind: str, reps: int):
    from engine.build import GraphBuilder

    b = GraphBuilder(kind, registry=registry)
    x = b.input("x", "float32", ["n"])
    source = SOURCE.replace("REPS", str(reps))
    if kind == "overhead":
        k = b.kernel("tiny", entries=["tiny"], source=source)
        for _ in range(8):
            (x,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    else:
        k = b.kernel("heavy", entries=["heavy"], source=source)
        for _ in range(4):
            (x,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(x)
    return b.build()


def runs_per_second(graph, n: int, threads: int, seconds: float, *, floor: bool = False) -> float:
    barrier = threading.Barrier(threads + 1)
    counts = [0] * threads
    stop = [0.0]

    def worker(i: int) -> None:
        x = np.random.default_rng(i).standard_normal(n).astype(np.float32)  # the thread's own input
        graph.run_async([x])  # the thread's first run prepares its workspaces and launches
        if floor:
            (call,) = graph.runtime.lane().runs[(n,)].calls  # the fused native call of this thread's run
            nbytes = n * 4

            def run(args: object, call=call, empty=np.empty, uint8=np.uint8) -> None:
                call()
                empty(nbytes, uint8)
        else:
            run = graph.run_async
        barrier.wait()
        deadline = stop[0]
        done = 0
        args = [x]
        while time.perf_counter() < deadline:
            run(args)
            done += 1
        counts[i] = done

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    stop[0] = time.perf_counter() + seconds + 0.05
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    args = ap.parse_args(argv)
    rounds, seconds = (3, 0.3) if args.quick else (7, 1.0)

    registry = C.make_registry(C.isolated_cache())
    overhead = build(registry, "overhead", 1)
    cases = {"overhead": (overhead, 64, False), "floor (bare call)": (overhead, 64, True),
             "compute": (build(registry, "compute", 500), 256, False)}
    rates: dict[tuple[str, int], list[float]] = {}
    load = []
    for r in range(rounds):
        order = THREAD_COUNTS if r % 2 == 0 else THREAD_COUNTS[::-1]
        for name, (graph, n, floor) in cases.items():
            for threads in order:
                rates.setdefault((name, threads), []).append(runs_per_second(graph, n, threads, seconds, floor=floor))
        load.append(os.getloadavg()[0])

    def median(name: str, threads: int) -> float:
        return statistics.median(rates[(name, threads)])

    rows, result_rows = [], []
    for name in cases:
        base = median(name, 1)
        for threads in THREAD_COUNTS:
            med = median(name, threads)
            rows.append([name, threads, f"{med:,.0f}", f"{1e6 / med * threads:.1f}", f"{med / base:.2f}x"])
            result_rows.append({"case": name, "threads": threads, "runs_per_s_median": round(med),
                                "runs_per_s_rounds": [round(v) for v in rates[(name, threads)]],
                                "speedup_vs_1_thread": round(med / base, 3)})
    scaling = {t: median("overhead", t) / median("overhead", 1) for t in THREAD_COUNTS}
    floor_scaling = {t: median("floor (bare call)", t) / median("floor (bare call)", 1) for t in THREAD_COUNTS}
    worst = min(scaling.values())
    relative = min(scaling[t] / floor_scaling[t] for t in THREAD_COUNTS if t > 1)
    two = median("compute", 2) / median("compute", 1)
    summary = [
        {"metric": "overhead graph: lowest runs/s at 2 or 4 threads over 1 thread", "value": round(worst, 2),
         "unit": "x", "target": "~1 (the GIL serialises the Python part)"},
        {"metric": "overhead graph scaling / floor scaling (lowest)", "value": round(relative, 2), "unit": "x",
         "target": ">= 0.8 (no contention beyond the GIL)", "ok": relative >= 0.8},
        {"metric": "compute graph: 2 threads over 1", "value": round(two, 2), "unit": "x",
         "target": f"~{min(2, os.cpu_count() or 1)} on {os.cpu_count()} cores"},
    ]
    print(C.format_table(["case", "threads", "runs/s (all threads)", "µs per run per thread", "vs 1 thread"],
                         rows, title=f"run_async from 1, 2, 4 threads ({os.cpu_count()} cores, load average "
                                     f"{statistics.mean(load):.2f}, median of {rounds} rounds of {seconds} s)"))
    C.print_summary(summary)
    path = C.write_results(NAME, quick=args.quick, params={"rounds": rounds, "seconds": seconds,
                                                           "threads": list(THREAD_COUNTS)},
                           rows=result_rows, summary=summary,
                           notes=[f"load average during the run: {statistics.mean(load):.2f}"])
    print(f"\nresults: {path}")
    return {"rows": result_rows, "summary": summary}


if __name__ == "__main__":
    main()
