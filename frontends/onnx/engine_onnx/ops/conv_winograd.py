"""The Winograd F(2x2, 3x3) Conv candidate ``conv_winograd`` (3x3, stride 1, dilation 1, one group).

Why: the packed GEMM already runs near the FMA roofline, so a 3x3 convolution only gets faster by
doing fewer multiplies. F(2x2, 3x3) computes a 2x2 output tile from a 4x4 input tile with 16
products per (input channel, output channel) instead of 36: the 16 "taps" of the transformed
domain are 16 independent GEMMs ``M[xi] = U[xi] @ V[xi]`` (``[OC, C] @ [C, tiles]``) between an
input transform ``V = B^T d B`` and an output transform ``Y = A^T M A`` (Lavin and Gray, "Fast
Algorithms for Convolutional Neural Networks", 2015).

Weight (``winograd_weight``): ``U = G g G^T`` is computed once at import (float64, stored as
float32), 16/9 the size of the 3x3 weight, as an extra kernel input. It is stored already packed
the way ``gemm_macro`` reads its A operand (6-row panels, ``kc`` deep, per block of input channels
and per tap), so the kernel never packs A: every block of tiles would otherwise repack all 16 taps.

Kernel (one OpenMP region per call; images a chunk at a time, see ``_geometry``):

1. ``V`` of the whole chunk goes to the workspace, already in ``gemm_macro``'s packed B layout
   (16-tile panels, per channel block and tap). It is computed one (channel, tile row) at a time,
   vectorised along the row from a zero-padded even/odd column split of the four input rows, then
   copied into the panels. Doing it once per chunk (rather than per block of output channels, or
   gathered per 16-tile panel that may straddle tile rows) keeps it a small share of the work.
2. Each thread takes (``WNB`` tiles) x (at most ``WMC`` output channels): per channel block, 16
   ``gemm_macro`` calls (one per tap, B read straight from the workspace) into ``M`` on its stack.
3. The output transform, bias, residual and activation are applied to the block while it is hot,
   written row run by row run (vectorisable).

Workspace: ``16 * C * tiles`` floats of one chunk (for one image about 4/9 of the im2col candidates'
columns). Stack per thread: ``16 * WMC * WNB`` floats (at most 96 KiB).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["winograd_eligible", "winograd_weight", "winograd_defs", "winograd_body", "winograd_workspace",
           "WINOGRAD_HELPERS", "MIN_CHANNELS"]

#: Fewer input channels than this and the transforms (the output one grows with the output, not with
#: C) and the short per-tap GEMMs (depth C) eat the multiplies saved (measured against ``conv_implicit``
#: on single Conv kernels: a tie at 4 channels, a win from 8).
MIN_CHANNELS = 8

_MR = 6         # gemm_macro's MR: rows per packed A panel
_NR = 16        # gemm_macro's NR: tiles per packed B panel
_NBP = 2        # B panels per work item (WNB = 32 tiles): each A panel is reused for 32 tiles
_CHUNK_TILES = 256  # small images are transformed together, up to this many tiles (less panel padding)
_MAX_KC = 128   # input channels per block (the depth of one gemm_macro call)
_MAX_MC = 48    # output channels per work item, a multiple of 6 (the M buffer: 16 x WMC x WNB floats)

# G of F(2, 3): U = G g G^T.
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def winograd_eligible(kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int], group: int,
                      channels: int, weight_is_const: bool) -> bool:
    """Whether ``conv_winograd`` is offered: a 3x3, stride-1, undilated, ungrouped Conv of a constant
    weight (it is transformed at import) with at least ``MIN_CHANNELS`` input channels."""
    return (list(kernel) == [3, 3] and list(strides) == [1, 1] and list(dilations) == [1, 1]
            and group == 1 and weight_is_const and channels >= MIN_CHANNELS)


def _blocks(total: int, most: int, multiple: int = 1) -> int:
    """The even block size splitting ``total`` into blocks of at most ``most`` (rounded up to ``multiple``)."""
    count = -(-total // most)
    size = -(-total // count)
    return -(-size // multiple) * multiple


def _kc(channels: int) -> int:
    return _blocks(channels, _MAX_KC)


def _mc(out_channels: int) -> int:
    return min(_MAX_MC, _blocks(out_channels, _MAX_MC, _MR))


def winograd_weight(w: np.ndarray) -> np.ndarray:
    """``U = G g G^T`` of an ``[OC, C, 3, 3]`` weight, packed for ``gemm_macro``: per block of ``kc``
    input channels, per tap ``xi`` (0..15, row-major over the 4x4 tile), per 6-row panel of output
    channels (zero-padded to a multiple of 6), ``kc`` rows of 6 floats. 1-D float32 array."""
    oc, c = w.shape[:2]
    u = np.einsum("ia,ocab,jb->ocij", _G, w.astype(np.float64), _G).reshape(oc, c, 16)
    ocp = -(-oc // _MR) * _MR
    padded = np.zeros((ocp, c, 16))
    padded[:oc] = u
    kc = _kc(c)
    parts = []
    for k0 in range(0, c, kc):
        block = padded[:, k0:k0 + kc, :]                        # [OCP, kc, 16]
        panels = block.reshape(ocp // _MR, _MR, block.shape[1], 16)
        parts.append(panels.transpose(3, 0, 2, 1).reshape(-1))   # [16, OCP/6, kc, 6]
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def _geometry(oh: int, ow: int) -> tuple[int, int, int, int, int]:
    """(tile rows, tile columns, images per chunk, B panels per work item, panels of a whole chunk).

    One panel per work item where an image has at most three (a 7x7 output has 16 tiles), so a
    batch-1 run is not mostly padding. Small images are transformed a chunk at a time, the chunk
    (up to ``_CHUNK_TILES`` tiles) chosen for the least padding in its last work item, the smallest
    such chunk on a tie (the workspace holds one chunk)."""
    th, tw = -(-oh // 2), -(-ow // 2)
    nbp = 1 if th * tw <= 3 * _NR else _NBP
    wnb = _NR * nbp
    images = min(range(1, max(1, _CHUNK_TILES // (th * tw)) + 1),
                 key=lambda k: (-(-k * th * tw // wnb) * wnb / (k * th * tw), k))
    panels = -(-(images * th * tw) // wnb) * nbp  # whole work items
    return th, tw, images, nbp, panels


def winograd_workspace(channels: int, oh: int, ow: int) -> int:
    """Bytes of one chunk's transformed input ``V`` (16 taps x channels x tiles, panels padded)."""
    panels = _geometry(oh, ow)[-1]
    return 16 * channels * panels * _NR * 4


