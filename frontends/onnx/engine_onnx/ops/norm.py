"""Normalisations and softmax: BatchNormalization (inference, as a per-channel scale and shift),
LRN, Softmax/LogSoftmax (any axis, both the pre-13 "coerce to 2-D" and the per-axis semantics),
LayerNormalization (with its optional Mean and InvStdDev outputs), InstanceNormalization (scale
and bias constant or computed at run time). float32; reductions accumulate in float and subtract
the maximum (softmax). On GPU kinds (``gpu_norm``; LRN in ``gpu_conv``) the same ops but
training-mode BatchNormalization."""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.codegen import (PARALLEL_WORK, TRANSCENDENTAL_COST, KernelSpec, parallel_rows,
                                 source_with_entries)
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import gpu_norm
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.elementwise import emit_elementwise
from engine_onnx.ops.gpu_conv import lrn_kernel
from engine_onnx.ops.registry import register
from engine_onnx.vecmath import math_preamble

F32 = np.dtype("float32")
#: Softmax elements worth a second thread: an exponential each, so the elementwise threshold for one
#: transcendental call per element.
SOFTMAX_PARALLEL = PARALLEL_WORK // (1 + TRANSCENDENTAL_COST)


def _f32(ctx: LoweringContext, node: onnx.NodeProto, *names):
    for n in names:
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"{node.op_type} on {ctx.dtype(n).name} (float32 only)")


