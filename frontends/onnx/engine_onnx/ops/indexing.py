"""Index-producing reductions: ArgMax, ArgMin (``keepdims``, ``select_last_index``) and TopK
(``k`` known at import, ``largest``, ``sorted``), for every numeric dtype; indices are int64.

Each (outer, inner) line along the axis is scanned once. TopK keeps the best ``k`` so far in the
workspace, sorted by (value, then the lower index first, as ONNX orders equal values), inserting by
shifting: ``O(n·k)`` in the worst case, ``O(n)`` when most values do not enter the top k, which is
the usual case for the small ``k`` models use (a classifier's top 5). The output is always sorted,
which ``sorted=0`` (order unspecified) also allows. NaN inputs are never selected.

On GPU kinds (``gpu_indexing``) one thread per line does the same scan: ArgMax/ArgMin as here,
TopK with its best ``k`` in per-thread arrays (so ``k`` is bounded there).
"""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gpu_indexing import TOPK_MAX_K, arg_kernel, topk_kernel
from engine_onnx.ops.registry import register

I64 = np.dtype("int64")


def _numeric(node, dt: np.dtype) -> None:
    if dt.kind not in "fiu":
        raise NodeUnsupported(f"{node.op_type} on {dt.name} (numeric types only)")


@register("ArgMax", "ArgMin")
def _arg(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x = node.input[0]
    dt = ctx.dtype(x)
    _numeric(node, dt)
    xs = list(ctx.shape(x))
    axis = int(ctx.attr(node, "axis", 0)) % len(xs)
    keep = int(ctx.attr(node, "keepdims", 1))
    last = int(ctx.attr(node, "select_last_index", 0))
    t = ctype(dt)
    outer, dim, inner = dims_product(xs[:axis]), xs[axis], dims_product(xs[axis + 1:])
    if dim == 0:
        raise NodeUnsupported(f"{node.op_type} along an empty axis ({axis})")
    cmp = (">" if node.op_type == "ArgMax" else "<") + ("=" if last else "")
    out = [1 if i == axis else d for i, d in enumerate(xs)] if keep else [d for i, d in enumerate(xs) if i != axis]
    if ctx.gpu:
        ctx.emit(arg_kernel(node.op_type.lower(), xs, axis, dt, cmp), [x], [(node.output[0], I64, out)])
        return
    load = "(float)x[j * I]" if dt.name == "float16" else "x[j * I]"
    vt = "float" if dt.name == "float16" else t
    body = f"""    const {t} *restrict X = (const {t} *)t[0]; int64_t *restrict Y = (int64_t *)t[1];
    const int64_t D = {dim_c(dim)}, I = {dim_c(inner)};
    for (int64_t q = 0; q < {dim_c(outer)} * I; q++) {{
        const {t} *x = X + (q / I) * D * I + q % I;
        int64_t best = 0; {vt} bv = {load.replace("j * I", "0")};
        for (int64_t j = 1; j < D; j++) {{
            const {vt} v = {load};
            if (v {cmp} bv || bv != bv) {{ bv = v; best = j; }}
        }}
        Y[q] = best;
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec(node.op_type.lower(), source_with_entries("", [("arg", body)], syms), ("arg",), syms),
             [x], [(node.output[0], I64, out)])


@register("TopK")
def _topk(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x = node.input[0]
    dt = ctx.dtype(x)
    _numeric(node, dt)
    xs = list(ctx.shape(x))
    axis = int(ctx.attr(node, "axis", -1)) % len(xs)
    if ctx.opset < 10:
        k = int(ctx.attr(node, "k"))
    else:
        k = int(ctx.require_const(node.input[1], "the TopK k").reshape(-1)[0])
    dim = xs[axis]
    if isinstance(dim, Mono):
        raise NodeUnsupported(f"TopK along dynamic axis {axis}")
    if not 0 <= k <= dim:
        raise NodeUnsupported(f"k={k} outside [0, {dim}] (the size of axis {axis})")
    largest = int(ctx.attr(node, "largest", 1))
    out = [k if i == axis else d for i, d in enumerate(xs)]
    outs = [(node.output[0], dt, out)]
    outs.append((node.output[1] if len(node.output) > 1 and node.output[1] else f"{node.output[0]}#indices",
                 I64, out))
    if ctx.gpu:
        if not 0 < k <= TOPK_MAX_K:
            raise NodeUnsupported(f"TopK with k={k} on GPU kinds (1 to {TOPK_MAX_K}: each thread keeps its "
                                  f"top k in registers)")
        ctx.emit(topk_kernel(xs, axis, k, dt, bool(largest)), [x], outs)
        return
    t = ctype(dt)
    vt = "float" if dt.name == "float16" else t
    outer, inner = dims_product(xs[:axis]), dims_product(xs[axis + 1:])
    better = ">" if largest else "<"
    body = f"""    const {t} *restrict X = (const {t} *)t[0]; {t} *restrict V = ({t} *)t[1];
    int64_t *restrict Ix = (int64_t *)t[2];
    int64_t *bi = (int64_t *)ws; {vt} *bv = ({vt} *)(bi + {max(k, 1)});
    const int64_t D = {dim}, I = {dim_c(inner)}, K = {k};
    for (int64_t q = 0; q < {dim_c(outer)} * I; q++) {{
        const {t} *x = X + (q / I) * D * I + q % I;
        int64_t n = 0;
        for (int64_t j = 0; j < D && K > 0; j++) {{
            const {vt} v = x[j * I];
            if (v != v) continue;
            if (n == K && !(v {better} bv[K - 1])) continue;
            int64_t p = n < K ? n++ : K - 1;
            while (p > 0 && v {better} bv[p - 1]) {{ bv[p] = bv[p - 1]; bi[p] = bi[p - 1]; p--; }}
            bv[p] = v; bi[p] = j;
        }}
        for (int64_t j = 0; j < K; j++) {{
            const int64_t o = (q / I) * K * I + j * I + q % I;
            V[o] = j < n ? ({t})bv[j] : ({t})0; Ix[o] = j < n ? bi[j] : 0;
        }}
    }}
"""
    syms = tuple(symbols_of(xs))
    itemsize = 4 if dt.name == "float16" else dt.itemsize
    ws = max(k, 1) * (itemsize + 8) + 16
    spec = KernelSpec("topk", source_with_entries("", [("topk", body)], syms), ("topk",), syms, ws)
    ctx.emit(spec, [x], outs)
