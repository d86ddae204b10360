"""Elementwise fusion in the ONNX importer: one kernel per chain against one kernel per node.

Three chains that transformer and CNN exports are full of, on a ``[batch, seq, d]`` float32 tensor:

* ``gelu``: GELU as torch exports it before opset 20 (``Div``/``Erf``/``Add``/``Mul``/``Mul``);
* ``layernorm``: LayerNorm decomposed (``ReduceMean``/``Sub``/``Pow``/``ReduceMean``/``Add``/
  ``Sqrt``/``Div``/``Mul``/``Add``): fusion stops at the reductions and at the per-row statistics;
* ``residual``: bias ``Add``, residual ``Add``, ``Relu``, scale ``Mul``.

Each chain is converted twice and both run in the same rounds, interleaved:

* ``fused``: the model as it is;
* ``per node`` (the floor): the same model with an ``Identity`` after every node. An ``Identity``
  is a view (no kernel, no copy), but it is not elementwise, so no group crosses it: every node is
  its own kernel, as before fusion;

and ONNX Runtime runs the original model with the same thread count (its own GELU and LayerNorm
fusions on). Outputs must agree before anything is timed. ``fused / per node`` below 1 is what
fusion saves: the intermediate tensors' trips through memory and one parallel region per node.

Run: ``python benchmarks/onnx_fusion.py [--quick] [--threads N]`` (``--quick``: a smaller tensor;
results of a ``--threads`` other than the core count go to ``onnx_fusion.t<N>.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "onnx_fusion"
TOL = 1e-4


def chain_model(kind: str, d: int):
    """The ONNX model of one chain, input ``x`` [batch, seq, d] (and ``res`` for ``residual``)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    f32 = TensorProto.FLOAT

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    inputs = [helper.make_tensor_value_info("x", f32, ["batch", "seq", d])]
    if kind == "gelu":
        nodes = [helper.make_node("Div", ["x", "sqrt2"], ["a"]), helper.make_node("Erf", ["a"], ["b"]),
                 helper.make_node("Add", ["b", "one"], ["c"]), helper.make_node("Mul", ["x", "c"], ["e"]),
                 helper.make_node("Mul", ["e", "half"], ["y"])]
        inits = [const("sqrt2", math.sqrt(2)), const("one", 1.0), const("half", 0.5)]
    elif kind == "layernorm":
        nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
                 helper.make_node("Sub", ["x", "mean"], ["dev"]), helper.make_node("Pow", ["dev", "two"], ["sq"]),
                 helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
                 helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"]),
                 helper.make_node("Div", ["dev", "std"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
                 helper.make_node("Add", ["g", "beta"], ["y"])]
        inits = [const("two", 2.0), const("eps", 1e-5), const("gamma", rng.standard_normal(d)),
                 const("beta", rng.standard_normal(d))]
    elif kind == "residual":
        inputs.append(helper.make_tensor_value_info("res", f32, ["batch", "seq", d]))
        nodes = [helper.make_node("Add", ["x", "bias"], ["a"]), helper.make_node("Add", ["a", "res"], ["b"]),
                 helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Mul", ["c", "scale"], ["y"])]
        inits = [const("bias", rng.standard_normal(d)), const("scale", 0.5)]
    else:
        raise ValueError(kind)
    graph = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info("y", f32, ["batch", "seq", d])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def per_node(model):
    """``model`` with an ``Identity`` after every node: the same computation, no group can form."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        outs = list(node.output)
        del node.output[:]
        node.output.extend(o + "_raw" for o in outs)
        nodes.append(node)
        nodes.extend(helper.make_node("Identity", [o + "_raw"], [o]) for o in outs)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def kernel_calls(graph) -> int:
    return len(graph.graph_execution.instructions)


def bench_chain(kind: str, shape: tuple[int, int, int], *, rounds: int, round_s: float) -> dict:
    import numpy as np
    import onnxruntime as ort
    import engine_onnx

    model = chain_model(kind, shape[2])
    fused = engine_onnx.convert(model).build()
    split = engine_onnx.convert(per_node(model)).build()
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ["ENGINE_CPU_NUM_THREADS"])
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {vi.name: rng.standard_normal(shape).astype(np.float32) for vi in model.graph.input}
    args = [feeds[vi.name] for vi in model.graph.input]
    ref = sess.run(None, feeds)[0]
    for label, graph in (("fused", fused), ("per node", split)):
        out = graph.run_async(args)[0].numpy()  # tunes this key
        err = np.abs(out - ref)
        if not np.all(err <= TOL * np.abs(ref) + TOL * np.abs(ref).max()):
            C.fail(f"{kind} ({label}): engine and onnxruntime disagree (max abs difference {err.max():.3g})")
    t = C.interleaved({"fused": lambda: fused.run_async(args), "per node": lambda: split.run_async(args),
                       "ort": lambda: sess.run(None, feeds)}, rounds=rounds, round_s=round_s, warmup=2)
    return {"chain": kind, "shape": list(shape), "kernels_fused": kernel_calls(fused),
            "kernels_per_node": kernel_calls(split), "fused_ms": round(t["fused"].min * 1e3, 4),
            "per_node_ms": round(t["per node"].min * 1e3, 4), "ort_ms": round(t["ort"].min * 1e3, 4),
            "fused_vs_per_node": round(t["fused"].min / t["per node"].min, 3),
            "fused_vs_ort": round(t["fused"].min / t["ort"].min, 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller tensor, fewer rounds")
    ap.add_argument("--threads", type=int, default=None, help="threads for both runtimes (default: the cores)")
    args = ap.parse_args(argv)
    threads = args.threads or int(os.environ.get("ENGINE_CPU_NUM_THREADS") or os.cpu_count() or 1)
    # Read when the CPU plugin is created and when OpenMP starts, both later than this.
    os.environ["ENGINE_CPU_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)
    shape = (2, 64, 256) if args.quick else (8, 128, 768)
    rounds, round_s = (3, 0.2) if args.quick else (7, 0.5)
    load = C.loadavg()
    rows = [bench_chain(kind, shape, rounds=rounds, round_s=round_s) for kind in ("gelu", "layernorm", "residual")]
    print(C.format_table(["chain", "kernels fused / per node", "fused ms", "per node ms", "ort ms",
                          "fused / per node", "fused / ort"],
                         [[r["chain"], f"{r['kernels_fused']} / {r['kernels_per_node']}", f"{r['fused_ms']:.3f}",
                           f"{r['per_node_ms']:.3f}", f"{r['ort_ms']:.3f}", f"{r['fused_vs_per_node']:.2f}x",
                           f"{r['fused_vs_ort']:.2f}x"] for r in rows],
                         title=f"elementwise chains on {list(shape)} float32, {threads} threads (min over rounds)"))
    geo = math.exp(sum(math.log(r["fused_vs_per_node"]) for r in rows) / len(rows))
    summary = [{"metric": "fused / one kernel per node, geometric mean", "value": round(geo, 2), "unit": "x",
                "target": "< 1", "ok": geo < 1}]
    summary += [{"metric": f"{r['chain']}: fused / onnxruntime", "value": r["fused_vs_ort"], "unit": "x"} for r in rows]
    C.print_summary(summary)
    C.warn_if_busy(load)
    cores = os.cpu_count() or 1
    C.write_results(NAME + ("" if threads == cores else f".t{threads}"), quick=args.quick, params={"threads": threads, "shape": list(shape), "rounds": rounds},
                    rows=rows, summary=summary)
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
