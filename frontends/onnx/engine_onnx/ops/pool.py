"""Pooling: MaxPool, AveragePool (pads, ceil_mode, count_include_pad, dilations for MaxPool),
GlobalAveragePool, GlobalMaxPool; 1-D and 2-D, float32. One kernel per shape; planes run in
parallel. Maxima are taken branch-free (``m = v > m ? v : m``, one ``maxss``): a NaN input is
skipped rather than propagated, and the compare-or-NaN form it replaces was two orders of
magnitude slower on random data (mispredicted branches)."""

from __future__ import annotations

import numpy as np

from engine_onnx.codegen import KernelSpec, source_with_entries
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import register
from engine_onnx.ops.conv import conv_geometry

F32 = np.dtype("float32")


def _check(ctx, node):
    x = node.input[0]
    if ctx.dtype(x) != F32:
        raise NodeUnsupported(f"{node.op_type} on {ctx.dtype(x).name} (float32 only)")
    xs = list(ctx.shape(x))
    if len(xs) not in (3, 4):
        raise NodeUnsupported(f"{len(xs) - 2}-D pooling (1-D and 2-D only)")
    if any(isinstance(d, Mono) for d in xs[2:]):
        raise NodeUnsupported("dynamic spatial dimensions")
    return xs


@register("MaxPool", "AveragePool")
def _pool(ctx, node) -> None:
    xs = _check(ctx, node)
    is_max = node.op_type == "MaxPool"
    if is_max and len(node.output) > 1 and ctx.is_used(node.output[1]):
        raise NodeUnsupported("the Indices output")
    if ctx.attr(node, "storage_order", 0):
        raise NodeUnsupported("storage_order=1")
    kernel = list(ctx.attr(node, "kernel_shape"))
    spatial = xs[2:]
    ceil_mode = bool(ctx.attr(node, "ceil_mode", 0))
    strides, dil, pb, pe, out_sp = conv_geometry(ctx, node, spatial, kernel, ceil_mode=ceil_mode)
    if not is_max and dil != [1] * len(dil):
        raise NodeUnsupported("AveragePool with dilations")
    if len(spatial) == 1:
        spatial, kernel, strides, dil, pb, pe, out_sp = ([1] + spatial, [1] + kernel, [1] + strides, [1] + dil,
                                                          [0] + pb, [0] + pe, [1] + out_sp)
    H, W = spatial
    KH, KW = kernel
    OH, OW = out_sp
    include_pad = bool(ctx.attr(node, "count_include_pad", 0))
    planes = dims_product(xs[:2])
    ep, final = ctx.take_epilogue(node, F32)
    if is_max:
        inner = f"""                float m = -INFINITY;
                for (int64_t kh = 0; kh < {KH}; kh++) {{
                    const int64_t ih = h0 + kh * {dil[0]}; if (ih < 0 || ih >= {H}) continue;
                    for (int64_t kw = 0; kw < {KW}; kw++) {{
                        const int64_t iw = w0 + kw * {dil[1]}; if (iw < 0 || iw >= {W}) continue;
                        const float v = x[ih * {W} + iw]; m = v > m ? v : m;
                    }}
                }}
                y[oh * {OW} + ow] = {ep("m")};
"""
    else:
        inner = f"""                int64_t h1 = h0 + {KH}, w1 = w0 + {KW};
                if (h1 > {H + pe[0]}) h1 = {H + pe[0]};
                if (w1 > {W + pe[1]}) w1 = {W + pe[1]};
                const int64_t padded = (h1 - h0) * (w1 - w0);
                const int64_t hs = h0 < 0 ? 0 : h0, ws_ = w0 < 0 ? 0 : w0;
                const int64_t he = h1 > {H} ? {H} : h1, we = w1 > {W} ? {W} : w1;
                float s = 0.0f;
                for (int64_t ih = hs; ih < he; ih++) for (int64_t iw = ws_; iw < we; iw++) s += x[ih * {W} + iw];
                const int64_t cnt = {"padded" if include_pad else "(he - hs) * (we - ws_)"};
                y[oh * {OW} + ow] = {ep("(cnt > 0 ? s / (float)cnt : 0.0f)")};
"""
    body = f"""    const float *X = (const float *)t[0]; float *Y = (float *)t[1];
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < {dim_c(planes)}; p++) {{
        const float *x = X + p * {H * W}; float *y = Y + p * {OH * OW};
        for (int64_t oh = 0; oh < {OH}; oh++)
            for (int64_t ow = 0; ow < {OW}; ow++) {{
                const int64_t h0 = oh * {strides[0]} - {pb[0]}, w0 = ow * {strides[1]} - {pb[1]};
{inner}            }}
    }}
"""
    syms = tuple(symbols_of(xs))
    out = xs[:2] + ([OW] if len(xs) == 3 else [OH, OW])
    ctx.emit(KernelSpec(node.op_type.lower(), source_with_entries("", [("pool", body)], syms), ("pool",), syms),
             [node.input[0]], [(final, F32, out)])


@register("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx, node) -> None:
    xs = _check(ctx, node)
    size = int(dims_product(xs[2:]))
    planes = dims_product(xs[:2])
    ep, final = ctx.take_epilogue(node, F32)
    if node.op_type == "GlobalMaxPool":
        red = "float m = -INFINITY; for (int64_t i = 0; i < SIZE; i++) m = x[i] > m ? x[i] : m;"
        res = ep("m")
    else:
        red = "float s = 0.0f; for (int64_t i = 0; i < SIZE; i++) s += x[i];"
        res = ep("s / (float)SIZE")
    body = f"""    const float *X = (const float *)t[0]; float *Y = (float *)t[1];
    for (int64_t p = 0; p < {dim_c(planes)}; p++) {{
        const float *x = X + p * SIZE;
        {red}
        Y[p] = {res};
    }}
"""
    syms = tuple(symbols_of(xs))
    out = xs[:2] + [1] * (len(xs) - 2)
    src = source_with_entries(f"#define SIZE {size}\n", [("pool", body)], syms)
    ctx.emit(KernelSpec(node.op_type.lower(), src, ("pool",), syms), [node.input[0]], [(final, F32, out)])
