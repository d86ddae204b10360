"""``conv_strided``: a direct Conv for few input channels (a CNN's first layer), any stride.

A first layer (squeezenet's 3x3 stride 2 over 3 channels, ResNet's 7x7 stride 2, MobileNet's and
ShuffleNet's 3x3 stride 2) is a product with a tiny K (``C*KH*KW``: 27 to 147) and a long pixel
dimension, so the GEMM candidates spend most of their time building the im2col rows: with a
stride, ``conv_implicit`` gathers every element through an offset table and ``conv_im2col_*``
writes all the columns to memory first. Here each thread takes groups of output rows of one image
and copies the input rows those rows read, per input channel, into a stack buffer that already
holds the zero padding and whose columns are split by stride phase (column ``j`` of phase ``p`` is
padded column ``j*SW + p``), so that every tap ``(c, kh, kw)`` of 16 consecutive output pixels is
two unaligned vector loads at a fixed offset (``cs_toff``, computed here). It then computes 6
output channels x 16 pixels in registers over all ``C*KH*KW`` taps (12 FMA chains, one broadcast
weight per channel and tap) and writes the block once with bias, residual and activation. An edge
of fewer than 6 channels repeats the last channel's weights and writes only its rows; a row's last
pixel block reads zeros past the row and writes only its own pixels. (``phase_plane.py``'s buffer
is the same layout for a whole plane, which for three channels of a 224x224 image would not fit a
thread's stack; this one holds the rows of one group of output rows.)

Every output element goes through ``YPLANE(nn, oc)`` (and the residual through ``RPLANE``), the
output plane addressing ``_conv`` defines, so the output may be a channel slice of a larger tensor.
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine_onnx.codegen import OMP_INCLUDE, thread_share
from engine_onnx.dims import Dim, dim_c
from engine_onnx.ops.conv_pointwise import TILE_6X16
from engine_onnx.vecmath import NO_TRAPS

__all__ = ["MAX_BUFFER_FLOATS", "MAX_CHANNELS", "MAX_TAPS", "strided_body", "strided_eligible"]

#: Input channels at most. Past it the packed candidates' reuse of each packed B panel across
#: many output channels pays for their packing (a 3x3 stride-2 Conv of 24 or more channels runs
#: as fast or faster through ``conv_implicit``).
MAX_CHANNELS = 16

#: ``C*KH*KW`` at most: a large few-channel kernel (AlexNet's 11x11 over 3 channels) still gains,
#: and the tap table and each 6-channel weight block stay small.
MAX_TAPS = 400

#: Floats of the per-thread row buffer at most (on the thread's stack, as ``phase_plane``'s
#: plane buffer): a Conv whose single output row already needs more is not offered.
MAX_BUFFER_FLOATS = 64 * 1024

#: Floats a row group's buffer aims at: more output rows share one copy of their input rows while
#: the copy stays near the core (L2); a group is shortened to fit.
TARGET_BUFFER_FLOATS = 16 * 1024

#: Output rows per group at most.
MAX_ROWS = 8

_MR, _NR = 6, 16


def _row_floats(c: int, kw: int, sw: int, dw: int, ow: int) -> int:
    """Floats of one input row's copy for every channel: ``sw`` phases of ``_wq`` floats."""
    return c * sw * _wq(kw, sw, dw, ow)


