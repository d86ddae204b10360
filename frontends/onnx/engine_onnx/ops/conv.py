"""Conv (1-D and 2-D, groups, dilations, pads and ``auto_pad``), float32, with constant weights.

Two candidates per shape: ``conv_direct`` (loops over output planes, the innermost loop running
along the output row, clipped to the valid input range so it has no branch and vectorises) and
``conv_im2col`` (columns in the workspace, then the blocked GEMM; a 1x1, stride-1 unpadded Conv
multiplies the input directly). Depthwise convolutions favour the first, wide ones the second: the
tuner measures. A following BatchNormalization with constant statistics is folded into the
weights and bias at import, and a following activation runs in the kernel's epilogue.
"""

from __future__ import annotations

import numpy as np

from engine_onnx.codegen import KernelSpec, source_with_entries
from engine_onnx.dims import Mono, dim_c, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import register
from engine_onnx.ops.gemm_c import GEMM_PREAMBLE

__all__ = ["conv_geometry"]

F32 = np.dtype("float32")


def conv_geometry(ctx, node, spatial, kernel, *, ceil_mode: bool = False):
    """(strides, dilations, pads_begin, pads_end, out_spatial) following ONNX's auto_pad rules."""
    r = len(spatial)
    strides = list(ctx.attr(node, "strides", [1] * r))
    dil = list(ctx.attr(node, "dilations", [1] * r))
    pads = list(ctx.attr(node, "pads", [0] * (2 * r)))
    auto = ctx.attr(node, "auto_pad", "NOTSET")
    begin, end = pads[:r], pads[r:]
    out = []
    for i in range(r):
        eff = (kernel[i] - 1) * dil[i] + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[i] // strides[i])
            total = max(0, (o - 1) * strides[i] + eff - spatial[i])
            small = total // 2
            begin[i], end[i] = (small, total - small) if auto == "SAME_UPPER" else (total - small, small)
        elif auto == "VALID":
            begin[i] = end[i] = 0
        elif auto != "NOTSET":
            raise NodeUnsupported(f"auto_pad={auto!r}")
        span = spatial[i] + begin[i] + end[i] - eff
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= spatial[i] + begin[i]:
            o -= 1
        out.append(o)
    return strides, dil, begin, end, out


def _fold_batchnorm(ctx, out_name: str, w: np.ndarray, b: np.ndarray):
    bn = ctx.sole_consumer(out_name)
    if bn is None or bn.op_type != "BatchNormalization" or bn.input[0] != out_name:
        return w, b, None
    if any(ctx.is_used(o) for o in bn.output[1:]) or ctx.attr(bn, "training_mode", 0):
        return w, b, None
    params = [ctx.const(n) for n in bn.input[1:5]]
    if any(p is None for p in params):
        return w, b, None
    scale, beta, mean, var = (p.astype(np.float64) for p in params)
    k = scale / np.sqrt(var + float(ctx.attr(bn, "epsilon", 1e-5)))
    w2 = (w.astype(np.float64) * k.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float32)
    b2 = ((b.astype(np.float64) - mean) * k + beta).astype(np.float32)
    ctx.mark_fused(bn)
    return w2, b2, bn.output[0]


