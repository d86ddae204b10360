"""BLAS GEMM candidate vs the engine's own: ``gemm_blas`` (OpenBLAS from the scipy-openblas32 wheel,
linked through the CPU plugin's library providers) against ``gemm_blocked`` (``engine_onnx.ops.gemm_c``).

Conv-shaped products ``C[M, N] = A[M, K] @ B[K, N]`` (M output channels, K = input channels x 3 x 3,
N output pixels), as an im2col convolution runs them, with 1 and 2 OpenMP threads (the CPU
plugin's ``num_threads``). Three routines, timed round by round in the same run, each a real
kernel of the CPU ABI loaded through ``CpuBackend`` and called through its prepared launch:

* ``blocked``: ``gemm_blocked``, the floor the ratios are against;
* ``blas``: ``gemm_blas`` as shipped: one column band per OpenMP thread, each a single-threaded
  sgemm;
* ``blas_pool``: ``gemm_blas`` built with ``GEMM_BLAS_OPENBLAS_THREADS``: OpenBLAS threads the whole
  call in its own pool, with OpenMP's thread count.

The figure per shape is ``blocked / blas`` (> 1: BLAS is faster), on the minimum over rounds. Each
thread count is its own phase (a backend with that ``num_threads``), since OpenMP's setting belongs
to the thread that applied it. Results are checked against numpy before timing.

Run: ``python benchmarks/gemm_blas.py [--quick] [--threads 1 2]`` (results in ``benchmarks/results/gemm_blas.json``).
Needs ``pip install scipy-openblas32``; without it the benchmark says so and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "gemm_blas"
#: (M, K, N): VGG/ResNet-like layers, each about 0.23 GFLOP, plus two smaller ones.
SHAPES = [(64, 576, 3136), (128, 1152, 784), (256, 2304, 196), (512, 4608, 49), (64, 576, 784), (256, 2304, 49)]
QUICK_SHAPES = [(64, 576, 3136), (256, 2304, 196), (512, 4608, 49)]

ENTRY = r"""
int32_t ENTRY_NAME(void *const *t, const int64_t *sym, void *ws) {
    (void)ws;
    ROUTINE(sym[0], sym[1], sym[2], (const float *)t[0], sym[2], (const float *)t[1], sym[1], (float *)t[2], sym[1]);
    return 0;
}
"""


def sources() -> dict[str, str]:
    from engine_onnx.codegen import HEADER
    from engine_onnx.ops.gemm_blas import GEMM_BLAS_PREAMBLE
    from engine_onnx.ops.gemm_c import GEMM_PREAMBLE

    def entry(name: str, routine: str) -> str:
        return ENTRY.replace("ENTRY_NAME", name).replace("ROUTINE", routine)

    return {
        "blocked": HEADER + GEMM_PREAMBLE + entry("blocked", "gemm_blocked"),
        "blas": HEADER + GEMM_BLAS_PREAMBLE + entry("blas", "gemm_blas"),
        "blas_pool": ("#define GEMM_BLAS_OPENBLAS_THREADS 1\n" + HEADER + GEMM_BLAS_PREAMBLE
                      + entry("blas_pool", "gemm_blas")),
    }


def load(backend, name: str, source: str):
    from engine.backend import CandidateSpec

    binaries = backend.compile(source, "c", {"openmp": True, "link": ["scipy_openblas32"]}
                               if "engine-cpu: link" in source else {"openmp": True})
    spec = CandidateSpec(name, 0, name, tuple(binaries), None, 2, 1, ("M", "N", "K"), False)
    return backend.load_kernel(spec, 0)


def phase(cache: Path, threads: int, shapes, rounds: int, round_s: float) -> list[dict]:
    from engine_cpu import CpuBackend

    backend = CpuBackend(cache_dir=cache, num_threads=threads)
    kernels = {name: load(backend, name, src) for name, src in sources().items()}
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        expected = a @ b
        cases = {}
        outs = {}
        for name, kernel in kernels.items():
            c = np.zeros((m, n), np.float32)
            launch = kernel.prepare([a.ctypes.data, b.ctypes.data, c.ctypes.data], [m, n, k], None, None)
            outs[name] = c
            cases[name] = launch.call
            launch.call()
            if not np.allclose(c, expected, rtol=1e-3, atol=1e-3 * np.sqrt(k)):
                C.fail(f"{name} at M={m} K={k} N={n} differs from numpy (max error {np.abs(c - expected).max()})")
        timings = C.interleaved(cases, rounds=rounds, round_s=round_s)
        floor = timings["blocked"].min
        gflops = 2 * m * n * k / 1e9
        row = {"threads": threads, "M": m, "K": k, "N": n,
               **{f"{name}_ms": round(t.min * 1e3, 3) for name, t in timings.items()},
               **{f"{name}_gflops": round(gflops / t.min, 1) for name, t in timings.items()},
               "blas_speedup": round(floor / timings["blas"].min, 2),
               "blas_pool_speedup": round(floor / timings["blas_pool"].min, 2)}
        rows.append(row)
        print(f"threads={threads} M={m:4d} K={k:5d} N={n:5d}: blocked {row['blocked_ms']:8.2f} ms "
              f"({row['blocked_gflops']} GFLOP/s), blas {row['blas_ms']:8.2f} ms ({row['blas_speedup']}x), "
              f"blas_pool {row['blas_pool_ms']:8.2f} ms ({row['blas_pool_speedup']}x)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, fewer and shorter rounds")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OpenMP thread counts (default 1 2)")
    args = ap.parse_args()
    from engine_onnx.ops.gemm_blas import blas_available

    problem = blas_available()
    if problem is not None:
        C.fail(problem)
    cache = C.isolated_cache()
    load_start = C.loadavg()
    shapes, rounds, round_s = (QUICK_SHAPES, 3, 0.05) if args.quick else (SHAPES, 7, 0.2)
    rows = [row for threads in args.threads for row in phase(cache, threads, shapes, rounds, round_s)]
    C.warn_if_busy(load_start)

    def geomean(key: str, threads: int) -> float:
        values = [r[key] for r in rows if r["threads"] == threads]
        return round(float(np.exp(np.mean(np.log(values)))), 2)

    summary = [{"metric": f"{key} vs gemm_blocked, {t} thread{'s' if t > 1 else ''} (geomean)",
                "value": geomean(f"{key}_speedup", t), "unit": "x"}
               for t in args.threads for key in ("blas", "blas_pool")]
    print(C.format_table(["threads", "M", "K", "N", "blocked ms", "blas ms", "blas_pool ms", "blas x", "pool x"],
                         [[r["threads"], r["M"], r["K"], r["N"], r["blocked_ms"], r["blas_ms"], r["blas_pool_ms"],
                           r["blas_speedup"], r["blas_pool_speedup"]] for r in rows]))
    C.print_summary(summary)
    path = C.write_results(NAME, quick=args.quick, params={"rounds": rounds, "round_s": round_s,
                                                            "threads": args.threads,
                                                            "shapes": [list(s) for s in shapes],
                                                            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "")},
                           rows=rows, summary=summary, notes=[f"load average at start {load_start}"])
    print(f"results: {path}")


if __name__ == "__main__":
    main()