def _wq(kw: int, sw: int, dw: int, ow: int) -> int:
    return -(-ow // _NR) * _NR + (kw - 1) * dw // sw


def _rows_per_group(c: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, oh: int, ow: int) -> int:
    """Output rows per group: the most (up to ``MAX_ROWS``, ``oh``) whose buffer stays within
    ``TARGET_BUFFER_FLOATS``, at least 1 if one row fits ``MAX_BUFFER_FLOATS``; 0 if none."""
    per_row = _row_floats(c, kw, sw, dw, ow)
    best = 0
    for rb in range(1, min(MAX_ROWS, oh) + 1):
        floats = per_row * ((rb - 1) * sh + (kh - 1) * dh + 1)
        if floats <= TARGET_BUFFER_FLOATS or (rb == 1 and floats <= MAX_BUFFER_FLOATS):
            best = rb
    return best


def strided_eligible(kernel: Sequence[int], strides: Sequence[int], dil: Sequence[int], group: int,
                     c: int, out: Sequence[int], one_by_one: bool) -> bool:
    """Whether ``conv_strided`` is offered: one group, at most ``MAX_CHANNELS`` input channels and
    ``MAX_TAPS`` taps, not a plain 1x1 (``conv_pointwise`` and the GEMMs read its input in place),
    and one output row's buffer within ``MAX_BUFFER_FLOATS``."""
    kh, kw = kernel
    if group != 1 or one_by_one or c > MAX_CHANNELS or c * kh * kw > MAX_TAPS:
        return False
    return _rows_per_group(c, kh, kw, strides[0], strides[1], dil[0], dil[1], out[0], out[1]) > 0


_SOURCE = TILE_6X16 + r"""
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
""" + NO_TRAPS + r"""#define CS_MR 6
#define CS_NR 16
#define CS_GROUPS ((OH + CS_RB - 1) / CS_RB)
#define CS_BUF (C * CS_CSTR)

/* Input rows of output rows oh0..oh0+rb of one image (x: its first channel) into buf: channel c,
   phase p, buffer row r (input row oh0*SH - PT + r) starts at buf + c*CS_CSTR + (p*CS_HB + r)*CS_WQ;
   padding (rows and columns outside the input) is zero. */
static inline __attribute__((always_inline)) void cs_fill(const float *x, int64_t oh0, int64_t rb, float *buf) {
    const int64_t ih0 = oh0 * SH - PT, hb = (rb - 1) * SH + (KH - 1) * DH + 1;
    for (int64_t c = 0; c < C; c++)
        for (int64_t p = 0; p < SW; p++) {
            /* columns j in [jlo, jhi) hold input columns j*SW + p - PL; the rest are padding */
            const int64_t s = p - PL;
            const int64_t jlo = s >= 0 ? 0 : (-s + SW - 1) / SW;
            int64_t jhi = W - s <= 0 ? 0 : (W - s + SW - 1) / SW;
            if (jhi > CS_WQ) jhi = CS_WQ;
            for (int64_t r = 0; r < hb; r++) {
                float *d = buf + c * CS_CSTR + (p * CS_HB + r) * CS_WQ;
                const int64_t ih = ih0 + r;
                if (ih < 0 || ih >= H || jhi <= jlo) {
                    for (int64_t j = 0; j < CS_WQ; j++) d[j] = 0.0f;
                    continue;
                }
                const float *xr = x + (c * H + ih) * W + s;
                for (int64_t j = 0; j < jlo; j++) d[j] = 0.0f;
                int64_t j = jlo;
                if (SW == 2) {  /* every other column: two loads and one shuffle per 8 floats */
                    const cs_v8si ev = {0, 2, 4, 6, 8, 10, 12, 14};
                    for (; 2 * j + s + 16 <= W && j + 8 <= jhi; j += 8)
                        st8(d + j, __builtin_shuffle(ld8(xr + 2 * j), ld8(xr + 2 * j + 8), ev));
                }
                for (; j < jhi; j++) d[j] = xr[j * SW];
                for (j = jhi; j < CS_WQ; j++) d[j] = 0.0f;
            }
        }
}

/* Row groups u in [lo, hi) (image u / CS_GROUPS, output rows from (u % CS_GROUPS) * CS_RB). */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void cs_groups(int64_t lo, int64_t hi, const float *X, const float *Wt, const float *Bv,
                      const float *R, float *Y, float *buf) {
    float tile[CS_MR * CS_NR] __attribute__((aligned(32)));
    (void)R;
    for (int64_t u = lo; u < hi; u++) {
        const int64_t nn = u / CS_GROUPS, oh0 = (u % CS_GROUPS) * CS_RB;
        const int64_t rb = OH - oh0 < CS_RB ? OH - oh0 : CS_RB;
        cs_fill(X + nn * (C * H * W), oh0, rb, buf);
        for (int64_t m = 0; m < OC; m += CS_MR) {
            const int64_t mr = OC - m < CS_MR ? OC - m : CS_MR;
            T616_WEIGHTS(Wt + m * KC, KC, mr);
            /* the group's rows one after the other: each output plane is written as one run */
            for (int64_t r = 0; r < rb; r++) {
                const float *row = buf + r * SH * CS_WQ;
                const int64_t pix = (oh0 + r) * OW;
                for (int64_t ow = 0; ow < OW; ow += CS_NR) {
                    const int64_t nr = OW - ow < CS_NR ? OW - ow : CS_NR;
                    T616_ZERO;
                    const float *b = row + ow;
                    for (int64_t k = 0; k < KC; k++) {
                        const float *bk = b + cs_toff[k];
                        const v8sf b0 = ld8(bk), b1 = ld8(bk + 8);
                        T616_STEP(k, b0, b1);
                    }
                    T616_STORE(tile);
                    for (int64_t q = 0; q < mr; q++) {
                        const int64_t oc = m + q;
                        const float bias = Bv[oc];
                        const float *acc = tile + q * CS_NR;
                        float *yp = YPLANE(nn, oc) + pix + ow;
                        const float *rp = RPLANE(nn, oc) + pix + ow; (void)rp;
                        if (nr == CS_NR) {  /* vectorised: the unrolled loop is scalarised otherwise */
                            float *y = yp;
                            const float *res = rp; (void)res;
                            #pragma omp simd
                            for (int64_t i = 0; i < CS_NR; i++) y[i] = EPILOGUE;
                        } else {  /* a row's last block: through local copies, still one vector loop
                                     (a scalar loop here branches on the activation's sign) */
                            float y[CS_NR] __attribute__((aligned(32))), res[CS_NR] __attribute__((aligned(32)));
                            for (int64_t i = 0; i < CS_NR; i++) res[i] = i < nr ? rp[i] : 0.0f;
                            #pragma omp simd
                            for (int64_t i = 0; i < CS_NR; i++) y[i] = EPILOGUE;
                            for (int64_t i = 0; i < nr; i++) yp[i] = y[i];
                        }
                    }
                }
            }
        }
    }
}
#pragma GCC pop_options
"""


def strided_body(n: Dim, head: str, epilogue: Callable[[str], str], *, c: int, kernel: Sequence[int],
                 strides: Sequence[int], dil: Sequence[int], out: Sequence[int]) -> tuple[str, str]:
    """(preamble, entry body) of ``conv_strided`` for a geometry ``strided_eligible`` accepted;
    ``epilogue(v)`` is the C expression of an output element from its sum ``v`` (bias, residual
    ``res[i]`` and activation). The preamble needs ``_conv``'s geometry macros and ``GEMM_PREAMBLE``."""
    kh, kw = kernel
    sh, sw = strides
    dh, dw = dil
    oh, ow = out
    rb = _rows_per_group(c, kh, kw, sh, sw, dh, dw, oh, ow)
    wq = _wq(kw, sw, dw, ow)
    hb = (rb - 1) * sh + (kh - 1) * dh + 1
    cstr = sw * hb * wq
    # Tap (ic, i, j) of the output pixels starting at row + ow: its channel, stride phase, row and
    # column offset in the buffer.
    toff = [ic * cstr + (((j * dw) % sw) * hb + i * dh) * wq + (j * dw) // sw
            for ic in range(c) for i in range(kh) for j in range(kw)]
    table = ", ".join(str(v) for v in toff)
    defs = (f"#define CS_RB {rb}\n#define CS_WQ {wq}\n#define CS_HB {hb}\n#define CS_CSTR {cstr}\n"
            "typedef int32_t cs_v8si __attribute__((vector_size(32)));\n"
            f"static const int32_t cs_toff[KC] = {{{table}}};\n")
    buf = "        float buf[CS_BUF] __attribute__((aligned(64)));\n"
    body = head + thread_share(f"{dim_c(n)} * CS_GROUPS", "cs_groups(lo, hi, X, Wt, Bv, R, Y, buf)",
                               condition="count_ > 1", thread_locals=buf)
    return OMP_INCLUDE + defs + _SOURCE.replace("EPILOGUE", epilogue("acc[i]")), body
