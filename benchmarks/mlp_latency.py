"""MLP latency: the demo MLP on engine's fast path vs numpy vs ONNX Runtime, same weights, same run.

``engine.demo.mlp.build_mlp`` (64 -> 128 -> relu -> 10 -> softmax; hand-written C kernels, ``-O3``
without ``-march=native``) at batch 1, 8 and 64:

* ``engine``: ``graph.run_async([x])`` once the batch size is tuned and its fast path prepared;
* floor ``ctypes``: the graph's own five C kernels (the tuned candidates) called from a Python loop
  with prebuilt argument arrays into preallocated buffers (engine minus engine: what it adds);
* ``numpy ref``: ``engine.demo.mlp.reference_mlp`` (float64 accumulation, the correctness reference);
* ``numpy f32``: the same five steps in float32 numpy (the cheapest plain-numpy version); numpy's
  BLAS is limited to one thread (``OPENBLAS_NUM_THREADS=1`` unless set otherwise);
* ``onnxruntime``: MatMul, Add, Relu, MatMul, Add, Softmax built with ``onnx.helper`` from the same
  weights, CPU provider, one intra-op thread (engine's kernels are single-threaded too).

All outputs must agree with the reference within 1e-5 (max abs difference), checked before timing.
Cases are interleaved round by round; the table gives the min over rounds and ratios to engine.

Run: ``python benchmarks/mlp_latency.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

# One thread everywhere: engine's kernels are single-threaded, onnxruntime is given one intra-op
# thread, and numpy's OpenBLAS must not spin threads against them on a 2-core machine. Set before
# numpy is imported; an explicit setting in the environment wins.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
for _var in THREAD_VARS:
    os.environ.setdefault(_var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "mlp_latency"
BATCHES = (1, 8, 64)
TOLERANCE = 1e-5


def numpy_f32(x, w):
    import numpy as np

    h = np.maximum(x @ w["w1"] + w["b1"], np.float32(0))
    z = h @ w["w2"] + w["b2"]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class CtypesFloor:
    """The graph's own five kernels (the candidates tuned for this batch) called from Python with
    prebuilt argument arrays into preallocated buffers: the MLP minus everything engine adds."""

    def __init__(self, graph, w, x):
        import ctypes

        import numpy as np

        b = x.shape[0]
        hidden, classes = w["w1"].shape[1], w["w2"].shape[1]
        self.x = x
        self.h = np.empty((b, hidden), np.float32)
        self.z = np.empty((b, classes), np.float32)
        self.out = np.empty((b, classes), np.float32)
        self.ws = np.empty(b, np.float32)
        self.w = w
        self.sym = (ctypes.c_int64 * 1)(b)
        choice = graph.dispatch_table[(b,)]
        tensors = [(x, w["w1"], self.h), (self.h, w["b1"], self.h), (self.h, w["w2"], self.z),
                   (self.z, w["b2"], self.z), (self.z, self.out)]
        workspaces = [None, None, None, None, ctypes.c_void_p(self.ws.ctypes.data)]
        instructions = graph.graph_execution.instructions
        if len(instructions) != len(tensors):
            C.fail(f"the demo MLP has {len(instructions)} instructions, the floor knows 5")
        self._keep = []
        calls = []
        for ins, ts, ws in zip(instructions, tensors, workspaces):
            task = graph.compiled_tasks[ins.task_idx]
            kernel = task.candidates[choice[ins.task_idx]]
            fn = ctypes.CDLL(str(kernel.library.path))[kernel.spec.entry]
            fn.restype = ctypes.c_int32
            arr = (ctypes.c_void_p * len(ts))(*(a.ctypes.data for a in ts))
            self._keep.append(arr)
            calls.append(functools.partial(fn, arr, self.sym, ws))
        self.calls = tuple(calls)

    def __call__(self):
        for call in self.calls:
            call()
        return self.out


def onnx_mlp(w) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    d_in, hidden = w["w1"].shape
    classes = w["w2"].shape[1]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["z0"]),
        helper.make_node("Add", ["z0", "b2"], ["z"]),
        helper.make_node("Softmax", ["z"], ["probs"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", d_in])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        initializer=[numpy_helper.from_array(w[k], k) for k in ("w1", "b1", "w2", "b2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    ap.add_argument("--no-onnxruntime", action="store_true", help="skip the onnxruntime peer")
    args = ap.parse_args(argv)
    rounds, round_s = (25, 0.002) if args.quick else (100, 0.003)
    import numpy as np

    load_start = C.loadavg()
    cache = C.isolated_cache()
    registry = C.make_registry(cache)
    from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

    w = mlp_weights()
    graph = build_mlp(weights=w, registry=registry).build()
    sess = None
    if not args.no_onnxruntime:
        try:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            sess = ort.InferenceSession(onnx_mlp(w), so, providers=["CPUExecutionProvider"])
        except ImportError as exc:
            print(f"onnxruntime peer skipped: {exc}", file=sys.stderr)

    rng = np.random.default_rng(0)
    cases, diffs = {}, {}
    for b in BATCHES:
        x = rng.standard_normal((b, w["w1"].shape[0])).astype(np.float32)
        ref = reference_mlp(x, w)
        graph.run_async([x])  # tunes this batch size (slow path), then the fast path is prepared
        (y,) = graph.run_async([x])
        outs = {"engine": y.numpy(), "numpy_ref": ref, "numpy_f32": numpy_f32(x, w)}
        cases[f"engine/{b}"] = functools.partial(graph.run_async, [x])
        floor = CtypesFloor(graph, w, x)
        outs["ctypes"] = floor().copy()
        cases[f"ctypes/{b}"] = floor
        cases[f"numpy_ref/{b}"] = functools.partial(reference_mlp, x, w)
        cases[f"numpy_f32/{b}"] = functools.partial(numpy_f32, x, w)
        if sess is not None:
            outs["onnxruntime"] = sess.run(["probs"], {"x": x})[0]
            cases[f"onnxruntime/{b}"] = functools.partial(sess.run, ["probs"], {"x": x})
        diffs[b] = {k: float(np.max(np.abs(v.astype(np.float64) - ref))) for k, v in outs.items()}
        bad = {k: d for k, d in diffs[b].items() if not d <= TOLERANCE}
        if bad:
            C.fail(f"batch {b}: outputs differ from reference_mlp by more than {TOLERANCE}: {bad}")
    before = graph.run_stats()
    timings = C.interleaved(cases, rounds=rounds, round_s=round_s)
    after = graph.run_stats()
    timed = sum(timings[f"engine/{b}"].inner * rounds for b in BATCHES)
    # Every timed engine call must have taken the fast path (a larger batch's workspace makes the
    # smaller ones re-prepare once, during the warm-up calls).
    if after.slow_runs != before.slow_runs or after.fast_runs - before.fast_runs < timed:
        C.fail(f"engine runs left the fast path while timed: before {before}, after {after}")
    t = {k: v.min for k, v in timings.items()}
    kinds = ["engine", "ctypes", "numpy_ref", "numpy_f32"] + (["onnxruntime"] if sess is not None else [])
    table, rows = [], []
    for b in BATCHES:
        e = t[f"engine/{b}"]
        table.append([b, *(C.us(t[f"{k}/{b}"]) for k in kinds),
                      *(C.ratio(e, t[f"{k}/{b}"]) for k in kinds[1:]),
                      f"{max(d for k, d in diffs[b].items() if k != 'numpy_ref'):.1e}"])
        row = {"batch": b}
        for k in kinds:
            row[f"{k}_us"] = timings[f"{k}/{b}"].to_json()
            row[f"{k}_max_abs_diff"] = diffs[b][k]
        for k in kinds[1:]:
            row[f"engine_over_{k}"] = round(e / t[f"{k}/{b}"], 3)
        rows.append(row)
    print(C.format_table(
        ["batch", *(f"{k} us" for k in kinds), *(f"engine/{k}" for k in kinds[1:]), "max |diff|"], table,
        title=f"Demo MLP latency, min of {rounds} interleaved rounds (engine fast path; 1 thread everywhere)"))

    summary = []
    for b in BATCHES:
        summary.append({"metric": f"engine MLP batch {b}", "value": round(t[f"engine/{b}"] * 1e6, 2), "unit": "us"})
        summary.append({"metric": f"engine - ctypes floor, batch {b}",
                        "value": round((t[f"engine/{b}"] - t[f"ctypes/{b}"]) * 1e6, 2), "unit": "us"})
        summary.append({"metric": f"engine / numpy f32, batch {b}",
                        "value": round(t[f"engine/{b}"] / t[f"numpy_f32/{b}"], 2), "unit": "x"})
        if sess is not None:
            summary.append({"metric": f"engine / onnxruntime, batch {b}",
                            "value": round(t[f"engine/{b}"] / t[f"onnxruntime/{b}"], 2), "unit": "x"})
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    path = C.write_results(NAME, quick=args.quick,
                           params={"batches": list(BATCHES), "rounds": rounds, "loadavg_start": load_start, "round_s": round_s,
                                   "statistic": "min", "tolerance": TOLERANCE,
                                   "threads": {v: os.environ.get(v) for v in THREAD_VARS}},
                           rows=rows, summary=summary)
    print(f"results: {path.relative_to(C.REPO_ROOT)}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