@register("BatchNormalization")
def _batchnorm(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    _f32(ctx, node, *node.input[:5])
    training = bool(ctx.attr(node, "training_mode", 0))
    if not training and any(ctx.is_used(o) for o in node.output[1:]):
        raise NodeUnsupported("statistics outputs without training_mode (opsets before 14's training form)")
    params = [ctx.const(n) for n in node.input[1:5]]
    if training or any(p is None for p in params):
        _batchnorm_kernel(ctx, node, training)
        return
    scale, beta, mean, var = (p.astype(np.float64) for p in params)
    k = scale / np.sqrt(var + float(ctx.attr(node, "epsilon", 1e-5)))
    shift = beta - mean * k
    rank = len(ctx.shape(node.input[0]))
    tail = [1] * (rank - 2)
    kn = ctx.add_weight(k.astype(np.float32).reshape(-1, *tail), node.name + ".scale")
    sn = ctx.add_weight(shift.astype(np.float32).reshape(-1, *tail), node.name + ".shift")
    emit_elementwise(ctx, node, [node.input[0], kn, sn], F32, lambda a: f"{a[0]} * {a[1]} + {a[2]}")


def _batchnorm_kernel(ctx: LoweringContext, node: onnx.NodeProto, training: bool) -> None:
    """BatchNormalization as a kernel: parameters computed at run time, or training mode (the
    batch's own mean and population variance normalise, and the running statistics are updated
    with ``momentum``, ONNX's outputs 1 and 2)."""
    x = node.input[0]
    xs = list(ctx.shape(x))
    if len(xs) < 2 or isinstance(xs[1], Mono) or any(isinstance(d, Mono) for d in xs[2:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions (only the batch may be dynamic)")
    c = xs[1]
    for n in node.input[1:5]:
        if list(ctx.shape(n)) != [c]:
            raise NodeUnsupported(f"scale, bias, mean or variance of shape {list(ctx.shape(n))} (expected [{c}])")
    if ctx.gpu:
        if training:
            raise NodeUnsupported("training_mode on GPU kinds (inference only)")
        ctx.emit(gpu_norm.batchnorm_kernel(xs, float(ctx.attr(node, "epsilon", 1e-5))), list(node.input[:5]),
                 [(node.output[0], F32, xs)])
        return
    plane = int(dims_product(xs[2:]))
    eps = float(ctx.attr(node, "epsilon", 1e-5))
    mom = float(ctx.attr(node, "momentum", 0.9))
    outs = [(node.output[0], F32, xs)]
    if training:
        outs += [(o, F32, [c]) for o in node.output[1:3] if o]
    stats = len(outs) - 1
    nb = dim_c(xs[0])
    if training:
        moments = f"""        float mean = 0.0f, var = 0.0f;
        for (int64_t n = 0; n < {nb}; n++)
            for (int64_t j = 0; j < {plane}; j++) mean += X[(n * {c} + ch) * {plane} + j];
        mean /= (float)({nb} * {plane});
        for (int64_t n = 0; n < {nb}; n++)
            for (int64_t j = 0; j < {plane}; j++) {{
                const float d = X[(n * {c} + ch) * {plane} + j] - mean; var += d * d;
            }}
        var /= (float)({nb} * {plane});
"""
        moments += "".join(f"        R{i}[ch] = {src}[ch] * {mom!r}f + {cur} * (1.0f - {mom!r}f);\n"
                           for i, (src, cur) in enumerate((("Mi", "mean"), ("Vi", "var"))) if i < stats)
    else:
        moments = "        const float mean = Mi[ch], var = Vi[ch];\n"
    body = f"""    const float *X = (const float *)t[0], *S = (const float *)t[1], *Bb = (const float *)t[2];
    const float *Mi = (const float *)t[3], *Vi = (const float *)t[4];
    float *Y = (float *)t[5];
    {"float *R0 = (float *)t[6];" if stats > 0 else ""} {"float *R1 = (float *)t[7];" if stats > 1 else ""}
    #pragma omp parallel for schedule(static) if ({nb} * {c} * {plane} > 65536)
    for (int64_t ch = 0; ch < {c}; ch++) {{
{moments}        const float k = S[ch] / sqrtf(var + {eps!r}f), sh = Bb[ch] - mean * k;
        for (int64_t n = 0; n < {nb}; n++) {{
            const float *x = X + (n * {c} + ch) * {plane}; float *y = Y + (n * {c} + ch) * {plane};
            for (int64_t j = 0; j < {plane}; j++) y[j] = x[j] * k + sh;
        }}
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec("batchnorm", source_with_entries("", [("batchnorm", body)], syms), ("batchnorm",), syms),
             list(node.input[:5]), outs)


@register("LRN")
def _lrn(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    _f32(ctx, node, node.input[0])
    xs = list(ctx.shape(node.input[0]))
    if any(isinstance(d, Mono) for d in xs[1:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions")
    size = int(ctx.attr(node, "size"))
    alpha, beta, bias = (float(ctx.attr(node, "alpha", 1e-4)), float(ctx.attr(node, "beta", 0.75)),
                         float(ctx.attr(node, "bias", 1.0)))
    if ctx.gpu:
        ctx.emit(lrn_kernel(xs, size, alpha, beta, bias), [node.input[0]], [(node.output[0], F32, xs)])
        return
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
def _softmax(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    _f32(ctx, node, node.input[0])
    xs = list(ctx.shape(node.input[0]))
    if ctx.opset < 13:
        axis = int(ctx.attr(node, "axis", 1)) % len(xs)
        outer, dim, inner = dims_product(xs[:axis]), dims_product(xs[axis:]), 1
    else:
        axis = int(ctx.attr(node, "axis", -1)) % len(xs)
        outer, dim, inner = dims_product(xs[:axis]), xs[axis], dims_product(xs[axis + 1:])
    log = node.op_type == "LogSoftmax"
    if ctx.gpu:
        ctx.emit(gpu_norm.softmax_kernel(node.op_type.lower(), xs, outer, dim, inner, log), [node.input[0]],
                 [(node.output[0], F32, xs)])
        return
    decls = "    const float *X = (const float *)t[0]; float *Y = (float *)t[1];\n"
    if inner == 1:
        # A contiguous row (the usual last axis): maximum and sum in eight lanes, the exponentials
        # in a loop of their own, all vectorised; the sum is then in a different order than a
        # left-to-right one (within rounding).
        fin = ("const float ls = logf(s);\n        for (int64_t j = 0; j < D; j++) y[j] = (x[j] - m) - ls;" if log
               else "const float inv = 1.0f / s;\n        for (int64_t j = 0; j < D; j++) y[j] *= inv;")
        row = f"""        const int64_t D = {dim_c(dim)};
        const float *x = X + r * D; float *y = Y + r * D;
        const float m = eng_maxf(x, D);
        for (int64_t j = 0; j < D; j++) y[j] = eng_expf(x[j] - m);
        const float s = eng_sumf(y, D);
        {fin}
"""
        rows = dim_c(outer)
    else:
        fin = "y[j * I] = x[j * I] - m - logf(s);" if log else "y[j * I] *= inv;"
        row = f"""        const int64_t D = {dim_c(dim)}, I = {dim_c(inner)};
        const int64_t o = r / I, in = r % I;
        const float *x = X + o * D * I + in; float *y = Y + o * D * I + in;
        float m = -INFINITY;
        for (int64_t j = 0; j < D; j++) m = x[j * I] > m ? x[j * I] : m;
        float s = 0.0f;
        for (int64_t j = 0; j < D; j++) {{ const float e = eng_expf(x[j * I] - m); {"" if log else "y[j * I] = e; "}s += e; }}
        const float inv = 1.0f / s; (void)inv;
        for (int64_t j = 0; j < D; j++) {fin}
"""
        rows = dim_c(outer * inner)
    syms = tuple(symbols_of(xs))
    fn, body = parallel_rows("softmax", syms, decls, rows, row, dims_product(xs), SOFTMAX_PARALLEL)
    ctx.emit(KernelSpec(node.op_type.lower(), source_with_entries(math_preamble(row) + fn, [("softmax", body)], syms),
                        ("softmax",), syms),
             [node.input[0]], [(node.output[0], F32, xs)])


@register("LayerNormalization")
def _layernorm(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    _f32(ctx, node, node.input[0])
    stats = [o if ctx.is_used(o) else None for o in list(node.output[1:3]) + [None] * (3 - len(node.output))][:2]
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
    if ctx.gpu:
        spec = gpu_norm.layernorm_kernel(xs, outer, d, eps, bias is not None, ep, bool(stats[0]), bool(stats[1]))
        stat_shape = xs[:axis] + [1] * (len(xs) - axis)
        ctx.emit(spec, names, [(final, F32, xs)] + [(name, F32, stat_shape) for name in stats if name])
        return
    out_slot = len(names)
    bias_expr = " + Bb[j]" if bias else ""
    # the optional Mean and InvStdDev outputs follow Y, in that order, when a consumer reads them
    slots = [out_slot + 1 + sum(1 for p in stats[:i] if p) if name else None for i, name in enumerate(stats)]
    keep_stats = "".join(f"        {arr}[o] = {val};\n" for arr, val, slot in (("Mo", "mean", slots[0]),
                                                                                ("Ro", "inv", slots[1])) if slot)
    decls = ("    const float *X = (const float *)t[0], *S = (const float *)t[1];\n"
             + ("    const float *Bb = (const float *)t[2];\n" if bias else "")
             + f"    float *Y = (float *)t[{out_slot}];\n"
             + (f"    float *Mo = (float *)t[{slots[0]}];\n" if slots[0] else "")
             + (f"    float *Ro = (float *)t[{slots[1]}];\n" if slots[1] else ""))
    row = f"""        const int64_t o = r;
        const float *x = X + o * {d}; float *y = Y + o * {d};
        const float mean = eng_sumf(x, {d}) / (float){d};
        const float var = eng_sqdevf(x, {d}, mean) / (float){d};
        const float inv = 1.0f / sqrtf(var + {eps!r}f);
        for (int64_t j = 0; j < {d}; j++) y[j] = {ep(f"(x[j] - mean) * inv * S[j]{bias_expr}")};
{keep_stats}"""
    syms = tuple(symbols_of(xs))
    fn, body = parallel_rows("layernorm", syms, decls, dim_c(outer), row, dims_product(xs), PARALLEL_WORK)
    stat_shape = xs[:axis] + [1] * (len(xs) - axis)
    outs = [(final, F32, xs)] + [(name, F32, stat_shape) for name in stats if name]
    ctx.emit(KernelSpec("layernorm", source_with_entries(math_preamble(row) + fn, [("layernorm", body)], syms),
                        ("layernorm",), syms),
             names, outs)


@register("InstanceNormalization")
def _instancenorm(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    _f32(ctx, node, x, scale, bias)
    xs = list(ctx.shape(x))
    if len(xs) < 3:
        raise NodeUnsupported(f"a rank-{len(xs)} input (expected [N, C, spatial...])")
    if any(isinstance(d, Mono) for d in xs[1:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions (only the batch may be dynamic)")
    c, plane = xs[1], int(dims_product(xs[2:]))
    for n in (scale, bias):
        if list(ctx.shape(n)) != [c]:
            raise NodeUnsupported(f"scale or bias of shape {list(ctx.shape(n))} (expected [{c}])")
    eps = float(ctx.attr(node, "epsilon", 1e-5))
    ep, final = ctx.take_epilogue(node, F32)
    if ctx.gpu:
        ctx.emit(gpu_norm.instancenorm_kernel(xs, eps, ep), [x, scale, bias], [(final, F32, xs)])
        return
    body = f"""    const float *X = (const float *)t[0], *S = (const float *)t[1], *Bb = (const float *)t[2];
    float *Y = (float *)t[3];
    #pragma omp parallel for schedule(static) if ({dim_c(xs[0])} * {c} * {plane} > 65536)
    for (int64_t q = 0; q < {dim_c(xs[0])} * {c}; q++) {{
        const float *x = X + q * {plane}; float *y = Y + q * {plane};
        const float sc = S[q % {c}], sh = Bb[q % {c}];
        float mean = 0.0f; for (int64_t j = 0; j < {plane}; j++) mean += x[j];
        mean /= (float){plane};
        float var = 0.0f; for (int64_t j = 0; j < {plane}; j++) {{ const float d = x[j] - mean; var += d * d; }}
        var /= (float){plane};
        const float k = sc / sqrtf(var + {eps!r}f);
        for (int64_t j = 0; j < {plane}; j++) y[j] = {ep("(x[j] - mean) * k + sh")};
    }}
"""
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec("instancenorm", source_with_entries("", [("instancenorm", body)], syms),
                        ("instancenorm",), syms), [x, scale, bias], [(final, F32, xs)])
