"""The importer's GEMM routines (``engine_onnx.ops.gemm_c``) against numpy's matmul (its BLAS).

Each shape is a MatMul ``[M, K] @ [K, N]`` (the weight a constant, as in a model) converted by
``engine_onnx`` and run by the CPU plugin with one candidate forced through the dispatch table
(``mm_simple``, ``mm_blocked``, ``mm_packed``, and any routine added to ``GEMM_CANDIDATES`` later);
the floor is ``numpy.matmul`` on the same operands with the same thread count, in the same rounds.
The shapes are the GEMMs behind the convolutions of ResNet-50 and SqueezeNet at batch 1 (M output
channels, N output pixels, K input channels x kernel taps) plus a classifier head. Reported:
GFLOP/s per routine and the ratio numpy time / routine time (above 1: faster than numpy).

Run: ``python benchmarks/onnx_gemm.py [--quick] [--threads N]`` (default: one thread, the
kernel's own speed; results of ``--threads`` other than 1 go to ``onnx_gemm.t<N>.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "onnx_gemm"
SHAPES = (  # (M, N, K): conv output channels, output pixels, reduction
    (64, 3136, 576),    # resnet50 layer1 3x3
    (256, 3136, 64),    # resnet50 layer1 1x1 expand
    (128, 784, 1152),   # resnet50 layer2 3x3
    (256, 196, 2304),   # resnet50 layer3 3x3
    (512, 49, 4608),    # resnet50 layer4 3x3 (few pixels)
    (64, 3025, 144),    # squeezenet fire expand 3x3
    (1000, 169, 512),   # squeezenet classifier conv
    (1, 1000, 2048),    # classifier head at batch 1
)
QUICK = SHAPES[:1] + SHAPES[3:5] + SHAPES[6:7]


def bench_shape(m: int, n: int, k: int, *, rounds: int, round_s: float) -> dict:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    import engine_onnx

    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    graph_def = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        initializer=[onnx.numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph_def, opset_imports=[helper.make_opsetid("", 17)])
    builder = engine_onnx.convert(model, registry=C.make_registry(Path(os.environ["ENGINE_CACHE_DIR"])))
    ref = a @ b
    cases = {"numpy": lambda: np.matmul(a, b)}
    entries: list[str] = []
    for index in range(builder.build().dispatch_table.candidates_per_task[0]):
        graph = builder.build()
        graph.dispatch_table.record((), (index,))
        entry = graph.compiled_tasks[0].meta.candidates[index].entry
        out = graph.run_async([a])[0].numpy()
        if not np.allclose(out, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max())):
            C.fail(f"{entry} on {m}x{n}x{k}: wrong result (max abs difference {np.abs(out - ref).max():.3g})")
        cases[entry] = (lambda g: lambda: g.run_async([a]))(graph)
        entries.append(entry)
    t = C.interleaved(cases, rounds=rounds, round_s=round_s, warmup=2)
    flop = 2.0 * m * n * k
    row: dict = {"m": m, "n": n, "k": k, "numpy_gflops": round(flop / t["numpy"].min * 1e-9, 1)}
    for entry in entries:
        row[f"{entry}_gflops"] = round(flop / t[entry].min * 1e-9, 1)
        row[f"{entry}_vs_numpy"] = round(t["numpy"].min / t[entry].min, 3)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="four shapes, fewer rounds")
    ap.add_argument("--threads", type=int, default=1, help="threads for the engine and numpy (default 1)")
    args = ap.parse_args(argv)
    threads = str(args.threads)
    # Read when the CPU plugin is created and when numpy's BLAS and OpenMP start, all later than this.
    for var in ("ENGINE_CPU_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads
    C.isolated_cache("engine-bench-onnx-gemm-")
    rounds, round_s = (3, 0.1) if args.quick else (5, 0.3)
    load = C.loadavg()
    rows = []
    for m, n, k in (QUICK if args.quick else SHAPES):
        print(f"{m}x{n}x{k} ...", flush=True)
        rows.append(bench_shape(m, n, k, rounds=rounds, round_s=round_s))
    entries = [key[: -len("_gflops")] for key in rows[0] if key.endswith("_gflops") and key != "numpy_gflops"]
    table = [[f"{r['m']}x{r['n']}x{r['k']}", f"{r['numpy_gflops']:.1f}",
              *(f"{r[e + '_gflops']:.1f} ({r[e + '_vs_numpy']:.2f})" for e in entries)] for r in rows]
    print(C.format_table(["M x N x K", "numpy GFLOP/s", *(f"{e} GFLOP/s (vs numpy)" for e in entries)], table,
                         title=f"GEMM routines, {threads} thread(s) each (min over rounds)"))
    summary = []
    for e in entries:
        geo = math.exp(sum(math.log(r[e + "_vs_numpy"]) for r in rows) / len(rows))
        summary.append({"metric": f"{e}: numpy time / {e} time, geometric mean", "value": round(geo, 2),
                        "unit": "x"})
    C.print_summary(summary)
    C.warn_if_busy(load)
    C.write_results(NAME + ("" if args.threads == 1 else f".t{args.threads}"), quick=args.quick,
                    params={"threads": args.threads, "rounds": rounds, "shapes": [list(s) for s in SHAPES]},
                    rows=rows, summary=summary,
                    notes=["MatMul with a constant [K, N] weight; one candidate forced per graph through "
                           "graph.dispatch_table; numpy.matmul with the same thread count is the floor"])
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
