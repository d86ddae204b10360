"""The native run path (issue 16) against the Python path and against floors, all in the same run.

The graphs are ``dispatch_overhead``'s chains of N ``add_one`` kernels on float32[1] (N = 1 and
1000), each loaded twice: on a registry with the native run path (``Settings.native_run``, the
default) and on one without it (``ENGINE_NATIVE_RUN=0``: the Python fast path). The floors are
``dispatch_overhead``'s: one Python ctypes call of the same kernel per kernel (``py-ctypes``) and
one C loop over the same function pointer (``C loop``). Figures, each against its issue target:

* fixed per-run overhead of ``run_async`` (N = 1) = t(run) - t(py-ctypes, N = 1), in units of that
  one ctypes call (target <= 6x);
* ``capture().replay()`` of the N = 1 graph over one ctypes call (target <= 2x);
* per-kernel overhead = (t(N=1000) - t(N=1)) / 999 over the C loop's per-call cost (target <= 1.5x);
* ``run_async(..., outputs=[out])`` (the same caller buffer each run) over fresh outputs (target <= 1x);
* two threads on one graph of compute-bound kernels (``threads.py``'s ``compute`` graph) over one
  thread, runs per second (target >= 1.8x on 2 cores), beside the Python path and a floor measured
  in the same rounds: each thread making the prepared run's fused native call itself (what two
  threads of GIL-releasing calls get from the machine at that moment).

The breakdown of the fixed overhead (docs/benchmarks.md "Where the fixed overhead goes") is timed
through public entry points only, for both paths: the whole run; the run into a caller's buffer
(``outputs=``: no output allocation); the run while the caller keeps the previous outputs (the pool
cannot hand them out again: one fresh allocation and wrapping per output per run); the replay of a
capture (the launches alone); and the Python binder (``graph.runtime.binder.bind``). The pieces are
differences of these.

Run: ``python benchmarks/native_run.py [--quick]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import dispatch_overhead as D  # noqa: E402
import threads as T  # noqa: E402

NAME = "native_run"
SIZES = (1, 1000)
FIXED_TARGET = 6.0
REPLAY_TARGET = 2.0
PER_KERNEL_TARGET = 1.5
OUTPUTS_TARGET = 1.0
THREADS_TARGET = 1.8


def registry_with(cache: Path, native_run: bool):
    from engine.plugins import Registry
    from engine.settings import Settings

    registry = Registry(Settings(cache_dir=cache, native_run=native_run))
    registry.load_entry_points()
    return registry


def check_path(graph, native_run: bool) -> None:
    if graph.runtime.native_run != native_run:
        C.fail(f"the graph's native_run is {graph.runtime.native_run}, expected {native_run}")
    if native_run and graph.runtime.lane().native is None:
        C.fail("the native path did not prepare this graph")


def path_cases(graph, tag: str) -> dict:
    """The timed callables of one N = 1 graph: run, outputs=, kept outputs, replay, bind."""
    x = np.zeros(1, np.float32)
    xs = [x]
    out = [np.empty(1, np.float32)]
    run = graph.run_async
    kept: deque = deque(maxlen=2)
    captured = graph.capture(x)
    bind = graph.runtime.binder.bind
    for _ in range(3):
        run(xs, outputs=out)
        kept.append(run(xs))
    if float(out[0][0]) != 1.0 or float(kept[-1][0].numpy()[0]) != 1.0:
        C.fail(f"{tag}: wrong result")
    return {
        f"{tag}/run": lambda: run(xs),
        f"{tag}/outputs": lambda: run(xs, outputs=out),
        f"{tag}/kept": lambda: kept.append(run(xs)),
        f"{tag}/replay": captured.replay,
        f"{tag}/bind": lambda: bind(xs),
    }


def thread_scaling(registries, rounds: int, seconds: float) -> dict[str, tuple[float, list[float], list[float]]]:
    """Per path, runs/s of two threads over one on the compute graph (medians of interleaved rounds)."""
    graphs = {tag: T.build(registry, "compute", 500) for tag, registry in registries.items()}
    # The floor: each thread makes the prepared run's fused native call itself (threads.py's bare call),
    # which shows what two threads of GIL-releasing calls get from this machine in the same rounds.
    floors = {"floor (bare call)": graphs["native"]}
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        for tag, graph in [*graphs.items(), *floors.items()]:
            for threads in order:
                rates.setdefault((tag, threads), []).append(
                    T.runs_per_second(graph, 256, threads, seconds, floor=tag in floors))
    graphs.update(floors)
    return {tag: (statistics.median(rates[(tag, 2)]) / statistics.median(rates[(tag, 1)]), rates[(tag, 1)],
                  rates[(tag, 2)]) for tag in graphs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (seconds, not a minute)")
    args = ap.parse_args(argv)
    rounds, round_s = (20, 0.003) if args.quick else (200, 0.002)
    t_rounds, t_seconds = (3, 0.3) if args.quick else (7, 1.0)

    load_start = C.loadavg()
    cache = C.isolated_cache()
    from engine.runtime import native

    if native.unavailable() is not None:
        C.fail(f"the native run path is unavailable: {native.unavailable()}")
    reg_on, reg_off = registry_with(cache, True), registry_with(cache, False)

    cases = {}
    graphs = {}
    for n in SIZES:
        for tag, registry, on in (("native", reg_on, True), ("python", reg_off, False)):
            graph = graphs[(tag, n)] = D.build_chain(n, registry)
            cases[f"{tag}/{n}"] = D.engine_case(graph, n)
            check_path(graph, on)
    for tag in ("native", "python"):
        cases.update(path_cases(graphs[(tag, 1)], tag))

    kernel = graphs[("native", 1)].compiled_tasks[0].candidates[0]
    lib = ctypes.CDLL(str(kernel.library.path))
    kernel_fn = lib["add_one"]
    kernel_fn.restype = ctypes.c_int32
    fn_addr = ctypes.cast(kernel_fn, ctypes.c_void_p).value
    if fn_addr != kernel.function_addr:
        C.fail("the floor's kernel is not the engine's kernel")
    tmp = Path(tempfile.mkdtemp(dir=cache))
    (payload,) = reg_on.backend("cpu").compile(D.C_LOOP_SOURCE, "c")
    (tmp / "c_loop.so").write_bytes(bytes(payload.data))
    c_loop_fn = ctypes.CDLL(str(tmp / "c_loop.so"))["c_loop"]
    c_loop_fn.restype = ctypes.c_int64
    for n in SIZES:
        f = D.Floors(kernel_fn, c_loop_fn, fn_addr, n)
        f.check("py")
        f.check("c")
        cases[f"py/{n}"] = f.py_loop
        cases[f"c/{n}"] = f.c_call

    timings = C.interleaved(cases, rounds=rounds, round_s=round_s)
    t = {k: v.min for k, v in timings.items()}
    load_threads = C.loadavg()
    scalings = thread_scaling({"native": reg_on, "python": reg_off}, t_rounds, t_seconds)
    scaling = scalings["native"][0]

    call = t["py/1"]
    per_c = (t["c/1000"] - t["c/1"]) / 999
    per_py = (t["py/1000"] - t["py/1"]) / 999
    rows, table = [], []
    for tag in ("native", "python"):
        per = (t[f"{tag}/1000"] - t[f"{tag}/1"]) / 999
        fixed = t[f"{tag}/1"] - call
        row = {"path": tag, "run_n1_us": round(t[f"{tag}/1"] * 1e6, 3),
               "run_n1000_us": round(t[f"{tag}/1000"] * 1e6, 3),
               "fixed_us": round(fixed * 1e6, 3), "fixed_over_ctypes_call": round(fixed / call, 2),
               "per_kernel_ns": round(per * 1e9, 2), "per_kernel_over_c_loop": round(per / per_c, 3),
               "replay_us": round(t[f"{tag}/replay"] * 1e6, 3),
               "replay_over_ctypes_call": round(t[f"{tag}/replay"] / call, 2),
               "outputs_us": round(t[f"{tag}/outputs"] * 1e6, 3),
               "outputs_over_fresh": round(t[f"{tag}/outputs"] / t[f"{tag}/run"], 3),
               "kept_outputs_us": round(t[f"{tag}/kept"] * 1e6, 3), "bind_us": round(t[f"{tag}/bind"] * 1e6, 3)}
        rows.append(row)
        table.append([tag, C.us(t[f"{tag}/1"]), C.us(fixed), C.ratio(fixed, call, 1), f"{per * 1e9:.2f}",
                      C.ratio(per, per_c), C.us(t[f"{tag}/replay"]), C.ratio(t[f"{tag}/replay"], call),
                      C.us(t[f"{tag}/outputs"]), C.ratio(t[f"{tag}/outputs"], t[f"{tag}/run"])])
    print(C.format_table(
        ["path", "run N=1 us", "fixed us", "fixed/call", "per-kernel ns", "vs C loop", "replay us", "replay/call",
         "outputs= us", "vs fresh"], table,
        title=f"Native run path vs Python path ({rounds} interleaved rounds, min; one py-ctypes call "
              f"{call * 1e6:.3f} us, C-loop call {per_c * 1e9:.2f} ns)"))

    breakdown = []
    for tag in ("native", "python"):
        run, outputs, kept, replay = (t[f"{tag}/{k}"] for k in ("run", "outputs", "kept", "replay"))
        breakdown.append([tag, C.us(run), C.us(replay), C.us(run - replay), C.us(kept - run), C.us(run - outputs),
                          C.us(t[f"{tag}/bind"])])
    print()
    print(C.format_table(
        ["path", "run us", "launches (replay)", "run - launches", "fresh output (kept - run)",
         "run - outputs= (allocation+wrap saved)", "Python binder"], breakdown,
        title="Where the fixed overhead goes (N = 1; public entry points, differences of minima)"))

    native_row = rows[0]
    fixed = native_row["fixed_over_ctypes_call"]
    summary = [
        {"metric": "native: fixed per-run overhead / one py-ctypes call", "value": fixed, "unit": "x",
         "target": f"<= {FIXED_TARGET:g}x", "ok": fixed <= FIXED_TARGET},
        {"metric": "native: fixed per-run overhead", "value": native_row["fixed_us"], "unit": "us"},
        {"metric": "python path: fixed per-run overhead / one py-ctypes call",
         "value": rows[1]["fixed_over_ctypes_call"], "unit": "x"},
        {"metric": "native: capture().replay() / one py-ctypes call", "value": native_row["replay_over_ctypes_call"],
         "unit": "x", "target": f"<= {REPLAY_TARGET:g}x", "ok": native_row["replay_over_ctypes_call"] <= REPLAY_TARGET},
        {"metric": "native: per-kernel overhead / C-loop call", "value": native_row["per_kernel_over_c_loop"],
         "unit": "x", "target": f"<= {PER_KERNEL_TARGET:g}x",
         "ok": native_row["per_kernel_over_c_loop"] <= PER_KERNEL_TARGET},
        {"metric": "native: run_async(outputs=) / fresh outputs", "value": native_row["outputs_over_fresh"],
         "unit": "x", "target": f"<= {OUTPUTS_TARGET:g}x", "ok": native_row["outputs_over_fresh"] <= OUTPUTS_TARGET},
        {"metric": "python path: run_async(outputs=) / fresh outputs", "value": rows[1]["outputs_over_fresh"],
         "unit": "x"},
        {"metric": "native: compute graph, 2 threads / 1 thread (runs/s)", "value": round(scaling, 2), "unit": "x",
         "target": f">= {THREADS_TARGET:g}x on {os.cpu_count()} cores", "ok": scaling >= THREADS_TARGET},
        {"metric": "python path: compute graph, 2 threads / 1 thread (same rounds)",
         "value": round(scalings["python"][0], 2), "unit": "x"},
        {"metric": "floor: bare native call, 2 threads / 1 thread (same rounds)",
         "value": round(scalings["floor (bare call)"][0], 2), "unit": "x"},
        {"metric": "load average before the thread rounds", "value": load_threads, "unit": ""},
        {"metric": "py-ctypes call (floor)", "value": round(call * 1e6, 3), "unit": "us"},
        {"metric": "py-ctypes per-call slope (floor)", "value": round(per_py * 1e6, 3), "unit": "us"},
        {"metric": "C-loop call (floor)", "value": round(per_c * 1e9, 2), "unit": "ns"},
    ]
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    path = C.write_results(NAME, quick=args.quick,
                           params={"sizes": list(SIZES), "rounds": rounds, "round_s": round_s, "statistic": "min",
                                   "loadavg_start": load_start, "thread_rounds": t_rounds,
                                   "thread_seconds": t_seconds},
                           rows=rows + [{"path": tag, "case": "compute graph runs/s",
                                         "one_thread": [round(v) for v in s1], "two_threads": [round(v) for v in s2]}
                                        for tag, (_, s1, s2) in scalings.items()],
                           summary=summary)
    print(f"results: {path.relative_to(C.REPO_ROOT)}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
