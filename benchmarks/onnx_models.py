"""ONNX models: engine (engine-onnx importer + CPU plugin) vs ONNX Runtime, same thread count, same run.

Models: ONNX's shipped ``light`` set with seeded random weights (``engine_onnx.zoo``; the shipped
constant weights drive activations into denormals, which measures the FPU, not the engine), made
batch-generic (``zoo.batch_generalised``) so both runtimes run batch 1 and 8, plus models written
in torch and exported with dynamic axes (``engine_onnx.zoo``, random weights): ResNet-18 and
MobileNetV2 (``resnet18``, ``mobilenetv2``; 3×224×224), a 4-layer transformer encoder (``encoder``;
d_model 64, 4 heads, sequence 16) and a 4-layer BERT-style encoder (``bert``; hidden 128, vocabulary
1000, sequence 64, int64 token ids and a padded attention mask). A model the importer refuses is
reported (printed and in the results' notes) and the others still run. For each model and batch:

* ``engine``: ``graph.run_async([x])`` after the key is tuned (default tuning options);
* ``onnxruntime``: ``InferenceSession.run`` with ``intra_op_num_threads`` = engine's OpenMP threads
  (``ENGINE_CPU_NUM_THREADS``, set here to the core count), all graph optimisations on.

Outputs must agree (``|engine - ort| <= 1e-4 |ort| + 1e-4 max|ort|``) before anything is timed.
Cases are interleaved round by round; the ratio engine / ORT uses the minimum over rounds.
Before each sample the benchmark sleeps ``--settle-ms`` (default 200) and makes two untimed calls:
both runtimes keep their threads spinning for work after a call returns (ORT's pool for tens of
milliseconds, OpenMP's for a few), and without the pause the first calls of a sample share the
cores with the other runtime's spinning threads. ``--settle-ms 0`` measures that way (the method
of the tables before 2026-12-03), each runtime's first calls after the other's included.
Conversion time is measured for each model cold (an empty kernel cache: every compiler run
included) and warm (the same model again, every kernel a cache hit).

Run: ``python benchmarks/onnx_models.py [--quick] [--models NAME ...] [--threads N]`` (``--quick``:
squeezenet, shufflenet and the encoder, fewer rounds; results of a ``--threads`` other than the
core count go to ``onnx_models.t<N>.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

THREADS = os.cpu_count() or 1

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "onnx_models"
BATCHES = (1, 8)
QUICK = ("squeezenet", "shufflenet", "encoder")
TOL = 1e-4


TORCH_MODELS = ("resnet18", "mobilenetv2", "encoder", "bert")
BERT_SEQ = 64


def load_model(name: str):
    import onnx
    from engine_onnx import zoo

    if name == "encoder":
        return zoo.transformer_encoder(layers=4, seq=16)
    if name == "resnet18":
        return zoo.resnet18()
    if name == "mobilenetv2":
        return zoo.mobilenet_v2()
    if name == "bert":
        return zoo.bert_encoder(layers=4)
    return zoo.batch_generalised(zoo.with_random_weights(onnx.load(zoo.light_model_path(name))))


def input_shape(name: str, batch: int) -> tuple[int, ...]:
    return (batch, 16, 64) if name == "encoder" else (batch, 3, 224, 224)


def model_inputs(name: str, model, batch: int) -> dict:
    """The inputs by graph input name: token ids and a padded 0/1 mask for bert, normal floats otherwise."""
    import numpy as np
    from engine_onnx import zoo

    if name == "bert":
        return zoo.bert_inputs(batch, BERT_SEQ, seed=batch)
    x = np.random.default_rng(batch).standard_normal(input_shape(name, batch)).astype(np.float32)
    return {zoo.graph_inputs(model)[0].name: x}


def bench_model(name: str, *, rounds: int, round_s: float, settle_s: float) -> list[dict]:
    import numpy as np
    import onnxruntime as ort
    import engine_onnx
    from engine_onnx import zoo

    model = load_model(name)
    cache = C.isolated_cache(f"engine-bench-onnx-{name}-")
    t0 = time.perf_counter()
    engine_onnx.convert(model, registry=C.make_registry(cache))  # an empty cache: every kernel compiled
    cold = time.perf_counter() - t0
    registry = C.make_registry(cache)  # a fresh registry on the same directory: disk-cache hits only
    t0 = time.perf_counter()
    builder = engine_onnx.convert(model, registry=registry)
    warm = time.perf_counter() - t0
    graph = builder.build()
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ["ENGINE_CPU_NUM_THREADS"])
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    in_names = [vi.name for vi in zoo.graph_inputs(model)]
    rows = []
    for batch in BATCHES:
        feeds = model_inputs(name, model, batch)
        xs = [feeds[n] for n in in_names]
        ref = sess.run(None, feeds)[0]
        out = graph.run_async(xs)[0].numpy()  # tunes this key
        err = np.abs(out - ref)
        if not np.all(err <= TOL * np.abs(ref) + TOL * np.abs(ref).max()):
            C.fail(f"{name} batch {batch}: engine and onnxruntime disagree (max abs difference {err.max():.3g})")
        t = C.interleaved({"engine": lambda: graph.run_async(xs), "ort": lambda: sess.run(None, feeds)},
                          rounds=rounds, round_s=round_s, warmup=2, settle_s=settle_s)
        rows.append({"model": name, "batch": batch, "engine_ms": round(t["engine"].min * 1e3, 3),
                     "ort_ms": round(t["ort"].min * 1e3, 3), "ratio": round(t["engine"].min / t["ort"].min, 3),
                     "engine_median_ms": round(t["engine"].median * 1e3, 3),
                     "ort_median_ms": round(t["ort"].median * 1e3, 3),
                     "convert_cold_s": round(cold, 2), "convert_warm_s": round(warm, 2)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    from engine_onnx import UnsupportedModelError, zoo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small models, fewer rounds")
    ap.add_argument("--models", nargs="+", choices=(*zoo.LIGHT_MODELS, *TORCH_MODELS), metavar="NAME")
    ap.add_argument("--threads", type=int, default=None,
                    help=f"threads for both runtimes (default: ENGINE_CPU_NUM_THREADS, else the {THREADS} cores)")
    ap.add_argument("--settle-ms", type=float, default=200.0,
                    help="pause before each sample, so the other runtime's threads are idle (0: none)")
    args = ap.parse_args(argv)
    threads = args.threads or int(os.environ.get("ENGINE_CPU_NUM_THREADS") or THREADS)
    # Read when the CPU plugin is created and when OpenMP starts, both later than this.
    os.environ["ENGINE_CPU_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)
    names = args.models or (QUICK if args.quick else (*zoo.LIGHT_MODELS, *TORCH_MODELS))
    rounds, round_s = (3, 0.2) if args.quick else (7, 0.5)
    load = C.loadavg()
    rows, refused = [], []
    for name in names:
        print(f"{name} ...", flush=True)
        try:
            rows.extend(bench_model(name, rounds=rounds, round_s=round_s, settle_s=args.settle_ms / 1e3))
        except UnsupportedModelError as exc:  # reported, not measured; the other models still run
            print(f"{name}: not converted: {exc}", flush=True)
            refused.append(f"{name}: not converted: {exc}")
    if not rows:
        C.fail("no model could be converted: " + "; ".join(refused))
    table = [[r["model"], r["batch"], f"{r['engine_ms']:.2f}", f"{r['ort_ms']:.2f}", f"{r['ratio']:.2f}x",
              f"{r['convert_cold_s']:.1f}", f"{r['convert_warm_s']:.2f}"] for r in rows]
    print(C.format_table(["model", "batch", "engine ms", "ort ms", "engine/ort", "convert cold s",
                          "convert warm s"], table,
                         title=f"ONNX models, {os.environ['ENGINE_CPU_NUM_THREADS']} threads each (min over rounds)"))
    ratios = [r["ratio"] for r in rows]
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    summary = [
        {"metric": "engine / onnxruntime, geometric mean", "value": round(geo, 2), "unit": "x", "target": "<= 1.5",
         "ok": geo <= 1.5},
        {"metric": "engine / onnxruntime, worst", "value": round(max(ratios), 2), "unit": "x", "target": "<= 3",
         "ok": max(ratios) <= 3},
    ]
    for r in rows:
        if r["batch"] == BATCHES[0]:
            summary.append({"metric": f"convert {r['model']} cold / warm", "value":
                            f"{r['convert_cold_s']} / {r['convert_warm_s']}", "unit": "s"})
    C.print_summary(summary)
    C.warn_if_busy(load)
    C.write_results(NAME + ("" if threads == THREADS else f".t{threads}"), quick=args.quick, params={"threads": int(os.environ["ENGINE_CPU_NUM_THREADS"]),
                                                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                                                      "batches": list(BATCHES), "rounds": rounds,
                                                      "settle_ms": args.settle_ms,
                                                      "models": list(names)},
                    rows=rows, summary=summary,
                    notes=["light models with seeded random weights, batch made generic (zoo.batch_generalised)",
                           "resnet18, mobilenetv2, encoder, bert: written in torch (engine_onnx.zoo), random weights, "
                           f"exported with dynamic axes; bert at sequence {BERT_SEQ}", *refused])
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
