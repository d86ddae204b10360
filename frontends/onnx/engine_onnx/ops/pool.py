"""Pooling: MaxPool, AveragePool (pads, ceil_mode, count_include_pad, dilations for MaxPool),
GlobalAveragePool, GlobalMaxPool; 1-D, 2-D and 3-D, float32. One kernel per shape. MaxPool and
AveragePool: each thread takes an even share of the planes and copies each into the padded,
stride-phase-split buffer the depthwise Conv reads (``phase_plane.py``; padding -inf or 0, the identity of the
reduction), so every tap of an output row is one contiguous run and the row vectorises with no
border case; an average divides by its window's count, the product of a row count and a column
count (both clipped to the input, or to the padded extent with ``count_include_pad``). A plane
whose buffer would not fit a thread's stack is pooled one window at a time.
Maxima are taken branch-free (``m = v > m ? v : m``, one ``maxps``): a NaN input is skipped rather
than propagated, and the compare-or-NaN form it replaces was two orders of magnitude slower on
random data (mispredicted branches). On GPU kinds: ``gpu_conv.pool_kernel`` and
``global_pool_kernel``, the same windows and counts one output element (or plane) at a time.
A 3-D MaxPool or AveragePool (NCDHW) has a kernel of its own, one window at a time
(``pool_nd.py``; ``gpu_window_nd.py`` on GPU kinds): the plane buffer is a 2-D layout; the global
pools reduce a plane of any rank."""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.codegen import (OMP_INCLUDE, PARALLEL_WORK, KernelSpec, parallel_rows, source_with_entries,
                                 thread_share)
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.conv_geometry import conv_geometry
from engine_onnx.ops.gpu_conv import global_pool_kernel, pool_kernel
from engine_onnx.ops.gpu_window_nd import pool_nd_kernel
from engine_onnx.ops.phase_plane import MAX_PLANE_FLOATS, PHASE_PLANE, phase_plane_floats
from engine_onnx.ops.pool_nd import pool_nd_spec
from engine_onnx.ops.registry import register
from engine_onnx.ops.window_nd import Window, window_of
from engine_onnx.vecmath import NO_TRAPS, math_preamble

F32 = np.dtype("float32")


def _check(ctx: LoweringContext, node: onnx.NodeProto):
    x = node.input[0]
    if ctx.dtype(x) != F32:
        raise NodeUnsupported(f"{node.op_type} on {ctx.dtype(x).name} (float32 only)")
    xs = list(ctx.shape(x))
    if len(xs) not in (3, 4, 5):
        raise NodeUnsupported(f"{len(xs) - 2}-D pooling (1-D, 2-D and 3-D only)")
    if any(isinstance(d, Mono) for d in xs[2:]):
        raise NodeUnsupported("dynamic spatial dimensions")
    return xs


_WINDOWS = r"""
#pragma GCC push_options
""" + NO_TRAPS + r"""/* Planes p0..p1, each copied into buf (PP_PLANE floats, padding PV: phase_plane.py), so that every
   tap of an output row is a contiguous run; ow outermost, taps unrolled, so the row vectorises.
   An average's count is the product of the window's row count (ch) and column count (cw[ow]); a
   window with no element counts 1 (its sum is 0). */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void pool_planes(int64_t p0, int64_t p1, const float *X, float *Y, float *buf) {
    float acc[PP_NV8] __attribute__((aligned(32))), cw[PP_NV8];
    pp_clear(buf, PV);
    for (int64_t ow = 0; ow < PP_NV8; ow++) {
        const int64_t w0 = ow * SW - PL, w1 = w0 + KW;
        const int64_t lo = INCLUDE_PAD ? w0 : (w0 > 0 ? w0 : 0);
        const int64_t hi = INCLUDE_PAD ? (w1 < WE ? w1 : WE) : (w1 < W ? w1 : W);
        cw[ow] = hi > lo ? (float)(hi - lo) : 1.0f;
    }
    for (int64_t p = p0; p < p1; p++) {
        const float *x = X + p * (H * W);
        float *y = Y + p * (OH * OW);
        pp_fill(x, buf);
        for (int64_t oh = 0; oh < OH; oh++) {
            for (int64_t ow = 0; ow < PP_NV8; ow++) {
                float m = PP_TAP(buf, oh, 0, 0)[ow];
                for (int64_t kh = 0; kh < KH; kh++)
                    for (int64_t kw = 0; kw < KW; kw++)
                        if (kh || kw) m = COMBINE(m, PP_TAP(buf, oh, kh, kw)[ow]);
                acc[ow] = m;
            }
            const int64_t h0 = oh * SH - PT;
            const int64_t hlo = INCLUDE_PAD ? h0 : (h0 > 0 ? h0 : 0);
            const int64_t hhi = INCLUDE_PAD ? (h0 + KH < HE ? h0 + KH : HE) : (h0 + KH < H ? h0 + KH : H);
            const float ch = hhi > hlo ? (float)(hhi - hlo) : 1.0f; (void)ch;
            float *yr = y + oh * OW;
            for (int64_t ow = 0; ow < OW; ow++) yr[ow] = EPILOGUE;
        }
    }
}
#pragma GCC pop_options
"""