@register("Conv")
def _conv(ctx, node) -> None:
    x, wn = node.input[0], node.input[1]
    for n in (x, wn):
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"Conv on {ctx.dtype(n).name} (float32 only)")
    w = ctx.require_const(wn, "the Conv weight")
    xs = list(ctx.shape(x))
    if len(xs) not in (3, 4):
        raise NodeUnsupported(f"{len(xs) - 2}-D convolution (1-D and 2-D only)")
    if any(isinstance(d, Mono) for d in xs[1:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions (only the batch may be dynamic)")
    group = int(ctx.attr(node, "group", 1))
    oc, cg = int(w.shape[0]), int(w.shape[1])
    c = xs[1]
    if cg * group != c or oc % group:
        raise NodeUnsupported(f"weight {list(w.shape)} does not match {c} channels in {group} groups")
    b = (ctx.require_const(node.input[2], "the Conv bias") if len(node.input) > 2 and node.input[2]
         else np.zeros(oc, np.float32))
    spatial = xs[2:]
    kernel = list(w.shape[2:])
    strides, dil, pb, pe, out_sp = conv_geometry(ctx, node, spatial, kernel)
    w, b, bn_out = _fold_batchnorm(ctx, node.output[0], w, b)
    ep, final = ctx.take_epilogue(node, F32, bn_out)
    if len(spatial) == 1:
        spatial, kernel, strides, dil, pb, out_sp = [1] + spatial, [1] + kernel, [1] + strides, [1] + dil, \
            [0] + pb, [1] + out_sp
    n = xs[0]
    H, W = spatial
    KH, KW = kernel
    OH, OW = out_sp
    if OH <= 0 or OW <= 0:
        raise NodeUnsupported("empty output")
    kc = cg * KH * KW
    ocg = oc // group
    one_by_one = KH == KW == 1 and strides == [1, 1] and pb == [0, 0] and not any(pe) and dil == [1, 1]
    defs = (f"#define C {c}\n#define H {H}\n#define W {W}\n#define OC {oc}\n#define CG {cg}\n#define OCG {ocg}\n"
            f"#define KH {KH}\n#define KW {KW}\n#define SH {strides[0]}\n#define SW {strides[1]}\n"
            f"#define PT {pb[0]}\n#define PL {pb[1]}\n#define DH {dil[0]}\n#define DW {dil[1]}\n"
            f"#define OH {OH}\n#define OW {OW}\n#define KC {kc}\n#define GROUPS {group}\n")
    head = ("    const float *X = (const float *)t[0], *Wt = (const float *)t[1], *Bv = (const float *)t[2];\n"
            "    float *Y = (float *)t[3];\n")
    epilogue = ("    for (int64_t i = 0; i < OH * OW; i++) y[i] = " + ep("(y[i] + bias)") + ";\n")
    direct = head + f"""    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < {dim_c(n)} * OC; q++) {{
        const int64_t nn = q / OC, oc = q % OC, g = oc / OCG;
        float *y = Y + q * OH * OW;
        const float bias = Bv[oc];
        for (int64_t i = 0; i < OH * OW; i++) y[i] = 0.0f;
        for (int64_t ic = 0; ic < CG; ic++) {{
            const float *x = X + (nn * C + g * CG + ic) * H * W;
            for (int64_t kh = 0; kh < KH; kh++)
                for (int64_t kw = 0; kw < KW; kw++) {{
                    const float wv = Wt[((oc * CG + ic) * KH + kh) * KW + kw];
                    const int64_t off = kw * DW - PL;
                    int64_t lo = off >= 0 ? 0 : (-off + SW - 1) / SW;
                    int64_t hi = W - off <= 0 ? 0 : (W - off + SW - 1) / SW;
                    if (hi > OW) hi = OW;
                    for (int64_t oh = 0; oh < OH; oh++) {{
                        const int64_t ih = oh * SH - PT + kh * DH;
                        if (ih < 0 || ih >= H) continue;
                        const float *xr = x + ih * W + off;
                        float *yr = y + oh * OW;
                        for (int64_t ow = lo; ow < hi; ow++) yr[ow] += wv * xr[ow * SW];
                    }}
                }}
        }}
    {epilogue}    }}
"""
    if one_by_one:
        cols = "        const float *B = xg;\n"
    else:
        cols = """        float *col = (float *)ws;
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < KC; r++) {
            const int64_t ic = r / (KH * KW), kh = (r / KW) % KH, kw = r % KW;
            const float *x = xg + ic * H * W;
            float *dst = col + r * OH * OW;
            for (int64_t oh = 0; oh < OH; oh++) {
                const int64_t ih = oh * SH - PT + kh * DH;
                float *d = dst + oh * OW;
                if (ih < 0 || ih >= H) { for (int64_t ow = 0; ow < OW; ow++) d[ow] = 0.0f; continue; }
                for (int64_t ow = 0; ow < OW; ow++) {
                    const int64_t iw = ow * SW - PL + kw * DW;
                    d[ow] = (iw >= 0 && iw < W) ? x[ih * W + iw] : 0.0f;
                }
            }
        }
        const float *B = col;
"""
    im2col = head + f"""    for (int64_t nn = 0; nn < {dim_c(n)}; nn++)
      for (int64_t g = 0; g < GROUPS; g++) {{
        const float *xg = X + (nn * C + g * CG) * H * W;
{cols}        gemm_blocked(OCG, OH * OW, KC, Wt + g * OCG * KC, KC, B, OH * OW, Y + (nn * OC + g * OCG) * OH * OW, OH * OW);
      }}
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < {dim_c(n)} * OC; q++) {{
        float *y = Y + q * OH * OW;
        const float bias = Bv[q % OC];
    {epilogue}    }}
"""
    syms = tuple(symbols_of([n]))
    source = source_with_entries(GEMM_PREAMBLE + defs, [("conv_direct", direct), ("conv_im2col", im2col)], syms)
    wname = ctx.add_weight(np.ascontiguousarray(w.reshape(oc, -1), dtype=np.float32), wn)
    bname = ctx.add_weight(np.ascontiguousarray(b, dtype=np.float32), node.input[2] if len(node.input) > 2 and
                           node.input[2] else wn + ".bias")
    out_shape = [n, oc] + ([OW] if len(xs) == 3 else [OH, OW])
    spec = KernelSpec("conv", source, ("conv_direct", "conv_im2col"), syms, 0 if one_by_one else kc * OH * OW * 4)
    ctx.emit(spec, [x, wname, bname], [(final, F32, out_shape)])
