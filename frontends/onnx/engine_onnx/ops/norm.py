"""Normalisations and softmax: BatchNormalization (inference, as a per-channel scale and shift),
LRN, Softmax/LogSoftmax (any axis, both the pre-13 "coerce to 2-D" and the per-axis semantics),
LayerNormalization. float32; reductions accumulate in float and subtract the maximum (softmax)."""

from __future__ import annotations

import numpy as np

from engine_onnx.codegen import KernelSpec, source_with_entries
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import register
from engine_onnx.ops.elementwise import emit_elementwise

F32 = np.dtype("float32")


def _f32(ctx, node, *names):
    for n in names:
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"{node.op_type} on {ctx.dtype(n).name} (float32 only)")


@register("BatchNormalization")
def _batchnorm(ctx, node) -> None:
    _f32(ctx, node, node.input[0])
    if ctx.attr(node, "training_mode", 0) or any(ctx.is_used(o) for o in node.output[1:]):
        raise NodeUnsupported("training mode (running statistics outputs)")
    params = [ctx.const(n) for n in node.input[1:5]]
    if any(p is None for p in params):
        raise NodeUnsupported("scale, bias, mean and variance must be constants")
    scale, beta, mean, var = (p.astype(np.float64) for p in params)
    k = scale / np.sqrt(var + float(ctx.attr(node, "epsilon", 1e-5)))
    shift = beta - mean * k
    rank = len(ctx.shape(node.input[0]))
    tail = [1] * (rank - 2)
    kn = ctx.add_weight(k.astype(np.float32).reshape(-1, *tail), node.name + ".scale")
    sn = ctx.add_weight(shift.astype(np.float32).reshape(-1, *tail), node.name + ".shift")
    emit_elementwise(ctx, node, [node.input[0], kn, sn], F32, lambda a: f"{a[0]} * {a[1]} + {a[2]}")


@register("LRN")
def _lrn(ctx, node) -> None:
    _f32(ctx, node, node.input[0])
    xs = list(ctx.shape(node.input[0]))
    if any(isinstance(d, Mono) for d in xs[1:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions")
    size = int(ctx.attr(node, "size"))
    alpha, beta, bias = (float(ctx.attr(node, "alpha", 1e-4)), float(ctx.attr(node, "beta", 0.75)),
                         float(ctx.attr(node, "bias", 1.0)))
    c = xs[1]
    plane = int(dims_product(xs[2:]))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    body = f"""    const float *X = (const float *)t[0]; float *Y = (float *)t[1];
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < {dim_c(xs[0])} * {c}; q++) {{
        const int64_t n = q / {c}, ch = q % {c};
        const int64_t c0 = ch - {lo} < 0 ? 0 : ch - {lo}, c1 = ch + {hi} > {c - 1} ? {c - 1} : ch + {hi};
        for (int64_t i = 0; i < {plane}; i++) {{
            float s = 0.0f;
            for (int64_t cc = c0; cc <= c1; cc++) {{ const float v = X[(n * {c} + cc) * {plane} + i]; s += v * v; }}
            Y[q * {plane} + i] = X[q * {plane} + i] / powf({bias!r}f + {alpha / size!r}f * s, {beta!r}f);
        }}
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec("lrn", source_with_entries("", [("lrn", body)], syms), ("lrn",), syms), [node.input[0]],
             [(node.output[0], F32, xs)])


@register("Softmax", "LogSoftmax")
def _softmax(ctx, node) -> None:
    _f32(ctx, node, node.input[0])
    xs = list(ctx.shape(node.input[0]))
    if ctx.opset < 13:
        axis = int(ctx.attr(node, "axis", 1)) % len(xs)
        outer, dim, inner = dims_product(xs[:axis]), dims_product(xs[axis:]), 1
    else:
        axis = int(ctx.attr(node, "axis", -1)) % len(xs)
        outer, dim, inner = dims_product(xs[:axis]), xs[axis], dims_product(xs[axis + 1:])
    log = node.op_type == "LogSoftmax"
    fin = "y[j * I] = x[j * I] - m - logf(s);" if log else "y[j * I] *= inv;"
    body = f"""    const float *X = (const float *)t[0]; float *Y = (float *)t[1];
    const int64_t D = {dim_c(dim)}, I = {dim_c(inner)};
    #pragma omp parallel for schedule(static) if ({dim_c(outer)} * D * I > 65536)
    for (int64_t q = 0; q < {dim_c(outer)} * I; q++) {{
        const int64_t o = q / I, in = q % I;
        const float *x = X + o * D * I + in; float *y = Y + o * D * I + in;
        float m = -INFINITY;
        for (int64_t j = 0; j < D; j++) m = x[j * I] > m ? x[j * I] : m;
        float s = 0.0f;
        for (int64_t j = 0; j < D; j++) {{ const float e = expf(x[j * I] - m); {"" if log else "y[j * I] = e; "}s += e; }}
        const float inv = 1.0f / s; (void)inv;
        for (int64_t j = 0; j < D; j++) {fin}
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec(node.op_type.lower(), source_with_entries("", [("softmax", body)], syms), ("softmax",), syms),
             [node.input[0]], [(node.output[0], F32, xs)])


@register("LayerNormalization")
def _layernorm(ctx, node) -> None:
    _f32(ctx, node, node.input[0])
    if any(ctx.is_used(o) for o in node.output[1:]):
        raise NodeUnsupported("the Mean and InvStdDev outputs")
    xs = list(ctx.shape(node.input[0]))
    axis = int(ctx.attr(node, "axis", -1)) % len(xs)
    if int(ctx.attr(node, "stash_type", 1)) != 1:
        raise NodeUnsupported("stash_type other than float32")
    eps = float(ctx.attr(node, "epsilon", 1e-5))
    outer, d = dims_product(xs[:axis]), dims_product(xs[axis:])
    if isinstance(d, Mono):
        raise NodeUnsupported("normalising over dynamic dimensions")
    scale = node.input[1]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    names = [node.input[0], scale] + ([bias] if bias else [])
    for n in names[1:]:
        if int(dims_product(ctx.shape(n))) != d:
            raise NodeUnsupported("scale/bias that broadcast partially (only full-size scale and bias)")
    _f32(ctx, node, *names[1:])
    ep, final = ctx.take_epilogue(node, F32)
    out_slot = len(names)
    bias_expr = " + Bb[j]" if bias else ""
    body = f"""    const float *X = (const float *)t[0], *S = (const float *)t[1];
    {"const float *Bb = (const float *)t[2];" if bias else ""}
    float *Y = (float *)t[{out_slot}];
    #pragma omp parallel for schedule(static) if ({dim_c(outer)} * {d} > 65536)
    for (int64_t o = 0; o < {dim_c(outer)}; o++) {{
        const float *x = X + o * {d}; float *y = Y + o * {d};
        float mean = 0.0f; for (int64_t j = 0; j < {d}; j++) mean += x[j];
        mean /= (float){d};
        float var = 0.0f; for (int64_t j = 0; j < {d}; j++) {{ const float c = x[j] - mean; var += c * c; }}
        var /= (float){d};
        const float inv = 1.0f / sqrtf(var + {eps!r}f);
        for (int64_t j = 0; j < {d}; j++) y[j] = {ep(f"(x[j] - mean) * inv * S[j]{bias_expr}")};
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec("layernorm", source_with_entries("", [("layernorm", body)], syms), ("layernorm",), syms),
             names, [(final, F32, xs)])
