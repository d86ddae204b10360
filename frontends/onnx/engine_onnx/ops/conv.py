"""Conv (1-D, 2-D and 3-D, groups, dilations, pads and ``auto_pad``), float32; weights constant or computed.

Candidates per shape, reading the weight as an ``[OC, CG*KH*KW]`` matrix or a form of it made at import:

* ``conv_direct``: output planes in parallel, the innermost loop along the output row, clipped to
  the valid input range so it has no branch and vectorises;
* ``conv_im2col_<routine>``: columns in the workspace, then one of ``gemm_c.GEMM_CANDIDATES``
  (so every GEMM routine, a BLAS one included, is a Conv candidate too); a 1x1, stride-1 unpadded
  Conv multiplies the input directly;
* ``conv_implicit``: the packed GEMM with the im2col rows built straight into each thread's packed
  panel, in one parallel region, bias, residual and activation applied per tile while it is hot;
* ``conv_depthwise`` (one input channel per output channel: MobileNet's, ShuffleNet's): each plane
  padded and split by stride phase once, then every tap is a contiguous, vectorised row update.
* ``conv_pointwise`` (a 1x1, stride-1, unpadded Conv with few input channels per group;
  ``conv_pointwise.py``): 6 output channels x 16 pixels in registers straight from the input rows,
  written once with the epilogue;
* ``conv_winograd`` (3x3, stride 1, no dilation, one group, a constant weight, at least 8 input
  channels; ``conv_winograd.py``): Winograd F(2x2, 3x3), 16 products per 2x2 outputs instead of 36,
  the weight transformed and packed at import as an extra input; ``conv_winograd4`` the same with
  F(4x4, 3x3), 36 products per 4x4 outputs, where its weight (4x the 3x3 one) is not too large;
* ``conv_strided`` (few input channels, any stride: a first layer; ``conv_strided.py``);
* ``conv_batch_gemm`` (a plain 1x1, one group, a constant weight; ``conv_batch_gemm.py``): one
  GEMM over the whole batch's pixels, the weight packed at import as an extra input.

Candidates are appended in that order where offered, so an earlier candidate keeps its index; the
extra weights follow the residual in the same order (``conv_winograd``'s, ``conv_winograd4``'s,
``conv_batch_gemm``'s).

The tuner measures. A following BatchNormalization with constant statistics is folded into the
weights and bias at import; a following same-shape ``Add`` (a residual) and activation run in the
kernel's epilogue. A weight (or bias) computed at run time is read as it is, without folding.
On GPU kinds the same folded weight, bias, residual and epilogue feed ``gpu_conv.conv_kernel``'s
candidates instead.

A 3-D Conv (NCDHW) folds and fuses the same way but has one direct kernel of its own
(``conv_nd.py``; ``gpu_window_nd.py`` on GPU kinds): the candidates above are tuned for 2-D planes.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, kernel_sources, thread_share
from engine_onnx.dims import Dim, Mono, dim_c, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.gpu import GpuKernelSpec
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.conv_geometry import ConvGeometry, conv_geometry
from engine_onnx.ops.conv_winograd import (winograd4_eligible, winograd_body, winograd_defs, winograd_eligible,
                                          winograd_helpers, winograd_weight, winograd_workspace)
from engine_onnx.ops.gemm_c import GEMM_CANDIDATES, GEMM_PREAMBLE, OWN_BINARY_ROUTINES
from engine_onnx.ops.conv_batch_gemm import (batch_gemm_body, batch_gemm_eligible, batch_gemm_source,
                                            batch_gemm_weight)
from engine_onnx.ops.conv_pointwise import pointwise_body
from engine_onnx.ops.conv_strided import strided_body, strided_eligible
from engine_onnx.ops.conv_nd import conv_nd_spec
from engine_onnx.ops.gpu_conv import conv_kernel
from engine_onnx.ops.gpu_window_nd import conv_nd_kernel
from engine_onnx.ops.phase_plane import MAX_PLANE_FLOATS, PHASE_PLANE, phase_plane_floats
from engine_onnx.ops.registry import register
from engine_onnx.ops.window_nd import Window, window_of

__all__ = ["ConvOperands"]

F32 = np.dtype("float32")


def _fold_batchnorm(ctx: LoweringContext, out_name: str, w: np.ndarray, b: np.ndarray):
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


def _channel_vector(k: np.ndarray, oc: int, rank: int) -> np.ndarray | None:
    """``k`` as one float64 value per output channel where, broadcast against a ``[N, OC, ...]``
    output of ``rank`` axes, it varies along the channels at most (and does not widen the output)."""
    if k.dtype != F32 or k.ndim > rank:
        return None
    shape = (1,) * (rank - k.ndim) + k.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, oc):
        return None
    return np.broadcast_to(k.reshape(-1).astype(np.float64), (oc,))


def _fold_channel_affine(ctx: LoweringContext, out_name: str, w: np.ndarray, b: np.ndarray, oc: int, rank: int):
    """Folds the constant per-channel ``Mul``/``Add``/``Sub``/``Div`` nodes that follow (a Caffe
    export's ``Scale`` after its BatchNormalization: Inception-v2's and DenseNet's every Conv) into
    the weights and bias. Returns (w, b, the name of the last folded value or None)."""
    last = None
    w64, b64 = w.astype(np.float64), b.astype(np.float64)
    while (node := ctx.sole_consumer(out_name)) is not None and node.op_type in ("Mul", "Add", "Sub", "Div"):
        if len(node.input) != 2 or node.input[0] == node.input[1]:
            break
        first = node.input[0] == out_name
        other = ctx.const(node.input[1] if first else node.input[0])
        k = None if other is None else _channel_vector(other, oc, rank)
        if k is None or (node.op_type == "Div" and (not first or not np.all(k))):
            break
        scale = k.reshape(-1, *([1] * (w.ndim - 1)))
        if node.op_type == "Mul":
            w64, b64 = w64 * scale, b64 * k
        elif node.op_type == "Div":
            w64, b64 = w64 / scale, b64 / k
        elif node.op_type == "Add":
            b64 = b64 + k
        elif first:  # out - k
            b64 = b64 - k
        else:  # k - out
            w64, b64 = -w64, k - b64
        ctx.mark_fused(node)
        out_name = last = node.output[0]
    if last is None:
        return w, b, None
    return w64.astype(np.float32), b64.astype(np.float32), last


def _conv_defs(**values: int) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in values.items())


# Every candidate addresses its output and residual planes through these: the output may be the
# channels YOFF.. of a Concat buffer of YC channels (concat_slices.py); the residual never is.
_PLANES = ("#define YPLANE(nn, oc) (Y + ((nn) * YC + YOFF + (oc)) * (int64_t)(OH * OW))\n"
           "#define RPLANE(nn, oc) (R + ((nn) * OC + (oc)) * (int64_t)(OH * OW))\n")


# The fused packed convolution: one OpenMP region per call; each thread owns output tiles (a range
# of output channels x a range of output pixels of one image and group), builds the im2col rows of
# its tile straight into its packed B panel (the column matrix is never materialised), runs the
# packed micro-kernel and applies bias, residual and activation to the tile while it is in cache.
_IMPLICIT_PACK = r"""
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
/* Rows k0..k0+kc of image xg's im2col matrix, output pixels n0..n0+nc, into NR-column panels.
   Per panel, each (kh, kw) gets the 16 input offsets (-1 in the padding) and whether they are one
   contiguous run (stride 1 inside a row), which is then copied with two vector moves. */
static void conv_pack_b(const float *xg, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float *dst) {
#if ONE_BY_ONE
    gemm_pack_b(kc, nc, xg + k0 * (OH * OW) + n0, OH * OW, dst);
#else
    int32_t off[KH * KW][GP_NR];
    int contig[KH * KW];
    for (int64_t j = 0; j < nc; j += GP_NR) {
        const int64_t nr = nc - j < GP_NR ? nc - j : GP_NR;
        for (int64_t q = 0; q < GP_NR; q++) {
            const int64_t col = n0 + j + q, oh = col / OW, ow = col % OW;
            for (int64_t kh = 0; kh < KH; kh++)
                for (int64_t kw = 0; kw < KW; kw++) {
                    const int64_t ih = oh * SH - PT + kh * DH, iw = ow * SW - PL + kw * DW;
                    const int ok = q < nr && ih >= 0 && ih < H && iw >= 0 && iw < W;
                    off[kh * KW + kw][q] = ok ? (int32_t)(ih * W + iw) : -1;
                }
        }
        for (int64_t p = 0; p < KH * KW; p++) {
            int c = off[p][0] >= 0;
            for (int64_t q = 1; q < GP_NR; q++) c &= off[p][q] == off[p][0] + q;
            contig[p] = c;
        }
        int64_t ic = k0 / (KH * KW), p = k0 % (KH * KW);
        for (int64_t r = 0; r < kc; r++, dst += GP_NR) {
            const float *x = xg + ic * (H * W);
            const int32_t *o = off[p];
            if (contig[p]) {
                st8(dst, ld8(x + o[0])); st8(dst + 8, ld8(x + o[0] + 8));
            } else {
                for (int64_t q = 0; q < GP_NR; q++) dst[q] = o[q] >= 0 ? x[o[q]] : 0.0f;
            }
            if (++p == KH * KW) { p = 0; ic++; }
        }
    }
#endif
}
#pragma GCC pop_options
"""


def _implicit_body(n, head: str, tile_epilogue: str) -> str:
    return head + f"""    int64_t tm, tn;
    gemm_grid(OCG, OH * OW, {dim_c(n)} * GROUPS, &tm, &tn);
    const int64_t cm = (OCG + tm - 1) / tm, cn = (OH * OW + tn - 1) / tn, kcb = gemm_kc(KC);
    const int64_t tiles = {dim_c(n)} * GROUPS * cm * cn;
    #pragma omp parallel if (tiles > 1)
    {{
        float ap[GP_MC * GP_KC] __attribute__((aligned(64)));
        float bp[GP_KC * GP_NC] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {{
            const int64_t u = t / (cm * cn), rest = t % (cm * cn), nn = u / GROUPS, g = u % GROUPS;
            const int64_t m0 = (rest / cn) * tm, n0 = (rest % cn) * tn;
            const int64_t m1 = m0 + tm < OCG ? m0 + tm : OCG, n1 = n0 + tn < OH * OW ? n0 + tn : OH * OW;
            const float *xg = X + (nn * C + g * CG) * (H * W), *wg = Wt + g * OCG * KC;
            float *yg = YPLANE(nn, g * OCG);
            for (int64_t k0 = 0; k0 < KC; k0 += kcb) {{
                const int64_t kc = KC - k0 < kcb ? KC - k0 : kcb;
                conv_pack_b(xg, k0, kc, n0, n1 - n0, bp);
                for (int64_t mb = m0; mb < m1; mb += GP_MC) {{
                    const int64_t mc = m1 - mb < GP_MC ? m1 - mb : GP_MC;
                    gemm_pack_a(mc, kc, wg + mb * KC + k0, KC, ap);
                    gemm_macro(mc, n1 - n0, kc, ap, bp, yg + mb * (OH * OW) + n0, OH * OW, k0 > 0);
                }}
            }}
            for (int64_t m = m0; m < m1; m++) {{
                const int64_t oc = g * OCG + m;
                const float bias = Bv[oc];
                float *y = yg + m * (OH * OW);
                const float *res = RPLANE(nn, oc); (void)res;
                for (int64_t i = n0; i < n1; i++) y[i] = {tile_epilogue};
            }}
        }}
    }}
"""


_DEPTHWISE = r"""
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
/* Planes q0..q1 (image * OC + output channel), each input plane copied into buf (PP_PLANE floats,
   zero padding: phase_plane.py) so that every tap of an output vector is one unaligned load; an
   input plane shared by consecutive output channels (a depth multiplier) is copied once. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void dep_planes(int64_t q0, int64_t q1, const float *X, const float *Wt, const float *Bv,
                       const float *R, float *Y, float *buf) {
    float accs[2 * PP_NV8] __attribute__((aligned(32)));
    const float *last = 0;
    pp_clear(buf, 0.0f);
    for (int64_t q = q0; q < q1; q++) {
        const int64_t nn = q / OC, oc = q % OC;
        const float *x = X + (nn * C + oc / OCG) * (H * W), *wt = Wt + oc * (KH * KW);
        if (x != last) pp_fill(x, buf);
        last = x;
        const float bias = Bv[oc];
        float *y = YPLANE(nn, oc);
        const float *res = RPLANE(nn, oc); (void)res;
        /* Two output rows at a time, each tap sum split in two (even and odd taps): four
           independent FMA chains, so the FMA latency does not bound the loop. */
        for (int64_t oh0 = 0; oh0 < OH; oh0 += 2) {
            const int64_t rows = OH - oh0 < 2 ? OH - oh0 : 2;
            for (int64_t v = 0; v < PP_NV8; v += 8) {
                pp_v8sf a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
                for (int64_t kh = 0; kh < KH; kh++)
                    for (int64_t kw = 0; kw < KW; kw++) {
                        const float wv = wt[kh * KW + kw];
                        const pp_v8sf x0 = pp_ld8(PP_TAP(buf, oh0, kh, kw) + v);
                        const pp_v8sf x1 = pp_ld8(PP_TAP(buf, oh0 + rows - 1, kh, kw) + v);
                        if ((kh * KW + kw) & 1) { a1 += wv * x0; b1 += wv * x1; }
                        else { a0 += wv * x0; b0 += wv * x1; }
                    }
                pp_st8(accs + v, a0 + a1);
                pp_st8(accs + PP_NV8 + v, b0 + b1);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float *acc = accs + r * PP_NV8;
                for (int64_t ow = 0; ow < OW; ow++) {
                    const int64_t i = (oh0 + r) * OW + ow;
                    y[i] = EPILOGUE;
                }
            }
        }
    }
}
#pragma GCC pop_options
"""


def _depthwise(n, head: str, epilogue_expr: str) -> tuple[str, str]:
    """One input channel per output channel (``CG == 1``): (preamble, entry body). Each thread takes
    an even share of the planes and runs them through ``dep_planes`` (AVX2+FMA where the machine has
    them: ``target_clones``), with its own plane buffer on its stack."""
    buf = "        float buf[PP_PLANE] __attribute__((aligned(64)));\n"
    body = head + thread_share(f"{dim_c(n)} * OC", "dep_planes(lo, hi, X, Wt, Bv, R, Y, buf)",
                               condition="count_ > 1", thread_locals=buf)
    return PHASE_PLANE + _DEPTHWISE.replace("EPILOGUE", epilogue_expr), body


@attrs.frozen(eq=False)
class ConvOperands:
    """The tensors one Conv kernel reads and writes: the input, the weight and bias (their names, and
    their folded values when known at import), the fused residual ``Add`` (operand name, sum name)
    and activations (``epilogue``), and the output the kernel writes (``final``, ``out_shape``)."""

    x: str
    weight_name: str
    weight: np.ndarray | None
    bias_name: str | None
    bias: np.ndarray | None
    residual: tuple[str, str] | None
    epilogue: Callable[[str], str]
    final: str
    out_shape: list[Dim]


def _emit_gpu(ctx: LoweringContext, ops: ConvOperands, geo: ConvGeometry) -> None:
    """The Conv as GPU kernels (``gpu_conv.conv_kernel``), reading the same folded weight matrix,
    bias, residual and epilogue as the CPU candidates (none of their extra weights)."""
    spec = conv_kernel(geo.batch, geo.channels, geo.out_channels, geo.groups, geo.spatial, geo.kernel, geo.strides,
                       geo.dilations, geo.pads_begin, geo.out, bool(ops.residual), ops.epilogue)
    _emit_plain(ctx, spec, ops, geo.out_channels)


def _emit_nd(ctx: LoweringContext, ops: ConvOperands, c: int, oc: int, group: int, window: Window) -> None:
    """A 3-D Conv: its one direct kernel (``conv_nd``, or ``gpu_window_nd`` on GPU kinds), reading
    the same folded weight matrix, bias, residual and epilogue as the 2-D candidates."""
    spec: KernelSpec | GpuKernelSpec
    if ctx.gpu:
        spec = conv_nd_kernel(ops.out_shape[0], c, oc, group, window, bool(ops.residual), ops.epilogue)
    else:
        spec = conv_nd_spec(ops.out_shape[0], c, oc, group, window, bool(ops.residual), ops.epilogue)
    _emit_plain(ctx, spec, ops, oc)


def _emit_plain(ctx: LoweringContext, spec: KernelSpec | GpuKernelSpec, ops: ConvOperands, oc: int) -> None:
    """Emits ``spec`` over the input, the weight as an ``[OC, CG*taps]`` matrix, the bias and the
    residual (a weight or bias computed at run time read as it is), into its own output tensor."""
    wn, w, bn_in, b = ops.weight_name, ops.weight, ops.bias_name, ops.bias
    wname = wn if w is None else ctx.add_weight(np.ascontiguousarray(w.reshape(oc, -1), dtype=np.float32), wn)
    bname = bn_in if b is None else ctx.add_weight(np.ascontiguousarray(b, dtype=np.float32), bn_in or wn + ".bias")
    inputs = [ops.x, wname, bname] + ([ops.residual[0]] if ops.residual else [])
    ctx.emit(spec, inputs, [(ops.final, F32, ops.out_shape)])


@register("Conv")
def _conv(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x, wn = node.input[0], node.input[1]
    for n in (x, wn):
        if ctx.dtype(n) != F32:
            raise NodeUnsupported(f"Conv on {ctx.dtype(n).name} (float32 only)")
    w = ctx.const(wn)
    w_shape = [int(d) if not isinstance(d, Mono) else d for d in ctx.shape(wn)]
    if any(isinstance(d, Mono) for d in w_shape):
        raise NodeUnsupported("a Conv weight with dynamic dimensions")
    xs = list(ctx.shape(x))
    if len(xs) not in (3, 4, 5):
        raise NodeUnsupported(f"{len(xs) - 2}-D convolution (1-D, 2-D and 3-D only)")
    if any(isinstance(d, Mono) for d in xs[1:]):
        raise NodeUnsupported("dynamic channel or spatial dimensions (only the batch may be dynamic)")
    group = int(ctx.attr(node, "group", 1))
    oc, cg = w_shape[0], w_shape[1]
    c = xs[1]
    if len(w_shape) != len(xs) or cg * group != c or oc % group:
        raise NodeUnsupported(f"weight {w_shape} does not match {c} channels in {group} groups")
    bn_in = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if bn_in is not None and ctx.dtype(bn_in) != F32:
        raise NodeUnsupported(f"Conv bias of {ctx.dtype(bn_in).name} (float32 only)")
    b = ctx.const(bn_in) if bn_in is not None else np.zeros(oc, np.float32)
    spatial = xs[2:]
    kernel = w_shape[2:]
    strides, dil, pb, pe, out_sp = conv_geometry(ctx, node, spatial, kernel)
    bn_out = None
    if w is not None and b is not None:  # a weight computed at run time is used as it is (no folding)
        w, b, bn_out = _fold_batchnorm(ctx, node.output[0], w, b)
        w, b, scaled = _fold_channel_affine(ctx, bn_out or node.output[0], w, b, oc, len(xs))
        bn_out = scaled or bn_out
    n = xs[0]
    out_shape = [n, oc] + out_sp
    residual = ctx.take_residual_add(bn_out or node.output[0], F32, out_shape)
    ep, final = ctx.take_epilogue(node, F32, residual[1] if residual else bn_out)
    operands = ConvOperands(x, wn, w, bn_in, b, residual, ep, final, out_shape)
    if len(spatial) == 3:
        _emit_nd(ctx, operands, c, oc, group, window_of(spatial, kernel, strides, dil, pb, pe, out_sp))
        return
    if len(spatial) == 1:
        spatial, kernel, strides, dil, pb, out_sp = [1] + spatial, [1] + kernel, [1] + strides, [1] + dil, \
            [0] + pb, [1] + out_sp
    H, W = spatial
    KH, KW = kernel
    OH, OW = out_sp
    if OH <= 0 or OW <= 0:
        raise NodeUnsupported("empty output")
    if ctx.gpu:
        _emit_gpu(ctx, operands, ConvGeometry(n, c, oc, group, [H, W], [KH, KW], strides, dil, pb, [OH, OW]))
        return
    # Where the output is only a channel Concat's input, the planes go straight into its buffer.
    place = ctx.take_concat_slice(final, F32, out_shape)
    kc = cg * KH * KW
    ocg = oc // group
    one_by_one = KH == KW == 1 and strides == [1, 1] and pb == [0, 0] and not any(pe) and dil == [1, 1]
    hpad = (OH - 1) * strides[0] + (KH - 1) * dil[0] + 1
    defs = _conv_defs(C=c, H=H, W=W, OC=oc, CG=cg, OCG=ocg, KH=KH, KW=KW, SH=strides[0], SW=strides[1],
                      PT=pb[0], PL=pb[1], DH=dil[0], DW=dil[1], OH=OH, OW=OW, KC=kc, GROUPS=group,
                      ONE_BY_ONE=int(one_by_one), HPAD=hpad, YC=place.channels if place else oc,
                      YOFF=place.offset if place else 0) + _PLANES
    # The Winograd weights, when offered, are the last inputs (after the residual), before the output.
    winograd = winograd_eligible([KH, KW], strides, dil, group, c, w is not None)
    winograd4 = winograd4_eligible([KH, KW], strides, dil, group, c, oc, w is not None)
    batch_gemm = batch_gemm_eligible(one_by_one, group, c, w is not None)
    out_slot = 3 + bool(residual) + winograd + winograd4 + batch_gemm + bool(place and place.buffer)
    head = ("    const float *X = (const float *)t[0], *Wt = (const float *)t[1], *Bv = (const float *)t[2];\n"
            f"    const float *R = (const float *){'t[3]' if residual else 'X'}; (void)R;\n"
            f"    float *Y = (float *)t[{out_slot}];\n")
    res_term = " + res[i]" if residual else ""
    epilogue = ("    for (int64_t i = 0; i < OH * OW; i++) y[i] = " + ep(f"(y[i] + bias{res_term})") + ";\n")
    direct = head + f"""    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < {dim_c(n)} * OC; q++) {{
        const int64_t nn = q / OC, oc = q % OC, g = oc / OCG;
        float *y = YPLANE(nn, oc);
        const float *res = RPLANE(nn, oc); (void)res;
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
    bodies = [("conv_direct", direct)]
    # The explicit im2col path once per tuned GEMM routine, so a new routine (a BLAS) is a Conv
    # candidate too; the straightforward one is left out (it never wins at convolution sizes and
    # every entry costs compile time at conversion).
    for entry, fn in GEMM_CANDIDATES:
        if entry == "simple":
            continue
        bodies.append((f"conv_im2col_{entry}", head + f"""    for (int64_t nn = 0; nn < {dim_c(n)}; nn++)
      for (int64_t g = 0; g < GROUPS; g++) {{
        const float *xg = X + (nn * C + g * CG) * H * W;
{cols}        {fn}(OCG, OH * OW, KC, Wt + g * OCG * KC, KC, B, OH * OW, YPLANE(nn, g * OCG), OH * OW);
      }}
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < {dim_c(n)} * OC; q++) {{
        float *y = YPLANE(q / OC, q % OC);
        const float *res = RPLANE(q / OC, q % OC); (void)res;
        const float bias = Bv[q % OC];
    {epilogue}    }}
"""))
    bodies.append(("conv_implicit", _implicit_body(n, head, ep(f"(y[i] + bias{res_term})"))))
    # A depthwise plane buffer lives on the thread's stack: only for planes of moderate size.
    depthwise = ""
    if cg == 1 and phase_plane_floats(int(OW), int(KW), strides[1], dil[1], hpad) <= MAX_PLANE_FLOATS:
        depthwise, dw_body = _depthwise(n, head, ep(f"(acc[ow] + bias{res_term})"))
        bodies.append(("conv_depthwise", dw_body))
    workspace = 0 if one_by_one else kc * OH * OW * 4
    extra_inputs = []
    if winograd:  # appended last: the other candidates' indices must not move
        bodies.append(("conv_winograd", winograd_body(dim_c(n), head, 3 + bool(residual))))
        defs += winograd_defs(c, oc, OH, OW) + winograd_helpers(lambda v: ep(f"({v} + bias{res_term})"))
        workspace = max(workspace, winograd_workspace(c, OH, OW))
        extra_inputs.append(ctx.add_weight(winograd_weight(w), wn + ".winograd"))
    pointwise = ""
    # Few input channels per group (MobileNet's, ShuffleNet's 1x1s): where packing costs what it saves.
    if one_by_one and cg <= 64:  # appended last too (a 1x1 Conv never has conv_winograd): no index moves
        pointwise, pw_body = pointwise_body(n, head, lambda v: ep(f"({v} + bias{res_term})"))
        bodies.append(("conv_pointwise", pw_body))
    strided = ""
    # Few input channels, any stride (a first layer): the im2col rows cost more than the product.
    if strided_eligible([KH, KW], strides, dil, group, c, [OH, OW], one_by_one):  # appended last: no index moves
        strided, st_body = strided_body(n, head, lambda v: ep(f"({v} + bias{res_term})"), c=c, kernel=[KH, KW],
                                        strides=strides, dil=dil, out=[OH, OW])
        bodies.append(("conv_strided", st_body))
    if winograd4:  # appended last: no index moves
        bodies.append(("conv_winograd4", winograd_body(dim_c(n), head, 3 + bool(residual) + winograd, m=4)))
        defs += winograd_defs(c, oc, OH, OW, m=4) + winograd_helpers(lambda v: ep(f"({v} + bias{res_term})"), m=4)
        workspace = max(workspace, winograd_workspace(c, OH, OW, m=4))
        extra_inputs.append(ctx.add_weight(winograd_weight(w, m=4), wn + ".winograd4"))
    batched = ""
    if batch_gemm:  # appended last: no index moves
        batched = batch_gemm_source(lambda v: ep(f"({v} + bias{res_term})"))
        bodies.append(("conv_batch_gemm", batch_gemm_body(n, head, 3 + bool(residual) + len(extra_inputs))))
        extra_inputs.append(ctx.add_weight(batch_gemm_weight(w), wn + ".packed"))
    syms = tuple(symbols_of([n]))
    source, own = kernel_sources(GEMM_PREAMBLE + defs + _IMPLICIT_PACK + depthwise + pointwise + strided + batched,
                                 bodies, syms, OWN_BINARY_ROUTINES)
    # A run-time weight [OC, CG, KH, KW] is already the [OC, CG*KH*KW] matrix every candidate reads.
    wname = wn if w is None else ctx.add_weight(np.ascontiguousarray(w.reshape(oc, -1), dtype=np.float32), wn)
    bname = bn_in if b is None else ctx.add_weight(np.ascontiguousarray(b, dtype=np.float32), bn_in or wn + ".bias")
    spec = KernelSpec("conv", source, tuple(e for e, _ in bodies), syms, workspace, entry_sources=own)
    inputs = [x, wname, bname] + ([residual[0]] if residual else []) + extra_inputs
    if place is None:
        ctx.emit(spec, inputs, [(final, F32, out_shape)])
    elif place.buffer is None:
        ctx.emit(spec, inputs, [(place.name, F32, place.shape)])
    else:
        ctx.emit(spec, inputs + [place.buffer], [(place.name, F32, place.shape)], in_place={0: len(inputs)})
