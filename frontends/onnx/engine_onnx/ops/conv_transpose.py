"""ConvTranspose (1-D, 2-D and 3-D; groups, strides, dilations, pads, output_padding, output_shape,
auto_pad), float32, with constant or run-time weights and bias.

Geometry follows ONNX's reference evaluator: the "full" output of input position ``i`` and kernel
tap ``k`` is ``i * stride + k * dilation``; the output keeps full positions ``pad_begin ..
pad_begin + out - 1`` (``output_shape`` or ``auto_pad`` set the pads; a negative end pad extends
the output with bias-only positions, as the reference does).

Two candidates, both owning whole output planes so threads never write the same element:

* ``convt_direct`` gathers into one output plane per (image, output channel): for each input
  channel of its group and each kernel tap, the input row is added to a strided output row; the
  valid input range of a tap is computed once, so the innermost loop has no branch.
* ``convt_gemm`` computes all taps at once as a GEMM (``cols = Wᵀ · X`` per group, through the
  blocked routine of ``gemm_c``), then scatters ``cols`` into the output (col2im) plane by plane.
  It wins when channels are wide (the GEMM does the arithmetic), the direct form when they are
  few. The weight is transposed into the workspace at each run, so a weight computed at run time
  needs nothing else (the transpose is one pass over the weight, small next to the product).

A following activation runs in the epilogue of either candidate. On GPU kinds
(``gpu_indexing.convtranspose_kernel``) one thread per output element gathers the taps that land
on it instead, so no two threads write the same element.
"""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, source_with_entries
from engine_onnx.dims import Mono, dim_c, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gemm_c import GEMM_PREAMBLE
from engine_onnx.ops.gpu_indexing import convtranspose_kernel
from engine_onnx.ops.registry import register

__all__ = ["convtranspose_geometry"]

F32 = np.dtype("float32")


