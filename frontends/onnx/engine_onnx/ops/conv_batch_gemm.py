"""``conv_batch_gemm``: a 1x1, stride-1, unpadded, ungrouped Conv of a constant weight as one GEMM
over the pixels of the whole batch, its weight packed at import.

Why: the other GEMM candidates run one product per image (``[OC, C] @ [C, H*W]``) and pack the
weight again for every image and thread. Where the images are small (MobileNetV2's and ResNet's
14x14 and 7x7 layers, SqueezeNet's 13x13 ones) and the batch is not 1, that repacking and the
narrow products (49 pixels: 4 panels of 16 for 3 of work) cost as much as the multiplies. Here the
columns of the product are the batch's pixels, image after image, so a 16-column panel may hold
the end of one image and the start of the next; the weight is packed once, at import, in
``gemm_macro``'s A layout (6-row panels per block of input channels, as ``conv_winograd``'s), an
extra weight the size of the 1x1 one.

Kernel: the output columns (and, where there are fewer column chunks than threads, the rows) are
cut into tiles shared out statically in one OpenMP region. A thread packs its tile's columns for
every input channel once (B panels gathered across images: two vector loads per channel where a
panel lies inside one image), then per block of at most ``GP_MC`` output channels runs
``gemm_macro`` over the channel blocks into a tile buffer and writes it out with bias, residual and
activation, run by run within each image (through ``YPLANE``/``RPLANE``, so the output may be a
Concat's slice). Stack per thread: the packed columns (at most 64K floats, 256 KiB: the column
chunk narrows as the channel count grows) and the tile buffer (72 KiB).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from engine_onnx.dims import Dim, dim_c

__all__ = ["batch_gemm_eligible", "batch_gemm_weight", "batch_gemm_body", "batch_gemm_source", "MAX_CHANNELS"]

_MR = 6        # gemm_macro's MR
_KC = 256      # gemm_c's GP_KC: input channels per block, in even blocks (gemm_kc)


#: Input channels at most: the packed columns of all channels, at least one 16-column panel, must
#: fit the thread's buffer.
MAX_CHANNELS = 4096


def batch_gemm_eligible(one_by_one: bool, group: int, channels: int, weight_is_const: bool) -> bool:
    """Whether ``conv_batch_gemm`` is offered: a plain 1x1 Conv, one group, a constant weight, at
    most ``MAX_CHANNELS`` input channels."""
    return one_by_one and group == 1 and weight_is_const and channels <= MAX_CHANNELS


def _kc(channels: int) -> int:
    blocks = -(-channels // _KC)
    return -(-channels // blocks)


def batch_gemm_weight(w: np.ndarray) -> np.ndarray:
    """The ``[OC, C]`` weight packed as ``gemm_macro`` reads A: per block of ``kc`` input channels
    (the even blocks of ``gemm_kc``), per 6-row panel of output channels (zero-padded to a multiple
    of 6), ``kc`` rows of 6 floats. 1-D float32 array; the block at channel ``k0`` starts at
    ``k0 * OCP``."""
    oc, c = w.shape[:2]
    w2 = w.reshape(oc, c).astype(np.float32)
    ocp = -(-oc // _MR) * _MR
    padded = np.zeros((ocp, c), np.float32)
    padded[:oc] = w2
    kc = _kc(c)
    parts = []
    for k0 in range(0, c, kc):
        block = padded[:, k0:k0 + kc]                                 # [OCP, kc]
        parts.append(block.reshape(ocp // _MR, _MR, -1).transpose(0, 2, 1).reshape(-1))  # [OCP/6, kc, 6]
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


#: The tile routines; need the Conv's geometry macros, ``GEMM_PREAMBLE`` and ``YPLANE``/``RPLANE``.
BATCH_GEMM = r"""
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#define BG_OCP ((OC + GP_MR - 1) / GP_MR * GP_MR)
/* Columns j0 .. j0 + nc - 1 of the batch (column j: image j / (OH * OW), pixel j % (OH * OW)), input
   channels k0 .. k0 + kc - 1, into 16-column panels (kc x 16 each, zero past nc). */
static void bg_pack(const float *X, int64_t j0, int64_t nc, int64_t k0, int64_t kc, float *dst) {
    for (int64_t j = 0; j < nc; j += GP_NR, dst += kc * GP_NR) {
        const int64_t nr = nc - j < GP_NR ? nc - j : GP_NR;
        const int64_t first = j0 + j, img = first / (OH * OW), pix = first % (OH * OW);
        if (nr == GP_NR && pix + GP_NR <= OH * OW) {  /* inside one image: contiguous */
            const float *x = X + (img * C + k0) * (OH * OW) + pix;
            for (int64_t k = 0; k < kc; k++, x += OH * OW) {
                st8(dst + k * GP_NR, ld8(x)); st8(dst + k * GP_NR + 8, ld8(x + 8));
            }
        } else {  /* the panel's run in each image it touches, then zeros past nc */
            for (int64_t q0 = 0; q0 < GP_NR; ) {
                if (q0 >= nr) {
                    for (int64_t k = 0; k < kc; k++)
                        for (int64_t q = q0; q < GP_NR; q++) dst[k * GP_NR + q] = 0.0f;
                    break;
                }
                const int64_t col = first + q0, im = col / (OH * OW), px = col % (OH * OW);
                const int64_t len = OH * OW - px < nr - q0 ? OH * OW - px : nr - q0;
                const float *x = X + (im * C + k0) * (OH * OW) + px;
                for (int64_t k = 0; k < kc; k++, x += OH * OW)
                    for (int64_t q = 0; q < len; q++) dst[k * GP_NR + q0 + q] = x[q];
                q0 += len;
            }
        }
    }
}

