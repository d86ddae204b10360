"""The padded, stride-phase-split plane buffer that the depthwise Conv and the pooling kernels read.

A window op (a depthwise 3x3, a 3x3 pool) over an NCHW plane touches each input element up to
KH*KW times. Copying the plane once into a buffer that already holds the padding (zeros for a
convolution or an average, -inf for a maximum) and whose columns are split by stride phase makes
every tap of every stride one contiguous run: tap (kh, kw) of output columns [ow, ow + 8) of
output row oh is the 8 floats at ``PP_TAP(buf, oh, kh, kw) + ow``. The kernel then has no border
case and no gather, and its vector loads stay inside the buffer (each phase row is whole 8-float
vectors of output plus the taps' reach).

The source here is C that expects the includer's geometry macros (``H W OH OW KH KW SH SW PT PL
DH DW HPAD``, ``HPAD`` = the padded rows the windows read) and defines ``PP_*`` names only, so it
can sit next to the GEMM preamble in one kernel source.
"""

from __future__ import annotations

__all__ = ["MAX_PLANE_FLOATS", "PHASE_PLANE", "phase_plane_floats"]

#: Floats of a buffer the kernels keep on each thread's stack at most (the planes that need more
#: use the op's other candidates or code path).
MAX_PLANE_FLOATS = 64 * 1024


def phase_plane_floats(ow: int, kw: int, sw: int, dw: int, hpad: int) -> int:
    """Floats of one plane buffer: ``sw`` phases of ``hpad`` rows of ``PP_WQ`` floats."""
    return sw * hpad * (-(-ow // 8) * 8 + (kw - 1) * dw // sw)


PHASE_PLANE = r"""
#ifndef ENGINE_ONNX_PHASE_PLANE
#define ENGINE_ONNX_PHASE_PLANE
typedef float pp_v8sf __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t pp_v8si __attribute__((vector_size(32)));
#define pp_ld8(p) (*(const pp_v8sf *)(p))
#define pp_st8(p, v) (*(pp_v8sf *)(p) = (v))
#define PP_NV8 (((OW + 7) / 8) * 8)
#define PP_WQ (PP_NV8 + ((KW - 1) * DW) / SW)
#define PP_PLANE (SW * HPAD * PP_WQ)
/* Column j of phase p is padded column j*SW + p; tap (kh, kw) of output row oh starts here. */
#define PP_TAP(buf, oh, kh, kw) \
    ((buf) + ((((kw) * DW) % SW) * HPAD + (oh) * SH + (kh) * DH) * PP_WQ + ((kw) * DW) / SW)

/* Every element of buf set to the padding value; pp_fill rewrites only the interior. */
static inline __attribute__((always_inline)) void pp_clear(float *buf, float pad) {
    for (int64_t i = 0; i < PP_PLANE; i++) buf[i] = pad;
}

/* Input plane x (H x W) into buf's interior: padded column c = iw + PL goes to phase c % SW,
   column c / SW, of row ih + PT. Rows and columns past what the windows read are skipped. */
static inline __attribute__((always_inline)) void pp_fill(const float *x, float *buf) {
    if (SW == 2) {  /* even and odd columns split with two shuffles per 16 floats */
        const pp_v8si ev = {0, 2, 4, 6, 8, 10, 12, 14}, od = {1, 3, 5, 7, 9, 11, 13, 15};
        const int64_t c0 = PL / 2, c1 = (PL + 1) / 2, cmax = c0 > c1 ? c0 : c1;
        for (int64_t ih = 0; ih < H && ih + PT < HPAD; ih++) {
            const float *xr = x + ih * W;
            float *d0 = buf + ((PL % 2) * HPAD + ih + PT) * PP_WQ + c0;
            float *d1 = buf + (((PL + 1) % 2) * HPAD + ih + PT) * PP_WQ + c1;
            int64_t k = 0;
            for (; 2 * k + 16 <= W && k + 8 + cmax <= PP_WQ; k += 8) {
                const pp_v8sf a = pp_ld8(xr + 2 * k), b = pp_ld8(xr + 2 * k + 8);
                pp_st8(d0 + k, __builtin_shuffle(a, b, ev));
                pp_st8(d1 + k, __builtin_shuffle(a, b, od));
            }
            for (; 2 * k < W; k++) {
                if (k + c0 < PP_WQ) d0[k] = xr[2 * k];
                if (2 * k + 1 < W && k + c1 < PP_WQ) d1[k] = xr[2 * k + 1];
            }
        }
    } else {
        for (int64_t ph = 0; ph < SW; ph++) {
            const int64_t jlo = PL - ph > 0 ? (PL - ph + SW - 1) / SW : 0;
            int64_t jhi = (W + PL - ph + SW - 1) / SW;
            if (jhi > PP_WQ) jhi = PP_WQ;
            for (int64_t ih = 0; ih < H && ih + PT < HPAD; ih++) {
                float *d = buf + (ph * HPAD + ih + PT) * PP_WQ;
                const float *xr = x + ih * W + ph - PL;
                for (int64_t j = jlo; j < jhi; j++) d[j] = xr[j * SW];
            }
        }
    }
}
#endif
"""
