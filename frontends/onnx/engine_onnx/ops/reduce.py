"""Reductions: ReduceSum/Mean/Max/Min/Prod/SumSquare/L1/L2 over any axes (attribute or input form,
``keepdims``, ``noop_with_empty_axes``). One pass over the input in memory order accumulating into
the output (strides 0 along reduced axes), so any axis set costs the same loop nest. Max and Min
are branch-free compares (a NaN input is skipped, not propagated). On GPU kinds, one thread per
output element (``gpu_norm.reduce_kernel``) with the same accumulations."""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.dims import dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import gpu_norm
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.kernel_exprs import lit, loop_nest
from engine_onnx.ops.node_args import axes_of
from engine_onnx.ops.registry import register

_INIT = {"ReduceSum": 0, "ReduceMean": 0, "ReduceSumSquare": 0, "ReduceL1": 0, "ReduceL2": 0, "ReduceProd": 1,
         "ReduceMax": -np.inf, "ReduceMin": np.inf}


@register(*_INIT)
def _reduce(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    op = node.op_type
    x = node.input[0]
    dt = ctx.dtype(x)
    t = ctype(dt)
    xs = list(ctx.shape(x))
    input_axes = ctx.opset >= 18 or (op == "ReduceSum" and ctx.opset >= 13)
    axes = axes_of(ctx, node) if input_axes else (list(ctx.attr(node, "axes")) if ctx.attr(node, "axes") else None)
    if not axes:
        if ctx.attr(node, "noop_with_empty_axes", 0):
            ctx.alias(node.output[0], x, xs)
            return
        axes = list(range(len(xs)))
    red = {a % len(xs) for a in axes}
    keep = [1 if i in red else d for i, d in enumerate(xs)]
    out = keep if ctx.attr(node, "keepdims", 1) else [d for i, d in enumerate(xs) if i not in red]
    count = dims_product([xs[i] for i in red])
    if dt.kind == "b" and op not in ("ReduceMax", "ReduceMin"):
        raise NodeUnsupported(f"{op} on bool (only ReduceMax and ReduceMin take bool)")
    init = _INIT[op]
    if dt.kind == "b":
        init = 0 if init < 0 else 1
    elif dt.kind != "f" and np.isinf(init):
        init = np.iinfo(dt).min if init < 0 else np.iinfo(dt).max
    acc = {"ReduceSum": "o + v", "ReduceMean": "o + v", "ReduceSumSquare": "o + v * v", "ReduceL2": "o + v * v",
           "ReduceL1": "o + fabs(v)", "ReduceProd": "o * v", "ReduceMax": "v > o ? v : o",
           "ReduceMin": "v < o ? v : o"}[op]
    if dt.kind != "f":
        acc = acc.replace("fabs(v)", "(v < 0 ? -v : v)")
    if ctx.gpu:
        ctx.emit(gpu_norm.reduce_kernel(op.lower(), xs, red, dt, init, acc, op), [x], [(node.output[0], dt, out)])
        return
    sizes, strides = loop_nest(xs, [keep])
    if not sizes:
        sizes, strides = [1], [[0]]
    idx = [f"i{k}" for k in range(len(sizes))]
    n_out = dims_product(out)
    body = f"    const {t} *restrict X = (const {t} *)t[0]; {t} *restrict Y = ({t} *)t[1];\n"
    body += f"    for (int64_t i = 0; i < {dim_c(n_out)}; i++) Y[i] = {lit(init, dt)};\n    int64_t p = 0;\n"
    for k, size in enumerate(sizes):
        body += "    " * (k + 1) + f"for (int64_t {idx[k]} = 0; {idx[k]} < {dim_c(size)}; {idx[k]}++)\n"
    off = " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, strides[0]) if s != 0) or "0"
    body += "    " * (len(sizes) + 1) + f"{{ const {t} v = X[p++]; {t} o = Y[{off}]; Y[{off}] = {acc}; }}\n"
    if op == "ReduceMean":
        body += f"    for (int64_t i = 0; i < {dim_c(n_out)}; i++) Y[i] /= ({t}){dim_c(count)};\n"
    if op == "ReduceL2":
        body += f"    for (int64_t i = 0; i < {dim_c(n_out)}; i++) Y[i] = ({t})sqrt((double)Y[i]);\n"
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec(op.lower(), source_with_entries("", [("reduce", body)], syms), ("reduce",), syms), [x],
             [(node.output[0], dt, out)])