/* Output channels m .. m + mr - 1 of columns j0 .. j0 + nc - 1 from the tile buffer ct (row stride
   ldt), with bias, residual and activation, one run per image. */
static void bg_store(const float *ct, int64_t ldt, int64_t m, int64_t mr, int64_t j0, int64_t nc,
                     const float *Bv, const float *R, float *Y) {
    for (int64_t r = 0; r < mr; r++) {
        const int64_t oc = m + r;
        const float bias = Bv[oc];
        const float *acc = ct + r * ldt;
        for (int64_t j = 0; j < nc; ) {
            const int64_t col = j0 + j, img = col / (OH * OW), pix = col % (OH * OW);
            const int64_t run = OH * OW - pix < nc - j ? OH * OW - pix : nc - j;
            float *y = YPLANE(img, oc) + pix;
            const float *res = RPLANE(img, oc) + pix; (void)res;
            const float *a = acc + j;
            for (int64_t i = 0; i < run; i++) y[i] = EPILOGUE;
            j += run;
        }
    }
}
#pragma GCC pop_options
"""


def batch_gemm_body(n: Dim, head: str, a_slot: int) -> str:
    """The entry's body: ``head`` is the Conv's shared prologue (``X``, ``Bv``, ``R``, ``Y``), ``a_slot``
    the tensor index of the packed weight."""
    return head + f"""    const float *Ap = (const float *)t[{a_slot}];
    const int64_t cols = {dim_c(n)} * (OH * OW), kcb = gemm_kc(C);
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* column chunks of at most 256 and of at most 64K floats of packed columns (all input channels) */
    int64_t most = 65536 / C / GP_NR * GP_NR;
    most = most < GP_NR ? GP_NR : most > GP_NC ? GP_NC : most;
    int64_t cn = (cols + most - 1) / most, cm = 1;
    /* More weight than columns (a classifier at batch 1): each thread takes a band of rows, so that
       it reads only its part of the weight; else bands of columns (pixels), as the Convs around. */
    const int rows_first = OC >= cols;
    if (rows_first) {{
        cm = threads;
    }} else if (cn < threads) {{  /* narrower chunks, then rows, until every thread has a tile */
        const int64_t want = (cols + GP_NR - 1) / GP_NR < threads ? (cols + GP_NR - 1) / GP_NR : threads;
        cn = want;
        if (cn < threads) cm = (threads + cn - 1) / cn;
    }}
    const int64_t tn = ((cols + cn - 1) / cn + GP_NR - 1) / GP_NR * GP_NR;
    cn = (cols + tn - 1) / tn;
    if ((cn * cm) % threads && cn * cm < 4 * threads) {{  /* rows too, so every thread gets as many tiles */
        int64_t a = cn, b = threads;
        while (b) {{ const int64_t r = a % b; a = b; b = r; }}
        cm = threads / a;
    }}
    const int64_t tm = ((OC + cm - 1) / cm + GP_MR - 1) / GP_MR * GP_MR;
    cm = (OC + tm - 1) / tm;
    #pragma omp parallel if (cm * cn > 1)
    {{
        float bp[65536] __attribute__((aligned(64)));  /* C x tn <= 65536: tn <= most */
        float ct[GP_MC * GP_NC] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < cm * cn; tile++) {{
            const int64_t m0 = (rows_first ? tile / cn : tile % cm) * tm;
            const int64_t j0 = (rows_first ? tile % cn : tile / cm) * tn;
            const int64_t m1 = m0 + tm < OC ? m0 + tm : OC, nc = cols - j0 < tn ? cols - j0 : tn;
            const int64_t ncp = (nc + GP_NR - 1) / GP_NR * GP_NR;
            for (int64_t k0 = 0; k0 < C; k0 += kcb) {{
                const int64_t kc = C - k0 < kcb ? C - k0 : kcb;
                bg_pack(X, j0, nc, k0, kc, bp + k0 * ncp);
            }}
            for (int64_t mb = m0; mb < m1; mb += GP_MC) {{
                const int64_t mc = m1 - mb < GP_MC ? m1 - mb : GP_MC;
                for (int64_t k0 = 0; k0 < C; k0 += kcb) {{
                    const int64_t kc = C - k0 < kcb ? C - k0 : kcb;
                    gemm_macro(mc, ncp, kc, Ap + k0 * BG_OCP + mb * kc, bp + k0 * ncp, ct, ncp, k0 > 0);
                }}
                bg_store(ct, ncp, mb, mc, j0, nc, Bv, R, Y);
            }}
        }}
    }}
"""


def batch_gemm_source(epilogue: Callable[[str], str]) -> str:
    """``BATCH_GEMM`` with ``epilogue(v)``, the C expression of an output element from its product
    ``v`` (bias, residual ``res[i]`` and activation)."""
    return BATCH_GEMM.replace("EPILOGUE", epilogue("a[i]"))