def _windows(is_max: bool, geometry: dict, epilogue: str) -> str:
    """The preamble of the pooling kernel: the geometry's defines, the plane buffer's helpers and
    ``pool_planes`` (AVX2 where the machine has it: ``target_clones``)."""
    combine = "((b) > (a) ? (b) : (a))" if is_max else "((a) + (b))"
    defs = "".join(f"#define {k} {v}\n" for k, v in geometry.items())
    return (OMP_INCLUDE + defs
            + f"#define PV {'(-INFINITY)' if is_max else '0.0f'}\n#define COMBINE(a, b) {combine}\n"
            + PHASE_PLANE + _WINDOWS.replace("EPILOGUE", epilogue))


def _per_window_body(is_max: bool, g: dict, planes, ep) -> str:
    """One output element at a time (a plane too large for the plane buffer)."""
    H, W, KH, KW, DH, DW = g["H"], g["W"], g["KH"], g["KW"], g["DH"], g["DW"]
    if is_max:
        inner = f"""                float m = -INFINITY;
                for (int64_t kh = 0; kh < {KH}; kh++) {{
                    const int64_t ih = h0 + kh * {DH}; if (ih < 0 || ih >= {H}) continue;
                    for (int64_t kw = 0; kw < {KW}; kw++) {{
                        const int64_t iw = w0 + kw * {DW}; if (iw < 0 || iw >= {W}) continue;
                        const float v = x[ih * {W} + iw]; m = v > m ? v : m;
                    }}
                }}
                y[oh * {g["OW"]} + ow] = {ep("m")};
"""
    else:
        inner = f"""                int64_t h1 = h0 + {KH}, w1 = w0 + {KW};
                if (h1 > {g["HE"]}) h1 = {g["HE"]};
                if (w1 > {g["WE"]}) w1 = {g["WE"]};
                const int64_t padded = (h1 - h0) * (w1 - w0);
                const int64_t hs = h0 < 0 ? 0 : h0, ws_ = w0 < 0 ? 0 : w0;
                const int64_t he = h1 > {H} ? {H} : h1, we = w1 > {W} ? {W} : w1;
                float s = 0.0f;
                for (int64_t ih = hs; ih < he; ih++) for (int64_t iw = ws_; iw < we; iw++) s += x[ih * {W} + iw];
                const int64_t cnt = {"padded" if g["INCLUDE_PAD"] else "(he - hs) * (we - ws_)"};
                y[oh * {g["OW"]} + ow] = {ep("(cnt > 0 ? s / (float)cnt : 0.0f)")};
"""
    return f"""    const float *X = (const float *)t[0]; float *Y = (float *)t[1];
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < {dim_c(planes)}; p++) {{
        const float *x = X + p * {H * W}; float *y = Y + p * {g["OH"] * g["OW"]};
        for (int64_t oh = 0; oh < {g["OH"]}; oh++)
            for (int64_t ow = 0; ow < {g["OW"]}; ow++) {{
                const int64_t h0 = oh * {g["SH"]} - {g["PT"]}, w0 = ow * {g["SW"]} - {g["PL"]};
{inner}            }}
    }}
"""