def winograd_defs(channels: int, out_channels: int, oh: int, ow: int) -> str:
    th, tw, images, nbp, panels = _geometry(oh, ow)
    values = dict(WTH=th, WTW=tw, WIMG=images, WNP=panels, WNB=_NR * nbp, WQ=tw + 1, WKC=_kc(channels),
                  WMC=_mc(out_channels), WOCP=-(-out_channels // _MR) * _MR)
    return "".join(f"#define {k} {v}\n" for k, v in values.items())


def _input_transform() -> str:
    """C statements: ``v[xi][tx] = (B^T d B)[xi]`` with ``d(r, s)`` the tile's input at row r, column s."""
    lines = []
    for s in range(4):
        lines.append(f"const float d0{s} = WD(0, {s}), d1{s} = WD(1, {s}), d2{s} = WD(2, {s}), d3{s} = WD(3, {s});")
        lines.append(f"const float t0{s} = d0{s} - d2{s}, t1{s} = d1{s} + d2{s}, "
                     f"t2{s} = d2{s} - d1{s}, t3{s} = d1{s} - d3{s};")
    for r in range(4):
        lines.append(f"v[{r * 4}][tx] = t{r}0 - t{r}2; v[{r * 4 + 1}][tx] = t{r}1 + t{r}2; "
                     f"v[{r * 4 + 2}][tx] = t{r}2 - t{r}1; v[{r * 4 + 3}][tx] = t{r}1 - t{r}3;")
    return "\n            ".join(lines)


def winograd_body(n_c: str, head: str, u_slot: int, epilogue: Callable[[str], str]) -> str:
    """The ``conv_winograd`` entry's body. ``n_c`` is the batch as a C expression, ``head`` the
    shared input/output prologue (``X``, ``Bv``, ``R``, ``Y``), ``u_slot`` the tensor index of the
    transformed weight, ``epilogue(v)`` the C expression of the output from the accumulated value
    ``v`` (bias, residual ``res[i]`` and activation; ``i`` is the output index in the plane)."""
    ep = epilogue("v")
    return head + f"""    const float *U = (const float *)t[{u_slot}];
    float *V = (float *)ws;
    const int64_t batch = {n_c}, mblocks = (OC + WMC - 1) / WMC;
    #pragma omp parallel
    {{
        float mb[16 * WMC * WNB] __attribute__((aligned(64)));
        for (int64_t n0 = 0; n0 < batch; n0 += WIMG) {{
            const int64_t images = batch - n0 < WIMG ? batch - n0 : WIMG, tiles = images * (WTH * WTW);
            const int64_t groups = (tiles + WNB - 1) / WNB;
            #pragma omp for schedule(static)
            for (int64_t q = 0; q < images * C * WTH; q++)
                wino_input_row(X + n0 * C * (H * W), q / (C * WTH), q / WTH % C, q % WTH, tiles, V);
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < groups * mblocks; item++) {{
                const int64_t g = item / mblocks, m0 = (item % mblocks) * WMC;
                const int64_t mc = OC - m0 < WMC ? OC - m0 : WMC;
                for (int64_t k0 = 0; k0 < C; k0 += WKC) {{
                    const int64_t kc = C - k0 < WKC ? C - k0 : WKC;
                    const float *ub = U + 16 * WOCP * k0 + m0 * kc;
                    const float *vb = V + 16 * WNP * 16 * k0 + g * WNB * kc;
                    for (int64_t xi = 0; xi < 16; xi++)
                        gemm_macro(mc, WNB, kc, ub + xi * WOCP * kc, vb + xi * WNP * 16 * kc,
                                   mb + xi * WMC * WNB, WNB, k0 > 0);
                }}
                for (int64_t m = 0; m < mc; m++) {{
                    const int64_t oc = m0 + m;
                    const float bias = Bv[oc];
                    float ob[2][2 * WNB] __attribute__((aligned(64)));
                    wino_output(mb + m * WNB, ob);
                    /* the group's tiles, one run per tile row: two output rows of 2 * len columns */
                    for (int64_t l = 0; l < WNB; ) {{
                        const int64_t tile = g * WNB + l;
                        if (tile >= tiles) break;
                        const int64_t nn = n0 + tile / (WTH * WTW), ty = tile % (WTH * WTW) / WTW, tx = tile % WTW;
                        float *y = Y + (nn * OC + oc) * (OH * OW);
                        const float *res = R + (nn * OC + oc) * (OH * OW); (void)res;
                        int64_t len = WTW - tx < WNB - l ? WTW - tx : WNB - l;
                        const int64_t ow0 = 2 * tx, cols = 2 * len < OW - ow0 ? 2 * len : OW - ow0;
                        for (int64_t a = 0; a < 2 && 2 * ty + a < OH; a++) {{
                            const int64_t base = (2 * ty + a) * OW + ow0;
                            const float *src = ob[a] + 2 * l;
                            for (int64_t j = 0; j < cols; j++) {{
                                const int64_t i = base + j;
                                const float v = src[j];
                                y[i] = {ep};
                            }}
                        }}
                        l += len;
                    }}
                }}
            }}
        }}
    }}
"""


#: Helpers of the body: the input transform of one (channel, tile row), the output transform.
WINOGRAD_HELPERS = r"""
typedef int32_t v8si __attribute__((vector_size(32)));
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
/* V of image im (of the chunk at x), channel c, tile row ty: the four input rows split into even
   and odd columns (column k of phase ph is input column 2k + ph - PL, zero outside the image), so
   tap (r, s) of tile tx is phase s & 1 at column tx + (s >> 1); computed along the row, then copied
   into the packed panels (tap xi, channel c, tile t of the chunk at
   V + 16*WNP*16*k0 + ((xi*WNP + t/16)*kc + c - k0)*16 + t%16, where t = (im*WTH + ty)*WTW + tx). */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void wino_input_row(const float *x, int64_t im, int64_t c, int64_t ty, int64_t tiles, float *V) {
    x += im * C * (H * W);
    float ph[4][2][WQ + 1];
    float v[16][WTW];
    /* interior columns [klo, khi): both phases inside the image, no condition (vectorises) */
    const int64_t klo = (PL + 1) / 2, khi0 = (W - 1 + PL) / 2, khi = khi0 < WQ ? khi0 : WQ;
    for (int64_t r = 0; r < 4; r++) {
        const int64_t ih = 2 * ty - PT + r;
        float *e = ph[r][0], *o = ph[r][1];
        if (ih < 0 || ih >= H) {
            for (int64_t k = 0; k <= WQ; k++) e[k] = o[k] = 0.0f;
            continue;
        }
        const float *xr = x + (c * H + ih) * W;
        for (int64_t k = 0; k < WQ; k++) {
            if (k == klo && klo < khi) {
                for (; k < khi; k++) { e[k] = xr[2 * k - PL]; o[k] = xr[2 * k + 1 - PL]; }
                if (k >= WQ) break;
            }
            const int64_t i0 = 2 * k - PL, i1 = i0 + 1;
            e[k] = i0 >= 0 && i0 < W ? xr[i0] : 0.0f;
            o[k] = i1 >= 0 && i1 < W ? xr[i1] : 0.0f;
        }
    }
    for (int64_t tx = 0; tx < WTW; tx++) {
#define WD(r, s) ph[r][(s) & 1][tx + ((s) >> 1)]
        INPUT_TRANSFORM
#undef WD
    }
    const int64_t k0 = c / WKC * WKC, kc = C - k0 < WKC ? C - k0 : WKC;
    float *vc = V + 16 * WNP * 16 * k0 + (c - k0) * 16;
    for (int64_t tx = 0; tx < WTW; ) {
        const int64_t t = (im * WTH + ty) * WTW + tx, lane = t % 16;
        const int64_t len = 16 - lane < WTW - tx ? 16 - lane : WTW - tx;
        float *dst = vc + (t / 16) * kc * 16 + lane;
        if (len == 16) {
            for (int64_t xi = 0; xi < 16; xi++, dst += WNP * kc * 16) {
                st8(dst, ld8(&v[xi][tx])); st8(dst + 8, ld8(&v[xi][tx + 8]));
            }
        } else {
            for (int64_t xi = 0; xi < 16; xi++, dst += WNP * kc * 16)
                for (int64_t q = 0; q < len; q++) dst[q] = v[xi][tx + q];
        }
        tx += len;
    }
    /* zeros from the last tile to the end of its work item (the rest is never read): finite padding */
    if ((im + 1) * WTH * WTW == tiles && ty == WTH - 1)
        for (int64_t t = tiles; t < (tiles + WNB - 1) / WNB * WNB; t++)
            for (int64_t xi = 0; xi < 16; xi++) vc[(xi * WNP + t / 16) * kc * 16 + t % 16] = 0.0f;
}

/* Y = A^T M A of one output channel's WNB tiles (tap xi of tile l at m[xi * WMC * WNB + l]), as two
   output rows: ob[a][2 * l + b] is output (2 * ty + a, 2 * tx + b) of tile l. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void wino_output(const float *m, float ob[2][2 * WNB]) {
    for (int64_t l = 0; l < WNB; l += 8) {
#define WM(r, s) ld8(m + ((r) * 4 + (s)) * WMC * WNB + l)
        const v8sf u00 = WM(0, 0) + WM(1, 0) + WM(2, 0), u10 = WM(1, 0) - WM(2, 0) - WM(3, 0);
        const v8sf u01 = WM(0, 1) + WM(1, 1) + WM(2, 1), u11 = WM(1, 1) - WM(2, 1) - WM(3, 1);
        const v8sf u02 = WM(0, 2) + WM(1, 2) + WM(2, 2), u12 = WM(1, 2) - WM(2, 2) - WM(3, 2);
        const v8sf u03 = WM(0, 3) + WM(1, 3) + WM(2, 3), u13 = WM(1, 3) - WM(2, 3) - WM(3, 3);
#undef WM
        const v8si lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
        const v8sf y00 = u00 + u01 + u02, y01 = u01 - u02 - u03, y10 = u10 + u11 + u12, y11 = u11 - u12 - u13;
        st8(ob[0] + 2 * l, __builtin_shuffle(y00, y01, lo)); st8(ob[0] + 2 * l + 8, __builtin_shuffle(y00, y01, hi));
        st8(ob[1] + 2 * l, __builtin_shuffle(y10, y11, lo)); st8(ob[1] + 2 * l + 8, __builtin_shuffle(y10, y11, hi));
    }
}
#pragma GCC pop_options
""".replace("INPUT_TRANSFORM", _input_transform())
