"""``conv_pointwise``: a 1x1, stride-1, unpadded Conv (grouped or not) as a direct product.

MobileNet's and ShuffleNet's 1x1 Convs have few input channels per group (6 to 160), so their
product is short in K and long in pixels: packing the operands (``conv_im2col_packed``,
``conv_implicit``) costs as much as it saves, and the im2col path writes the output and then reads
it again for the bias and activation. Here each thread takes output tiles (``gemm_grid``: images x
groups x rows x pixel columns) and computes 6 output channels x 16 pixels at a time straight from
the input rows (one broadcast weight per channel, two vector loads per input channel: 12 FMA
chains), stores the 6x16 block to a local tile and writes it once, with bias, residual and
activation applied. A pixel edge narrower than 16 reads a zero-padded copy of its columns; an edge
of fewer than 6 channels repeats the last channel's weights and writes only its own rows.
"""

from __future__ import annotations

from typing import Callable

from engine_onnx.dims import Dim, dim_c
from engine_onnx.vecmath import NO_TRAPS

__all__ = ["POINTWISE", "TILE_6X16", "pointwise_body"]

#: A 6 x 16 register block (output channels x pixels) in 12 vector accumulators, one broadcast weight
#: per channel and two 8-float pixel vectors per step: 12 independent FMA chains. An edge of fewer
#: than 6 channels repeats the last channel's weights (``T616_WEIGHTS``); the caller writes only its
#: own rows. Shared by ``conv_pointwise`` and ``conv_strided``; needs ``GEMM_PREAMBLE``'s ``v8sf``.
TILE_6X16 = r"""
#ifndef T616_STEP
#define T616_WEIGHTS(base, k, mr) \
    const float *w0 = (base), *w1 = w0 + ((mr) > 1 ? (k) : 0), *w2 = w0 + ((mr) > 2 ? 2 * (k) : ((mr) - 1) * (k)); \
    const float *w3 = w0 + ((mr) > 3 ? 3 * (k) : ((mr) - 1) * (k)), *w4 = w0 + ((mr) > 4 ? 4 * (k) : ((mr) - 1) * (k)); \
    const float *w5 = w0 + ((mr) - 1) * (k)
#define T616_ZERO \
    v8sf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}; \
    v8sf c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0}
#define T616_STEP(k, b0, b1) do { \
    float a_ = w0[k]; c00 += a_ * (b0); c01 += a_ * (b1); \
    a_ = w1[k]; c10 += a_ * (b0); c11 += a_ * (b1); \
    a_ = w2[k]; c20 += a_ * (b0); c21 += a_ * (b1); \
    a_ = w3[k]; c30 += a_ * (b0); c31 += a_ * (b1); \
    a_ = w4[k]; c40 += a_ * (b0); c41 += a_ * (b1); \
    a_ = w5[k]; c50 += a_ * (b0); c51 += a_ * (b1); } while (0)
#define T616_STORE(tile) do { \
    st8((tile), c00); st8((tile) + 8, c01); st8((tile) + 16, c10); st8((tile) + 24, c11); \
    st8((tile) + 32, c20); st8((tile) + 40, c21); st8((tile) + 48, c30); st8((tile) + 56, c31); \
    st8((tile) + 64, c40); st8((tile) + 72, c41); st8((tile) + 80, c50); st8((tile) + 88, c51); } while (0)
#endif
"""

#: The tile routine; needs the Conv's geometry macros and ``GEMM_PREAMBLE`` (``v8sf``, ``gemm_grid``).
POINTWISE = TILE_6X16 + r"""
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
""" + NO_TRAPS + r"""#define PW_MR 6
#define PW_NR 16
/* Output channels m0..m1 (within group g) x pixels p0..p1 of image nn. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void pw_tile(int64_t nn, int64_t g, int64_t m0, int64_t m1, int64_t p0, int64_t p1, const float *X,
                    const float *Wt, const float *Bv, const float *R, float *Y) {
    const float *x = X + (nn * C + g * CG) * (OH * OW);
    float tile[PW_MR * PW_NR] __attribute__((aligned(32)));
    float edge[PW_NR] __attribute__((aligned(32)));
    for (int64_t m = m0; m < m1; m += PW_MR) {
        const int64_t mr = m1 - m < PW_MR ? m1 - m : PW_MR;
        T616_WEIGHTS(Wt + (g * OCG + m) * CG, CG, mr);
        for (int64_t p = p0; p < p1; p += PW_NR) {
            const int64_t nr = p1 - p < PW_NR ? p1 - p : PW_NR;
            T616_ZERO;
            const float *xp = x + p;
            for (int64_t k = 0; k < CG; k++, xp += OH * OW) {
                v8sf b0, b1;
                if (nr == PW_NR) {
                    b0 = ld8(xp); b1 = ld8(xp + 8);
                } else {
                    for (int64_t j = 0; j < PW_NR; j++) edge[j] = j < nr ? xp[j] : 0.0f;
                    b0 = ld8(edge); b1 = ld8(edge + 8);
                }
                T616_STEP(k, b0, b1);
            }
            T616_STORE(tile);
            for (int64_t r = 0; r < mr; r++) {
                const int64_t oc = g * OCG + m + r;
                const float bias = Bv[oc];
                const float *acc = tile + r * PW_NR;
                float *y = YPLANE(nn, oc) + p;
                const float *res = RPLANE(nn, oc) + p; (void)res;
                if (nr == PW_NR) {  /* vectorised: the compiler scalarises the fully unrolled loop otherwise */
                    #pragma omp simd
                    for (int64_t i = 0; i < PW_NR; i++) y[i] = EPILOGUE;
                } else {
                    for (int64_t i = 0; i < nr; i++) y[i] = EPILOGUE;
                }
            }
        }
    }
}
#pragma GCC pop_options
"""


def pointwise_body(n: Dim, head: str, epilogue: Callable[[str], str]) -> tuple[str, str]:
    """(preamble, entry body) of ``conv_pointwise``; ``epilogue(v)`` is the C expression of an output
    element from its product ``v`` (bias, residual ``res[i]`` and activation)."""
    body = head + f"""    int64_t tm, tn;
    gemm_grid(OCG, OH * OW, {dim_c(n)} * GROUPS, &tm, &tn);
    const int64_t cm = (OCG + tm - 1) / tm, cn = (OH * OW + tn - 1) / tn;
    const int64_t tiles = {dim_c(n)} * GROUPS * cm * cn;
    #pragma omp parallel for schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {{
        const int64_t u = t / (cm * cn), rest = t % (cm * cn);
        const int64_t m0 = (rest / cn) * tm, n0 = (rest % cn) * tn;
        const int64_t m1 = m0 + tm < OCG ? m0 + tm : OCG, n1 = n0 + tn < OH * OW ? n0 + tn : OH * OW;
        pw_tile(u / GROUPS, u % GROUPS, m0, m1, n0, n1, X, Wt, Bv, R, Y);
    }}
"""
    return POINTWISE.replace("EPILOGUE", epilogue("acc[i]")), body