def _pool_nd(ctx: LoweringContext, node: onnx.NodeProto, xs, is_max: bool, window: Window) -> None:
    """A 3-D MaxPool or AveragePool: ``pool_nd``'s kernel, or ``gpu_window_nd``'s on GPU kinds."""
    include_pad = bool(ctx.attr(node, "count_include_pad", 0))
    ep, final = ctx.take_epilogue(node, F32)
    planes = dims_product(xs[:2])
    syms = tuple(symbols_of(xs))
    if ctx.gpu:
        spec = pool_nd_kernel(is_max, planes, window, include_pad, ep, syms)
    else:
        spec = pool_nd_spec(is_max, planes, window, include_pad, ep, syms)
    ctx.emit(spec, [node.input[0]], [(final, F32, xs[:2] + list(window.out))])


@register("MaxPool", "AveragePool")
def _pool(ctx: LoweringContext, node: onnx.NodeProto) -> None:
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
    if len(spatial) == 3:
        _pool_nd(ctx, node, xs, is_max, window_of(spatial, kernel, strides, dil, pb, pe, out_sp))
        return
    if len(spatial) == 1:
        spatial, kernel, strides, dil, pb, pe, out_sp = ([1] + spatial, [1] + kernel, [1] + strides, [1] + dil,
                                                          [0] + pb, [0] + pe, [1] + out_sp)
    H, W = spatial
    KH, KW = kernel
    OH, OW = out_sp
    include_pad = bool(ctx.attr(node, "count_include_pad", 0))
    planes = dims_product(xs[:2])
    ep, final = ctx.take_epilogue(node, F32)
    out = xs[:2] + ([OW] if len(xs) == 3 else [OH, OW])
    geometry = dict(H=H, W=W, OH=OH, OW=OW, KH=KH, KW=KW, SH=strides[0], SW=strides[1], PT=pb[0], PL=pb[1],
                    DH=dil[0], DW=dil[1], HE=H + pe[0], WE=W + pe[1], INCLUDE_PAD=int(include_pad))
    hpad = (OH - 1) * strides[0] + (KH - 1) * dil[0] + 1
    geometry["HPAD"] = hpad
    if ctx.gpu:
        ctx.emit(pool_kernel(is_max, planes, geometry, ep, symbols_of(xs)), [node.input[0]], [(final, F32, out)])
        return
    if phase_plane_floats(OW, KW, strides[1], dil[1], hpad) <= MAX_PLANE_FLOATS:
        preamble = _windows(is_max, geometry, ep("acc[ow]") if is_max else ep("(acc[ow] / (ch * cw[ow]))"))
        body = ("    const float *X = (const float *)t[0]; float *Y = (float *)t[1];\n"
                + thread_share(dim_c(planes), "pool_planes(lo, hi, X, Y, buf)", condition="count_ > 1",
                               thread_locals="        float buf[PP_PLANE] __attribute__((aligned(64)));\n"))
    else:
        preamble, body = "", _per_window_body(is_max, geometry, planes, ep)
    syms = tuple(symbols_of(xs))
    ctx.emit(KernelSpec(node.op_type.lower(), source_with_entries(preamble, [("pool", body)], syms), ("pool",), syms),
             [node.input[0]], [(final, F32, out)])


@register("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    xs = _check(ctx, node)
    size = int(dims_product(xs[2:]))
    planes = dims_product(xs[:2])
    ep, final = ctx.take_epilogue(node, F32)
    if ctx.gpu:
        spec = global_pool_kernel(node.op_type == "GlobalMaxPool", planes, size, ep, symbols_of(xs))
        ctx.emit(spec, [node.input[0]], [(final, F32, xs[:2] + [1] * (len(xs) - 2))])
        return
    if node.op_type == "GlobalMaxPool":
        red = "const float m = eng_maxf(x, SIZE);"
        res = ep("m")
    else:
        red = "const float s = eng_sumf(x, SIZE);"
        res = ep("s / (float)SIZE")
    row = f"""        const float *x = X + r * SIZE;
        {red}
        Y[r] = {res};
"""
    syms = tuple(symbols_of(xs))
    out = xs[:2] + [1] * (len(xs) - 2)
    # the planes in the AVX2/baseline clone pair, shared out to the threads when there is enough
    fn, body = parallel_rows("pool", syms, "    const float *X = (const float *)t[0]; float *Y = (float *)t[1];\n",
                             dim_c(planes), row, dims_product(xs), PARALLEL_WORK)
    src = source_with_entries(f"#define SIZE {size}\n" + math_preamble(row) + fn, [("pool", body)], syms)
    ctx.emit(KernelSpec(node.op_type.lower(), src, ("pool",), syms), [node.input[0]], [(final, F32, out)])
