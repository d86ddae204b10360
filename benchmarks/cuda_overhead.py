"""CUDA overhead: what engine adds on top of the CUDA driver, against raw launches in the same run.

Needs a CUDA device (the engine-cuda plugin reports one); without it this prints ``no GPU: <reason>``,
writes a JSON document marked ``"skipped": true`` (``--json``) and exits 0.

Sections (issue 10's performance targets; every figure is a ratio to a floor measured in the same
rounds, alternating engine and floor):

* **chain**: a graph of N = 1, 100, 1000 launches of the plugin's reference ``add`` kernel on 256
  floats (``v <- add(v, y)``). Host time of one ``graph.run_async`` (the enqueue; the device is
  synchronised between samples, outside the timed region) against a raw Python loop over N
  ``cuLaunchKernel`` calls of the same ``CUfunction`` (``CompiledTask.candidates[0].function``)
  with argument arrays built beforehand, on the same stream, in two forms: ``ctypes`` on libcuda
  (the fastest Python can launch; the plugin's own path) and ``cuda.bindings.driver.cuLaunchKernel``
  (what a cuda-python user writes). Per-kernel cost = (t(1000) - t(1)) / 999 for each;
  fixed per-run overhead = t_engine(1) - t_ctypes(1).
* **capture**: ``graph.capture(...)`` of the N = 16 chain, ``replay()`` against a raw
  ``cuGraphLaunch`` of a graph recorded from the same 16 raw launches (host time per call, then
  replay + synchronize latency).
* **mlp**: the demo model at batch 1 and 64, run + synchronize latency: engine ``run_async``, engine
  captured replay, torch eager (same weights, same math) and torch CUDA graph replay.

Run: ``python benchmarks/cuda_overhead.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "cuda_overhead"
CHAIN = (1, 100, 1000)
CAPTURE_N = 16
N_ELEMENTS = 256
TARGETS = {"per_kernel_ratio": 1.2, "fixed_us": 10.0, "replay_ratio": 1.1}


def cuda_unusable(registry) -> str | None:
    """Why CUDA cannot be benchmarked here (the plugin's own reason), or None."""
    try:
        backend = registry.backend("cuda")
    except Exception as exc:  # noqa: BLE001 - the reason is the output
        return f"the engine-cuda plugin is not usable: {exc}"
    avail = backend.availability()
    return None if avail.available else (avail.reason or "the cuda plugin reports no device")


def host_times(cases: Mapping[str, Callable[[], Any]], sync: Callable[[], None], rounds: int,
               per_round: int) -> dict[str, list[float]]:
    """Host seconds of one call of each case (device synchronised before each, outside the timing),
    alternating the cases' order round by round; GC off."""
    for fn in cases.values():
        fn()
        sync()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                fn = cases[name]
                for _ in range(per_round):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
                sync()
    finally:
        if enabled:
            gc.enable()
    return samples


def stat(samples: list[float]) -> dict[str, float]:
    return {"min_us": round(min(samples) * 1e6, 3), "median_us": round(statistics.median(samples) * 1e6, 3)}


# -- raw driver floors --------------------------------------------------------------------------------
class Raw:
    """Raw CUDA driver calls (cuda.bindings, and ctypes on libcuda) for the floors."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.keep: list[Any] = []

    def check(self, result: tuple) -> Any:
        if int(result[0]) != 0:
            raise RuntimeError(f"CUDA driver call failed: {result[0]!r}")
        return result[1] if len(result) == 2 else (result[1:] or None)

    def alloc(self, nbytes: int) -> int:
        return int(self.check(self.cu.cuMemAlloc(nbytes)))

    def params(self, *args: Any) -> int:
        """A ``void **`` kernel parameter array over ctypes values (kept alive), as an address."""
        values = [a for a in args]
        array = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self.keep.append((values, array))
        return ctypes.addressof(array)

    def ctypes_launcher(self, function: int, grid: int, block: int, stream: int, params: int) -> Callable[[], int]:
        vp, ui = ctypes.c_void_p, ctypes.c_uint
        return functools.partial(self.lib.cuLaunchKernel, vp(function), ui(grid), ui(1), ui(1), ui(block), ui(1),
                                 ui(1), ui(0), vp(stream or None), vp(params), vp(None))

    def bindings_launcher(self, function: int, grid: int, block: int, stream: int, params: int) -> Callable[[], Any]:
        cu = self.cu
        return functools.partial(cu.cuLaunchKernel, cu.CUfunction(function), grid, 1, 1, block, 1, 1, 0,
                                 cu.CUstream(stream), params, 0)

    def record(self, launches: list[Callable[[], int]], stream: int) -> Callable[[], int]:
        """A graph recorded from ``launches`` on ``stream``; returns a ctypes cuGraphLaunch partial."""
        cu = self.cu
        self.check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for launch in launches:
            code = launch()
            if code:
                raise RuntimeError(f"cuLaunchKernel during capture returned {code}")
        graph = self.check(cu.cuStreamEndCapture(stream))
        graph_exec = self.check(cu.cuGraphInstantiate(graph, 0))
        self.keep.append((graph, graph_exec))
        return functools.partial(self.lib.cuGraphLaunch, ctypes.c_void_p(int(graph_exec)),
                                 ctypes.c_void_p(stream or None))

    def synchronize(self) -> None:
        self.check(self.cu.cuCtxSynchronize())


# -- sections -----------------------------------------------------------------------------------------
def chain_graph(n: int, registry, ref):
    from engine.build import GraphBuilder

    b = GraphBuilder(f"cuda_chain_{n}", registry=registry)
    x = b.input("x", "float32", ["n"], device="cuda")
    y = b.input("y", "float32", ["n"], device="cuda")
    k = b.kernel("add", device="cuda", entries=list(ref.entries), source=ref.source, language=ref.language,
                 launch=ref.launch)
    v = x
    for _ in range(n):
        (v,) = b.call(k, [v, y], [("float32", ["n"])], symbols=["n"])
    b.output(v, "z")
    return b.build(device="cuda")


def raw_chain(raw: Raw, function: int, n: int, stream: int, x: int, y: int, kind: str) -> list[Callable[[], Any]]:
    """N launches of ``add`` ping-ponging between two buffers, the first reading ``x``."""
    bufs = [raw.alloc(N_ELEMENTS * 4) for _ in range(2)]
    grid, block = max(-(-N_ELEMENTS // 256), 1), 256
    make = raw.ctypes_launcher if kind == "ctypes" else raw.bindings_launcher
    launches, src = [], x
    for i in range(n):
        dst = bufs[i % 2]
        params = raw.params(ctypes.c_void_p(src), ctypes.c_void_p(y), ctypes.c_void_p(dst), ctypes.c_int64(N_ELEMENTS))
        launches.append(make(function, grid, block, stream, params))
        src = dst
    return launches


def run_loop(launches: list[Callable[[], Any]]) -> Callable[[], None]:
    def run() -> None:
        for launch in launches:
            launch()
    return run


def section_chain(registry, backend, raw: Raw, quick: bool, result: dict, summary: list) -> None:
    import numpy as np

    import engine

    ref = backend.reference_kernels()["add"]
    x_host = np.arange(N_ELEMENTS, dtype=np.float32)
    y_host = np.ones(N_ELEMENTS, np.float32)
    xd = engine.asarray(x_host, device="cuda", registry=registry)
    yd = engine.asarray(y_host, device="cuda", registry=registry)
    stream = int(backend.current_stream(0))
    rows = {}
    for n in CHAIN:
        graph = chain_graph(n, registry, ref)
        (z,) = graph.run_async([xd, yd])
        np.testing.assert_allclose(z.numpy(), x_host + n * y_host)
        function = int(graph.compiled_tasks[0].candidates[0].function)
        def engine_run(graph: Any = graph) -> None:
            graph.run_async([xd, yd])

        cases: dict[str, Callable[[], Any]] = {
            "engine": engine_run,
            "ctypes": run_loop(raw_chain(raw, function, n, stream, int(xd.addr), int(yd.addr), "ctypes")),
        }
        try:  # the cuda.bindings floor is informative: if these bindings take no raw address, record why
            bindings = run_loop(raw_chain(raw, function, n, stream, int(xd.addr), int(yd.addr), "bindings"))
            bindings()
            cases["bindings"] = bindings
        except Exception as exc:  # noqa: BLE001
            result["errors"]["chain.bindings"] = f"{type(exc).__name__}: {exc}"
        per_round = 20 if n == 1000 else 100
        samples = host_times(cases, raw.synchronize, rounds=2 if quick else 6,
                             per_round=per_round // (4 if quick else 1))
        rows[n] = {name: stat(s) for name, s in samples.items()}
        graph.close()
    result["chain"] = rows
    lo, hi = CHAIN[0], CHAIN[-1]

    def per_kernel(name: str) -> float:
        return (rows[hi][name]["min_us"] - rows[lo][name]["min_us"]) / (hi - lo)

    pk = {name: round(per_kernel(name), 3) for name in rows[hi] if name in rows[lo]}
    fixed = round(rows[lo]["engine"]["min_us"] - rows[lo]["ctypes"]["min_us"], 3)
    result["per_kernel_us"] = pk
    result["fixed_per_run_us"] = fixed
    ratio = pk["engine"] / pk["ctypes"] if pk["ctypes"] > 0 else float("inf")
    summary += [
        {"metric": "per-kernel launch, engine run_async", "value": pk["engine"], "unit": "us"},
        {"metric": "per-kernel launch, raw ctypes cuLaunchKernel", "value": pk["ctypes"], "unit": "us"},
        {"metric": "per-kernel launch, raw cuda.bindings cuLaunchKernel", "value": pk.get("bindings", "-"),
         "unit": "us"},
        {"metric": "per-kernel ratio engine / raw ctypes loop", "value": round(ratio, 3), "unit": "x",
         "target": f"<= {TARGETS['per_kernel_ratio']}", "ok": ratio <= TARGETS["per_kernel_ratio"]},
        {"metric": "fixed per-run overhead (N=1, engine - raw ctypes)", "value": fixed, "unit": "us",
         "target": f"<= {TARGETS['fixed_us']}", "ok": fixed <= TARGETS["fixed_us"]},
    ]


def section_capture(registry, backend, raw: Raw, quick: bool, result: dict, summary: list) -> None:
    import numpy as np

    import engine

    ref = backend.reference_kernels()["add"]
    x_host = np.arange(N_ELEMENTS, dtype=np.float32)
    xd = engine.asarray(x_host, device="cuda", registry=registry)
    yd = engine.asarray(np.ones(N_ELEMENTS, np.float32), device="cuda", registry=registry)
    graph = chain_graph(CAPTURE_N, registry, ref)
    graph.run_async([xd, yd])
    captured = graph.capture(xd, yd)
    captured.replay()
    np.testing.assert_allclose(captured.outputs[0].numpy(), x_host + CAPTURE_N)
    stream = int(backend.current_stream(0))
    function = int(graph.compiled_tasks[0].candidates[0].function)
    raw_graph = raw.record(raw_chain(raw, function, CAPTURE_N, stream, int(xd.addr), int(yd.addr), "ctypes"), stream)
    cases = {"engine replay": captured.replay, "raw cuGraphLaunch": raw_graph}
    samples = host_times(cases, raw.synchronize, rounds=2 if quick else 6, per_round=50 if quick else 200)
    rows = {name: stat(s) for name, s in samples.items()}

    def with_sync(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            fn()
            raw.synchronize()
        return run

    latency = C.interleaved({k: with_sync(v) for k, v in cases.items()}, rounds=3 if quick else 9,
                            round_s=0.02 if quick else 0.05)
    result["capture"] = {"host": rows, "latency": {k: t.to_json() for k, t in latency.items()},
                         "method": captured.method}
    ratio = rows["engine replay"]["min_us"] / rows["raw cuGraphLaunch"]["min_us"]
    summary.append({"metric": f"captured replay host time / raw cuGraphLaunch (N={CAPTURE_N})",
                    "value": round(ratio, 3), "unit": "x", "target": f"<= {TARGETS['replay_ratio']}",
                    "ok": ratio <= TARGETS["replay_ratio"]})
    captured.close()
    graph.close()


def section_mlp(registry, backend, raw: Raw, quick: bool, result: dict, summary: list) -> None:
    import numpy as np

    import engine
    from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

    weights = mlp_weights()
    graph = build_mlp(weights=weights, registry=registry, device="cuda").build(device="cuda")
    try:
        import torch
        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    rows = {}
    for batch in (1, 64):
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        xd = engine.asarray(x, device="cuda", registry=registry)
        (probs,) = graph.run_async([xd])
        np.testing.assert_allclose(probs.numpy(), reference_mlp(x, weights), rtol=1e-4, atol=1e-6)
        captured = graph.capture(xd)

        def engine_run(xd=xd) -> None:
            graph.run_async([xd])
            raw.synchronize()

        def engine_replay(captured=captured) -> None:
            captured.replay()
            raw.synchronize()

        cases: dict[str, Callable[[], None]] = {"engine run_async": engine_run, "engine captured replay": engine_replay}
        if has_torch:
            tw = {k: torch.from_numpy(v).cuda() for k, v in weights.items()}
            tx = torch.from_numpy(x).cuda()

            def model(t):
                h = torch.relu(t @ tw["w1"] + tw["b1"])
                return torch.softmax(h @ tw["w2"] + tw["b2"], dim=1)

            with torch.no_grad():
                np.testing.assert_allclose(model(tx).cpu().numpy(), reference_mlp(x, weights), rtol=1e-4, atol=1e-6)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        model(tx)
                torch.cuda.current_stream().wait_stream(side)
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    model(tx)

            def torch_eager(tx=tx, model=model) -> None:
                with torch.no_grad():
                    model(tx)
                torch.cuda.synchronize()

            def torch_graph(cuda_graph=cuda_graph) -> None:
                cuda_graph.replay()
                torch.cuda.synchronize()

            cases["torch eager"] = torch_eager
            cases["torch CUDA graph"] = torch_graph
        timings = C.interleaved(cases, rounds=3 if quick else 9, round_s=0.02 if quick else 0.1)
        rows[batch] = {k: t.to_json() for k, t in timings.items()}
        for name, t in timings.items():
            summary.append({"metric": f"mlp batch={batch}: {name} (run + sync)", "value": round(t.min * 1e6, 2),
                            "unit": "us"})
        captured.close()
    result["mlp"] = rows
    if not has_torch:
        result.setdefault("notes", []).append("torch with CUDA is not available: the torch rows are absent")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs")
    ap.add_argument("--json", metavar="PATH", help="also write the results document here")
    args = ap.parse_args(argv)

    cache = C.isolated_cache()
    registry = C.make_registry(cache)
    reason = cuda_unusable(registry)
    if reason is not None:
        print(f"no GPU: {reason}")
        doc = {"benchmark": NAME, "skipped": True, "reason": reason, "summary": []}
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        if args.quick:  # for run_all's table; a full run never overwrites recorded GPU figures with a skip
            C.write_results(NAME, quick=True, params={}, rows=[], notes=[f"skipped: {reason}"],
                            summary=[{"metric": "skipped (no GPU)", "value": reason[:80], "unit": ""}])
        return 0

    backend = registry.backend("cuda")
    raw = Raw()
    result: dict[str, Any] = {"device": backend.availability().device_names[0],
                              "driver": backend.availability().driver, "errors": {}}
    summary: list[dict[str, Any]] = []
    for name, section in (("chain", section_chain), ("capture", section_capture), ("mlp", section_mlp)):
        t0 = time.perf_counter()
        try:
            section(registry, backend, raw, args.quick, result, summary)
        except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)

    C.print_summary(summary)
    doc = {"benchmark": NAME, "skipped": False, "quick": args.quick, "summary": summary, **result}
    C.write_results(NAME, quick=args.quick, params={"chain": CHAIN, "capture_n": CAPTURE_N, "elements": N_ELEMENTS},
                    rows=[{"section": k, "data": result.get(k)} for k in ("chain", "capture", "mlp")],
                    summary=summary, notes=[f"{k}: {v}" for k, v in result["errors"].items()])
    if args.json:
        Path(args.json).write_text(json.dumps({**doc, "machine": C.machine_info()}, indent=1, default=str) + "\n")
    return 1 if any(not k.endswith(".bindings") for k in result["errors"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
