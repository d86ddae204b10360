"""OpenCL overhead: what engine adds on top of the OpenCL driver, against raw pyopencl in the same run.

The graph is ``z = x + y`` chained N times (N = 1, 16) with the OpenCL plugin's reference ``add``
kernel on 1024 floats (``v <- add(v, y)``; the output is ``x + N*y``), built with ``GraphBuilder``
on device ``opencl`` (PoCL's CPU device on the reference machine). Cases:

* ``engine, run + wait``: ``graph.run_async(inputs)`` then ``graph.runtime.devices.synchronize()``,
  per run (inputs already on the device, made with ``engine.asarray``);
* ``engine, enqueue only``: a batch of ``run_async`` calls without waiting, then one synchronize;
  the figure is the batch's time per run (the one wait amortised, so this is pipelined throughput);
* floor ``pyopencl, enqueue + finish``: the same program built with pyopencl on the plugin's own
  context and device (``OpenCLBackend.opencl_device``), one ``cl.Kernel`` with its arguments set
  once, ``cl.enqueue_nd_range_kernel`` N times on a queue with the plugin's queue properties, then
  ``queue.finish()``;
* floor ``pyopencl, enqueue only``: batches of N enqueues and one finish, as for the engine.

Derived figures: per-run overhead = t_engine(1) - t_floor(1) (and engine / floor at N = 1);
per-kernel cost = (t(16) - t(1)) / 15 for every case, and engine's ratio to the floor's.

Run: ``python benchmarks/opencl_overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "opencl_overhead"
SIZES = (1, 16)
N_ELEMENTS = 1024
#: Runs per timed call of the enqueue-only cases: one wait per batch.
BATCH = 32
LABELS = {"engine": "engine, run + wait", "floor": "pyopencl, enqueue + finish",
          "engine_enq": "engine, enqueue only", "floor_enq": "pyopencl, enqueue only"}


def build_chain(n: int, registry, ref):
    from engine.build import GraphBuilder

    b = GraphBuilder(f"opencl_chain_{n}", registry=registry)
    x = b.input("x", "float32", ["n"], device="opencl")
    y = b.input("y", "float32", ["n"], device="opencl")
    k = b.kernel("add", device="opencl", entries=list(ref.entries), source=ref.source, language=ref.language,
                 launch=ref.launch)
    v = x
    for _ in range(n):
        (v,) = b.call(k, [v, y], [("float32", ["n"])], symbols=["n"])
    b.output(v, "z")
    return b.build()


def engine_cases(graph, n: int, inputs, xs, ys, registry):
    """(run + wait, enqueue-only batch) for one graph, after checking its output."""
    import numpy as np

    sync = graph.runtime.devices.synchronize
    for _ in range(3):
        (z,) = graph.run_async(inputs)
    if not np.array_equal(z.numpy(registry=registry), xs + np.float32(n) * ys):
        C.fail(f"engine N={n}: wrong output {z.numpy(registry=registry)[:4]}..., expected x + {n}*y")
    stats = graph.run_stats()
    if stats.fast_runs < 1 or stats.prepared_runs != 1:
        C.fail(f"engine N={n}: the fast path did not run ({stats})")
    run = graph.run_async

    def run_wait() -> None:
        run(inputs)
        sync()

    def enqueue_batch() -> None:
        for _ in range(BATCH):
            run(inputs)
        sync()

    return run_wait, enqueue_batch


class Floor:
    """Raw pyopencl for one N: z = x + y launched N times with one ``cl.Kernel`` whose arguments are
    set once, on its own queue; holds the buffers (a ``cl.Kernel`` does not keep them alive)."""

    def __init__(self, cl, program, dev, properties: int, n: int, xs, ys):
        import numpy as np

        mf = cl.mem_flags
        self.queue = cl.CommandQueue(dev.context, dev.device, properties=properties)
        self.buffers = [cl.Buffer(dev.context, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a) for a in (xs, ys)]
        self.buffers.append(cl.Buffer(dev.context, mf.READ_WRITE, xs.nbytes))
        self.kernel = cl.Kernel(program, "add")
        self.kernel.set_args(*self.buffers, np.int64(N_ELEMENTS))
        self.block, self.size = (64,), (-(-N_ELEMENTS // 64) * 64,)
        self.enqueue = cl.enqueue_nd_range_kernel
        self.launch(range(n))
        z = np.empty_like(xs)
        cl.enqueue_copy(self.queue, z, self.buffers[2])
        if not np.array_equal(z, xs + ys):
            C.fail(f"pyopencl floor N={n}: wrong output {z[:4]}..., expected x + y")

    def launch(self, count: range) -> None:
        """``len(count)`` enqueues, then wait for the queue."""
        enqueue, queue, kernel, size, block = self.enqueue, self.queue, self.kernel, self.size, self.block
        for _ in count:
            enqueue(queue, kernel, size, block)
        queue.finish()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (seconds)")
    args = ap.parse_args(argv)
    rounds, round_s = (15, 0.005) if args.quick else (60, 0.01)

    load_start = C.loadavg()
    cache = C.isolated_cache()
    registry = C.make_registry(cache)
    from engine.errors import DeviceUnavailableError

    try:
        backend = registry.backend("opencl")
    except DeviceUnavailableError as exc:  # engine-opencl not installed: nothing to measure
        print(f"skipped: {exc}")
        return {}
    avail = backend.availability()
    if not avail.available:
        print(f"skipped: no usable OpenCL device ({avail.reason})")
        return {}
    import engine
    import numpy as np
    import pyopencl as cl

    ref = backend.reference_kernels()["add"]
    dev = backend.opencl_device(0)
    properties = int(backend.current_stream(0).queue.properties)  # the plugin's queues: profiling on
    program = cl.Program(dev.context, ref.source).build(options=["-cl-std=CL1.2"])
    rng = np.random.default_rng(0)
    xs, ys = (rng.integers(-64, 64, N_ELEMENTS).astype(np.float32) for _ in range(2))
    inputs = [engine.asarray(a, device="opencl", registry=registry) for a in (xs, ys)]

    cases = {}
    for n in SIZES:
        graph = build_chain(n, registry, ref)
        cases[f"engine/{n}"], cases[f"engine_enq/{n}"] = engine_cases(graph, n, inputs, xs, ys, registry)
        floor = Floor(cl, program, dev, properties, n, xs, ys)
        cases[f"floor/{n}"] = functools.partial(floor.launch, range(n))
        cases[f"floor_enq/{n}"] = functools.partial(floor.launch, range(n * BATCH))  # BATCH runs, one wait
    timings = C.interleaved(cases, rounds=rounds, round_s=round_s)
    per = {k: BATCH if "_enq/" in k else 1 for k in cases}  # per-run seconds, batches divided out
    t = {k: v.min / per[k] for k, v in timings.items()}
    med = {k: v.median / per[k] for k, v in timings.items()}

    def slope(p: str) -> float:
        return (t[f"{p}/{SIZES[-1]}"] - t[f"{p}/1"]) / (SIZES[-1] - 1)

    rows, table = [], []
    for p in ("engine", "floor", "engine_enq", "floor_enq"):
        f = "floor_enq" if p.endswith("_enq") else "floor"
        over = t[f"{p}/1"] - t[f"{f}/1"]
        row = {"case": p, "label": LABELS[p]}
        for n in SIZES:
            row[f"n{n}_us"] = round(t[f"{p}/{n}"] * 1e6, 3)
            row[f"n{n}_median_us"] = round(med[f"{p}/{n}"] * 1e6, 3)
        row.update(per_kernel_us=round(slope(p) * 1e6, 3), per_kernel_vs_floor=round(slope(p) / slope(f), 3),
                   per_run_overhead_us=round(over * 1e6, 3), n1_vs_floor=round(t[f"{p}/1"] / t[f"{f}/1"], 3))
        rows.append(row)
        table.append([LABELS[p], *(C.us(t[f"{p}/{n}"]) for n in SIZES), C.us(slope(p), 3),
                      C.ratio(slope(p), slope(f)), "-" if p == f else C.us(over), C.ratio(t[f"{p}/1"], t[f"{f}/1"])])
    print(C.format_table(
        ["case (min of rounds, per run)", "N=1 us", f"N={SIZES[-1]} us", "per-kernel us", "vs floor",
         "overhead us", "N=1 vs floor"], table,
        title=f"OpenCL overhead: N chained add kernels, float32[{N_ELEMENTS}], {avail.device_names[0]} "
              f"({rounds} interleaved rounds; enqueue-only: batches of {BATCH} runs, one wait)"))
    print(f"per-kernel = (t({SIZES[-1]}) - t(1)) / {SIZES[-1] - 1}; overhead = t_engine(1) - t_floor(1) "
          "(floor = the pyopencl row of the same mode)")

    def fig(metric: str, value: float, unit: str, digits: int = 2) -> dict:
        return {"metric": metric, "value": round(value, digits), "unit": unit}

    summary = [
        fig("engine per-run overhead (run + wait)", (t["engine/1"] - t["floor/1"]) * 1e6, "us"),
        fig("engine run / floor, N=1 (run + wait)", t["engine/1"] / t["floor/1"], "x"),
        fig("engine per-run overhead (enqueue only)", (t["engine_enq/1"] - t["floor_enq/1"]) * 1e6, "us"),
        fig("engine per-kernel (run + wait)", slope("engine") * 1e6, "us"),
        fig("engine per-kernel / floor (run + wait)", slope("engine") / slope("floor"), "x", 3),
        fig("engine per-kernel / floor (enqueue only)", slope("engine_enq") / slope("floor_enq"), "x", 3),
        fig("floor: one launch + finish", t["floor/1"] * 1e6, "us"),
        fig("floor: per-kernel (run + wait)", slope("floor") * 1e6, "us"),
    ]
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    params = {"sizes": list(SIZES), "n_elements": N_ELEMENTS, "batch": BATCH, "rounds": rounds, "round_s": round_s,
              "statistic": "min", "loadavg_start": load_start, "device": avail.device_names[0],
              "driver": avail.driver, "pyopencl": cl.VERSION_TEXT}
    path = C.write_results(NAME, quick=args.quick, params=params, rows=rows, summary=summary)
    print(f"results: {path.relative_to(C.REPO_ROOT)}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
