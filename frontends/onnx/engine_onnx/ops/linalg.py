"""MatMul and Gemm (float32): one kernel per shape with two candidates, ``simple`` and ``blocked``
(see ``gemm_c``), so the runtime's tuner picks per shape. A constant Gemm weight used transposed
(``transB=1``, what every classifier head exports) is transposed once at import, so every
candidate reads ``B`` as ``[K, N]``. Bias, ``alpha``/``beta`` and a following activation are
applied in one pass after the product, inside the same kernel; so is a MatMul's constant bias
``Add`` along the last axis (torch's ``Linear``: ``MatMul`` then ``Add``). On GPU kinds the same
fusions go into the kernels of ``gpu_linalg``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, kernel_sources
from engine_onnx.dims import Dim, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import gpu_linalg
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gemm_c import GEMM_CANDIDATES, GEMM_PREAMBLE, OWN_BINARY_ROUTINES
from engine_onnx.ops.kernel_exprs import broadcast_shape, lit, loop_nest
from engine_onnx.ops.registry import register
from engine_onnx.ops.shape import strided_copy_source

__all__ = ["matmul_source"]

F32 = np.dtype("float32")


def _epilogue_loop(rows: Dim, n: Dim, out: str, alpha: float, bias: str | None, bias_strides: Sequence[Dim],
                   ep: Callable[[str], str]) -> str:
    v = "y[j]" if alpha == 1.0 else f"{lit(alpha, F32)} * y[j]"
    if bias is not None:
        off = " + ".join(f"{ix} * {dim_c(s)}" for ix, s in zip(("i", "j"), bias_strides) if s != 0) or "0"
        v = f"{v} + {bias}[{off}]"
    expr = ep(v)
    if expr == "y[j]":
        return ""
    return (f"    for (int64_t i = 0; i < {dim_c(rows)}; i++) {{\n        float *y = {out} + i * {dim_c(n)};\n"
            f"        for (int64_t j = 0; j < {dim_c(n)}; j++) y[j] = {expr};\n    }}\n")


def matmul_source(batch: Sequence[Dim], a_batch: Sequence[Dim], b_batch: Sequence[Dim], m: Dim, k: Dim, n: Dim,
                  epilogue: str, has_bias: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
    sizes, strides = loop_nest(batch, [a_batch, b_batch]) if batch else ([], [[], []])
    bodies = []
    out_slot = 3 if has_bias else 2
    for entry, fn in GEMM_CANDIDATES:
        body = (f"    const float *A = (const float *)t[0], *B = (const float *)t[1];\n"
                f"    float *Y = (float *)t[{out_slot}];\n")
        if has_bias:
            body += "    const float *bias = (const float *)t[2]; (void)bias;\n"
        idx = [f"b{q}" for q in range(len(sizes))]
        for q, size in enumerate(sizes):
            body += "    " * (q + 1) + f"for (int64_t {idx[q]} = 0; {idx[q]} < {dim_c(size)}; {idx[q]}++)\n"
        lin = "0"
        run: Dim = 1
        terms = []
        for q in range(len(sizes) - 1, -1, -1):
            terms.append(f"{idx[q]} * {dim_c(run)}")
            run = run * sizes[q]
        lin = " + ".join(terms) or "0"
        oa = " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, strides[0]) if s != 0) or "0"
        ob = " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, strides[1]) if s != 0) or "0"
        body += ("    " * (len(sizes) + 1) +
                 f"{fn}({dim_c(m)}, {dim_c(n)}, {dim_c(k)}, A + ({oa}) * {dim_c(m * k)}, {dim_c(k)}, "
                 f"B + ({ob}) * {dim_c(k * n)}, {dim_c(n)}, Y + ({lin}) * {dim_c(m * n)}, {dim_c(n)});\n")
        body += epilogue
        bodies.append((f"mm_{entry}", body))
    syms = symbols_of([*batch, m, k, n])
    return kernel_sources(GEMM_PREAMBLE, bodies, syms, OWN_BINARY_ROUTINES)


def _require_f32(ctx: LoweringContext, names: Sequence[str], op: str) -> None:
    for n in names:
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"{op} on {ctx.dtype(n).name} (float32 only)")


def _transpose_2d(ctx: LoweringContext, name: str) -> str:
    """``name`` transposed: at import for a constant, else by a copy kernel."""
    v = ctx.const(name)
    if v is not None:
        return ctx.add_weight(np.ascontiguousarray(v.T), name + ".T")
    r, c = ctx.shape(name)
    out = f"{name}#T{ctx.next_id()}"
    spec = KernelSpec("transpose", strided_copy_source([c, r], [1, c], 0, F32), ("copy",), tuple(symbols_of([r, c])))
    ctx.emit(spec, [name], [(out, F32, [c, r])])
    return out


@register("MatMul")
def _matmul(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    a, b = node.input[0], node.input[1]
    _require_f32(ctx, [a, b], "MatMul")
    sa, sb = list(ctx.shape(a)), list(ctx.shape(b))
    if not sa or not sb:
        raise NodeUnsupported("MatMul of a scalar")
    a2 = sa if len(sa) > 1 else [1] + sa
    b2 = sb if len(sb) > 1 else sb + [1]
    m, k, k2, n = a2[-2], a2[-1], b2[-2], b2[-1]
    if k != k2:
        raise NodeUnsupported(f"inner dimensions {k} and {k2} differ")
    batch = list(broadcast_shape([a2[:-2], b2[:-2]])) if len(a2) > 2 or len(b2) > 2 else []
    out_full = batch + [m, n]
    out = list(batch) + ([m] if len(sa) > 1 else []) + ([n] if len(sb) > 1 else [])
    bias = ctx.take_bias_add(node.output[0], n, len(out)) if len(sb) > 1 else None
    ep, final = ctx.take_epilogue(node, F32, bias[1] if bias else None)
    if ctx.gpu:
        spec_gpu = gpu_linalg.matmul_kernel("matmul", gpu_linalg.MatmulLayout(batch, a2[:-2], b2[:-2], m, k, n), ep,
                                            bias_strides=[0, 1] if bias else None)
        inputs = [a, b] + ([ctx.add_weight(np.ascontiguousarray(bias[0]), node.output[0] + ".bias")] if bias else [])
        ctx.emit(spec_gpu, inputs, [(final, F32, out)])
        return
    epi = _epilogue_loop(dims_product(batch) * m, n, "Y", 1.0, "bias" if bias else None, [0, 1], ep)
    source, own = matmul_source(batch, a2[:-2], b2[:-2], m, k, n, epi, bias is not None)
    spec = KernelSpec("matmul", source, tuple(f"mm_{e}" for e, _ in GEMM_CANDIDATES),
                      tuple(symbols_of([*out_full, k])), entry_sources=own)
    inputs = [a, b] + ([ctx.add_weight(np.ascontiguousarray(bias[0]), node.output[0] + ".bias")] if bias else [])
    ctx.emit(spec, inputs, [(final, F32, out)])


@register("Gemm")
def _gemm(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    a, b = node.input[0], node.input[1]
    c = node.input[2] if len(node.input) > 2 and node.input[2] else None
    _require_f32(ctx, [a, b] + ([c] if c else []), "Gemm")
    if ctx.gpu:
        _gemm_gpu(ctx, node, a, b, c)
        return
    if ctx.attr(node, "transA", 0):
        a = _transpose_2d(ctx, a)
    if ctx.attr(node, "transB", 0):
        b = _transpose_2d(ctx, b)
    (m, k), (k2, n) = ctx.shape(a), ctx.shape(b)
    if k != k2:
        raise NodeUnsupported(f"inner dimensions {k} and {k2} differ")
    alpha, beta = float(ctx.attr(node, "alpha", 1.0)), float(ctx.attr(node, "beta", 1.0))
    ep, final = ctx.take_epilogue(node, F32)
    bias_strides: list[Dim] = []
    if c is not None and beta != 1.0:
        cv = ctx.const(c)
        if cv is None:
            raise NodeUnsupported("beta != 1 with a bias computed at run time")
        c = ctx.add_weight((cv * beta).astype(np.float32), c + ".beta")
    if c is not None and beta != 0.0:
        cs = list(ctx.shape(c))
        padded = [1] * (2 - len(cs)) + cs
        broadcast_shape([[m, n], padded])
        bias_strides = [0 if padded[0] == 1 else n if padded[1] != 1 else 1, 0 if padded[1] == 1 else 1]
    else:
        c = None
    epi = _epilogue_loop(m, n, "Y", alpha, "bias" if c else None, bias_strides, ep)
    source, own = matmul_source([], [], [], m, k, n, epi, c is not None)
    spec = KernelSpec("gemm", source, tuple(f"mm_{e}" for e, _ in GEMM_CANDIDATES), tuple(symbols_of([m, k, n])),
                      entry_sources=own)
    ctx.emit(spec, [a, b] + ([c] if c else []), [(final, F32, [m, n])])


def _gemm_gpu(ctx: LoweringContext, node: onnx.NodeProto, a: str, b: str, c: str | None) -> None:
    """Gemm as one GPU kernel: a constant operand used transposed is transposed at import (as on
    the CPU), one computed at run time is read at transposed strides; ``beta`` scales the bias
    inside the kernel, so a bias computed at run time may have any ``beta``."""
    shapes = []
    strides = []
    for name, flag in ((a, "transA"), (b, "transB")):
        trans = bool(ctx.attr(node, flag, 0))
        if trans and ctx.const(name) is not None:
            name, trans = _transpose_2d(ctx, name), False
        rows, cols = ctx.shape(name)
        shapes.append((name, (cols, rows) if trans else (rows, cols)))
        strides.append([1, cols] if trans else [cols, 1])
    (a, (m, k)), (b, (k2, n)) = shapes
    if k != k2:
        raise NodeUnsupported(f"inner dimensions {k} and {k2} differ")
    alpha, beta = float(ctx.attr(node, "alpha", 1.0)), float(ctx.attr(node, "beta", 1.0))
    ep, final = ctx.take_epilogue(node, F32)
    bias_strides: list[Dim] | None = None
    if c is not None and beta != 0.0:
        padded = [1] * (2 - len(ctx.shape(c))) + list(ctx.shape(c))
        broadcast_shape([[m, n], padded])
        bias_strides = [0 if padded[0] == 1 else n if padded[1] != 1 else 1, 0 if padded[1] == 1 else 1]
    lay = gpu_linalg.MatmulLayout([], [], [], m, k, n, strides[0], strides[1])
    spec = gpu_linalg.matmul_kernel("gemm", lay, ep, alpha=alpha, beta=beta, bias_strides=bias_strides)
    ctx.emit(spec, [a, b] + ([c] if bias_strides is not None else []), [(final, F32, [m, n])])