def convtranspose_geometry(ctx: LoweringContext, node: onnx.NodeProto, spatial: list[int], kernel: list[int]):
    """(strides, dilations, pads_begin, out_spatial) by ONNX's rules for ConvTranspose."""
    r = len(spatial)
    strides = [int(v) for v in ctx.attr(node, "strides", [1] * r)]
    dil = [int(v) for v in ctx.attr(node, "dilations", [1] * r)]
    outpad = [int(v) for v in ctx.attr(node, "output_padding", [0] * r)]
    pads = ctx.attr(node, "pads", None)
    auto = ctx.attr(node, "auto_pad", "NOTSET")
    out_shape = ctx.attr(node, "output_shape", None)
    for name, v in (("strides", strides), ("dilations", dil), ("output_padding", outpad)):
        if len(v) != r:
            raise NodeUnsupported(f"{name} {v} does not have one value per spatial axis ({r})")
    if any(s < 1 for s in strides) or any(d < 1 for d in dil):
        raise NodeUnsupported(f"strides {strides} and dilations {dil} must be positive")
    if auto not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise NodeUnsupported(f"auto_pad={auto!r} (expected NOTSET, SAME_UPPER, SAME_LOWER or VALID)")
    full = [strides[i] * (spatial[i] - 1) + outpad[i] + (kernel[i] - 1) * dil[i] + 1 for i in range(r)]
    if out_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = ([int(v) for v in out_shape][-r:] if out_shape is not None
                  else [spatial[i] * strides[i] for i in range(r)])
        total = [full[i] - target[i] for i in range(r)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        return strides, dil, begin, target
    if pads is None or auto == "VALID":
        pads = [0] * (2 * r)
    pads = [int(v) for v in pads]
    return strides, dil, pads[:r], [full[i] - pads[i] - pads[r + i] for i in range(r)]


@register("ConvTranspose")
def _conv_transpose(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x, wn = node.input[0], node.input[1]
    bn = node.input[2] if len(node.input) > 2 and node.input[2] else None
    for n in (x, wn) + ((bn,) if bn else ()):
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"ConvTranspose on {ctx.dtype(n).name} (float32 only)")
    xs, ws = list(ctx.shape(x)), list(ctx.shape(wn))
    if len(xs) not in (3, 4, 5):
        raise NodeUnsupported(f"{len(xs) - 2}-D ConvTranspose (1-D, 2-D and 3-D only)")
    if any(isinstance(d, Mono) for d in xs[1:]) or any(isinstance(d, Mono) for d in ws):
        raise NodeUnsupported("dynamic channel, spatial or weight dimensions (only the batch may be dynamic)")
    group = int(ctx.attr(node, "group", 1))
    c = xs[1]
    if len(ws) != len(xs) or ws[0] != c or c % group:
        raise NodeUnsupported(f"weight {ws} does not match {c} input channels in {group} groups "
                              f"(expected [C, M/group, k...])")
    kernel = [int(k) for k in ws[2:]]
    ks_attr = ctx.attr(node, "kernel_shape", None)
    if ks_attr is not None and [int(k) for k in ks_attr] != kernel:
        raise NodeUnsupported(f"kernel_shape {list(ks_attr)} differs from the weight's {kernel}")
    mg = ws[1]
    oc = mg * group
    cg = c // group
    if bn and list(ctx.shape(bn)) != [oc]:
        raise NodeUnsupported(f"bias of shape {list(ctx.shape(bn))} (expected [{oc}])")
    spatial = xs[2:]
    strides, dil, begin, out_sp = convtranspose_geometry(ctx, node, spatial, kernel)
    if any(o <= 0 for o in out_sp):
        raise NodeUnsupported(f"empty output {out_sp}")
    pad = 3 - len(spatial)  # 1-D and 2-D run as 3-D with unit leading axes (constants: no cost)
    spatial, kernel, strides, dil, begin, out_sp = ([1] * pad + spatial, [1] * pad + kernel, [1] * pad + strides,
                                                    [1] * pad + dil, [0] * pad + begin, [1] * pad + out_sp)
    D, H, W = spatial
    KD, KH, KW = kernel
    OD, OH, OW = out_sp
    n = xs[0]
    ep, final = ctx.take_epilogue(node, F32)
    if ctx.gpu:
        spec_gpu = convtranspose_kernel(n, c, group, mg, spatial, kernel, strides, dil, begin, out_sp, ep)
        bias = bn if bn is not None else ctx.add_weight(np.zeros(oc, np.float32), wn + ".bias")
        ctx.emit(spec_gpu, [x, wn, bias], [(final, F32, [n, oc] + out_sp[pad:])])
        return
    kk = KD * KH * KW
    defs = (f"#define C {c}\n#define D {D}\n#define H {H}\n#define W {W}\n#define OC {oc}\n#define CG {cg}\n"
            f"#define MG {mg}\n#define KD {KD}\n#define KH {KH}\n#define KW {KW}\n#define SD {strides[0]}\n"
            f"#define SH {strides[1]}\n#define SW {strides[2]}\n#define PF {begin[0]}\n#define PT {begin[1]}\n"
            f"#define PL {begin[2]}\n#define DD {dil[0]}\n#define DH {dil[1]}\n#define DW {dil[2]}\n"
            f"#define OD {OD}\n#define OH {OH}\n#define OW {OW}\n#define KK {kk}\n#define GROUPS {group}\n"
            f"#define NB {dim_c(n)}\n#define IN (D * H * W)\n#define OUT (OD * OH * OW)\n")
    # For kernel column kw the output columns hit are iw * SW + (kw * DW - PL); the valid iw range is
    # [ceil(-off / SW), ceil((OW - off) / SW)) clipped to [0, W): computed once per tap.
    # With a column stride that divides the output width, rows are accumulated phase-major
    # (column ``ow = j * SW + r`` at ``r * (OW / SW) + j``), so the innermost loop reads and writes
    # contiguously and vectorises; the rows are interleaved back once before the epilogue.
    phased = strides[2] > 1 and OW % strides[2] == 0
    col_range = """                    const int64_t off = kw * DW - PL;
                    int64_t lo = off >= 0 ? 0 : (-off + SW - 1) / SW;
                    int64_t hi = OW - off <= 0 ? 0 : (OW - off + SW - 1) / SW;
                    if (hi > W) hi = W;
""" + ("""                    const int64_t r = ((off % SW) + SW) % SW, shift = r * (OW / SW) + (off - r) / SW;
""" if phased else "                    const int64_t shift = off;\n")
    head = ("    const float *X = (const float *)t[0], *Wt = (const float *)t[1], *Bv = (const float *)t[2];\n"
            "    float *Y = (float *)t[3];\n")
    epilogue = "        for (int64_t i = 0; i < OUT; i++) y[i] = " + ep("(y[i] + bias)") + ";\n"
    if phased:
        epilogue = """        for (int64_t row = 0; row < OD * OH; row++) {
            float tmp[OW], *yr = y + row * OW;
            for (int64_t r = 0; r < SW; r++)
                for (int64_t j = 0; j < OW / SW; j++) tmp[j * SW + r] = yr[r * (OW / SW) + j];
            memcpy(yr, tmp, sizeof tmp);
        }
""" + epilogue
    # Scatter one input plane row (fixed input depth id and row ih, kernel tap kd, kh, kw) into its
    # output row: shared by both candidates, ``src`` is the input (direct) or the GEMM's column row.
    scatter = f"""            for (int64_t kd = 0; kd < KD; kd++)
              for (int64_t kh = 0; kh < KH; kh++)
                for (int64_t kw = 0; kw < KW; kw++) {{
                    {{TAP}}
{col_range}                    for (int64_t id = 0; id < D; id++) {{
                      const int64_t od = id * SD + kd * DD - PF;
                      if (od < 0 || od >= OD) continue;
                      for (int64_t ih = 0; ih < H; ih++) {{
                        const int64_t oh = ih * SH + kh * DH - PT;
                        if (oh < 0 || oh >= OH) continue;
                        const float *xr = {{SRC}} + (id * H + ih) * W;
                        float *yr = y + (od * OH + oh) * OW + shift;
                        for (int64_t iw = lo; iw < hi; iw++) yr[iw * {1 if phased else "SW"}] += {{MUL}}xr[iw];
                      }}
                    }}
                }}
"""
    direct = head + f"""    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < NB * OC; q++) {{
        const int64_t nn = q / OC, m = q % OC, g = m / MG, ml = m % MG;
        float *y = Y + q * OUT;
        const float bias = Bv[m];
        for (int64_t i = 0; i < OUT; i++) y[i] = 0.0f;
        for (int64_t ic = 0; ic < CG; ic++) {{
            const float *x = X + (nn * C + g * CG + ic) * IN;
            const float *w = Wt + ((g * CG + ic) * MG + ml) * KK;
{scatter.replace("{TAP}", "const float wv = w[(kd * KH + kh) * KW + kw];").replace("{SRC}", "x")
        .replace("{MUL}", "wv * ")}        }}
{epilogue}    }}
"""
    gemm = head + f"""    float *wt = (float *)ws;                 /* per group: [MG * KK, CG], the weight transposed */
    float *cols = wt + (int64_t)GROUPS * MG * KK * CG;   /* [MG * KK, IN] */
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (int64_t)GROUPS * MG * KK; r++) {{
        const int64_t g = r / (MG * KK), j = r % (MG * KK);
        for (int64_t ic = 0; ic < CG; ic++) wt[r * CG + ic] = Wt[((g * CG + ic) * MG) * KK + j];
    }}
    for (int64_t nn = 0; nn < NB; nn++)
      for (int64_t g = 0; g < GROUPS; g++) {{
        gemm_blocked(MG * KK, IN, CG, wt + g * MG * KK * CG, CG, X + (nn * C + g * CG) * IN, IN, cols, IN);
        #pragma omp parallel for schedule(static)
        for (int64_t ml = 0; ml < MG; ml++) {{
            const int64_t m = g * MG + ml;
            float *y = Y + (nn * OC + m) * OUT;
            const float bias = Bv[m];
            for (int64_t i = 0; i < OUT; i++) y[i] = 0.0f;
{scatter.replace("{TAP}", "const float *cr = cols + (ml * KK + (kd * KH + kh) * KW + kw) * IN;")
        .replace("{SRC}", "cr").replace("{MUL}", "")}{epilogue}        }}
      }}
"""
    syms = tuple(symbols_of([n]))
    source = source_with_entries(GEMM_PREAMBLE + defs, [("convt_direct", direct), ("convt_gemm", gemm)], syms)
    if bn is None:
        bn = ctx.add_weight(np.zeros(oc, np.float32), wn + ".bias")
    workspace = (group * mg * kk * cg + mg * kk * D * H * W) * 4
    out_shape = [n, oc] + out_sp[pad:]
    spec = KernelSpec("convtranspose", source, ("convt_direct", "convt_gemm"), syms, workspace)
    ctx.emit(spec, [x, wn, bn], [(final, F32, out_shape)])
