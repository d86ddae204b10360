"""The Winograd Conv candidates ``conv_winograd`` (F(2x2, 3x3)) and ``conv_winograd4`` (F(4x4, 3x3))
for a 3x3, stride-1, undilated, ungrouped Conv.

Why: the packed GEMM already runs near the FMA roofline, so a 3x3 convolution only gets faster by
doing fewer multiplies. F(2x2, 3x3) computes a 2x2 output tile from a 4x4 input tile with 16
products per (input channel, output channel) instead of 36: the 16 "taps" of the transformed
domain are 16 independent GEMMs ``M[xi] = U[xi] @ V[xi]`` (``[OC, C] @ [C, tiles]``) between an
input transform ``V = B^T d B`` and an output transform ``Y = A^T M A`` (Lavin and Gray, "Fast
Algorithms for Convolutional Neural Networks", 2015).

F(4x4, 3x3) (``conv_winograd4``, points 0, +-1, +-2 and infinity) computes a 4x4 output tile from a
6x6 input tile with 36 products instead of 144: 2.25 products per output instead of F(2x2)'s 4, and
fewer transformed values per output on both sides. Its price: a 6x6 tile wastes more of a small or
odd image (a 13x13 output computes 16x16), the transforms have coefficients up to 8 (a larger
rounding error than F(2x2)'s; within 1e-4 of ONNX Runtime at 512 input channels in the tests), and
its weight is 36/9 the 3x3 weight, so it is offered only up to ``MAX_WEIGHT4_BYTES``. Both are the same kernel below,
generated for a tile size ``m`` (2 or 4); the second one's C names carry a ``4``.

Weight (``winograd_weight``): ``U = G g G^T`` is computed once at import (float64, stored as
float32), 16/9 the size of the 3x3 weight, as an extra kernel input. It is stored already packed
the way ``gemm_macro`` reads its A operand (6-row panels, ``kc`` deep, per block of input channels
and per tap), so the kernel never packs A: every block of tiles would otherwise repack all 16 taps.

Kernel: one OpenMP region per call with no barrier inside and no workspace. The batch's tiles
(image, tile row, tile column) are cut into groups of ``WNB`` consecutive tiles, which may straddle
tile rows and images (small images share panels); a work item is (group, block of at most ``WMC``
output channels), shared out statically, so a thread's items are consecutive groups:

1. The thread transforms its group's tiles itself: ``V`` of every input channel, one run per tile
   row, vectorised along the run from a zero-padded even/odd column split of the four input rows,
   stored straight into ``gemm_macro``'s packed B layout in a buffer of the thread's, and kept for
   the group's next output-channel blocks. The buffer is on the thread's stack where it fits
   (``_MAX_V_BYTES``; work items narrowed to one panel to make it fit), else (``WVWS``, more than
   512 input channels) the thread's slot of the workspace, one slot per thread, at most
   ``_WS_SLOTS`` threads.
2. Per channel block, one ``gemm_macro`` call per tap (16, or 36) into ``M`` on its stack.
3. The output transform, bias, residual and activation (``wino_store``, AVX2 where the machine has
   it), written row run by row run through ``YPLANE`` and ``RPLANE``.

Why this shape: a workspace ``V`` per chunk of images, written by all threads and then read by all,
needed two barriers per chunk, sent most of a work item's ``V`` through the other core's cache,
and kept the transform and its products apart in time, so batch 8 cost more than 8 x batch 1.
Here a group's ``V`` is made by the thread that uses it, just before it is used (in its L2).

Stack per thread: ``taps * C * WNB`` floats for ``V`` (at most 512 KiB; none with ``WVWS``) and
``taps * WMC * WNB`` for ``M`` (at most 96 KiB for F(2x2), 108 KiB for F(4x4)).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

__all__ = ["winograd_eligible", "winograd4_eligible", "winograd_weight", "winograd_defs", "winograd_body",
           "winograd_helpers", "winograd_workspace", "MIN_CHANNELS", "MAX_WEIGHT4_BYTES"]

#: Fewer input channels than this and the transforms (the output one grows with the output, not with
#: C) and the short per-tap GEMMs (depth C) eat the multiplies saved (measured against ``conv_implicit``
#: on single Conv kernels: a tie at 4 channels, a win from 8).
MIN_CHANNELS = 8

_MR = 6         # gemm_macro's MR: rows per packed A panel
_NR = 16        # gemm_macro's NR: tiles per packed B panel
_NBP = 2        # B panels per work item (WNB = 32 tiles): each A panel is reused for 32 tiles
_MAX_KC = 128   # input channels per block (the depth of one gemm_macro call)
_MAX_MC = {2: 48, 4: 24}  # output channels per work item, a multiple of 6 (the M buffer: taps x WMC x WNB floats)
_MAX_V_BYTES = 512 * 1024  # a thread keeps V of all channels of its group up to this size (its stack)
_WS_SLOTS = 16  # beyond that (WVWS), V in the workspace: one slot per thread, the team capped at this

#: F(4x4, 3x3) is offered up to this size of its transformed weight (36/9 the 3x3 weight's): the
#: bundle carries it next to the 3x3 weight and F(2x2)'s.
MAX_WEIGHT4_BYTES = 16 << 20

# U = G g G^T, V = B^T d B, Y = A^T M A; per output tile size m (alpha = m + 2 input rows and columns).
_G = {2: np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]]),
      4: np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                   [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]])}
_BT4 = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                 [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]])
_AT4 = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]])
# The C names of one candidate's helpers and geometry: F(4x4)'s carry a "4" so both live in one source.
_NAMES = re.compile(r"\b(WTH|WTW|WNB|WQ|WKC|WMC|WOCP|WVWS|WSLOTS|WTS|WAL|WTAPS|wino_input_run|wino_input_group|"
                    r"wino_output|wino_store)\b")


def _named(text: str, m: int) -> str:
    return text if m == 2 else _NAMES.sub(lambda k: k.group(1) + "4", text)


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


def _mc(out_channels: int, m: int) -> int:
    return min(_MAX_MC[m], _blocks(out_channels, _MAX_MC[m], _MR))


def winograd4_eligible(kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int], group: int,
                       channels: int, out_channels: int, weight_is_const: bool) -> bool:
    """Whether ``conv_winograd4`` is offered: where ``conv_winograd`` is, with a transformed weight of
    at most ``MAX_WEIGHT4_BYTES``."""
    return (winograd_eligible(kernel, strides, dilations, group, channels, weight_is_const)
            and 36 * channels * out_channels * 4 <= MAX_WEIGHT4_BYTES)


def winograd_weight(w: np.ndarray, m: int = 2) -> np.ndarray:
    """``U = G g G^T`` of an ``[OC, C, 3, 3]`` weight for output tiles of ``m`` x ``m``, packed for
    ``gemm_macro``: per block of ``kc`` input channels, per tap ``xi`` (row-major over the
    ``m + 2`` square tile), per 6-row panel of output channels (zero-padded to a multiple of 6),
    ``kc`` rows of 6 floats. 1-D float32 array."""
    oc, c = w.shape[:2]
    taps = (m + 2) ** 2
    g = _G[m]
    alpha = m + 2
    # G g G^T as two flat products (an unoptimised einsum over every channel pair was most of a warm
    # conversion): along the columns of every 3x3 kernel, then along its rows.
    t = (w.astype(np.float64).reshape(-1, 3) @ g.T).reshape(oc, c, 3, alpha)      # g G^T: [oc, c, a, j]
    u = (t.transpose(0, 1, 3, 2).reshape(-1, 3) @ g.T).reshape(oc, c, alpha, alpha)  # [oc, c, j, i]
    u = u.transpose(0, 1, 3, 2).reshape(oc, c, taps)
    ocp = -(-oc // _MR) * _MR
    padded = np.zeros((ocp, c, taps))
    padded[:oc] = u
    kc = _kc(c)
    parts = []
    for k0 in range(0, c, kc):
        block = padded[:, k0:k0 + kc, :]                          # [OCP, kc, taps]
        panels = block.reshape(ocp // _MR, _MR, block.shape[1], taps)
        parts.append(panels.transpose(3, 0, 2, 1).reshape(-1))   # [taps, OCP/6, kc, 6]
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def _geometry(oh: int, ow: int, channels: int, m: int = 2) -> tuple[int, int, int]:
    """(tile rows, tile columns, tiles per work item ``WNB``). One 16-tile panel per work item where an
    image has at most three (a 7x7 output has 16 tiles), so a batch-1 run is not mostly padding, or
    where two panels of ``V`` of every input channel would not fit a thread's buffer (its transform
    would then be redone per block of output channels); two otherwise (each packed weight panel is
    then used for 32 tiles)."""
    th, tw = -(-oh // m), -(-ow // m)
    one = th * tw <= 3 * _NR or (m + 2) ** 2 * channels * _NR * _NBP * 4 > _MAX_V_BYTES
    return th, tw, _NR * (1 if one else _NBP)


def winograd_workspace(channels: int, oh: int, ow: int, m: int = 2) -> int:
    """Bytes of workspace: ``V`` slots for ``_WS_SLOTS`` threads where a thread's ``V`` does not fit
    its stack (``WVWS``), else none."""
    wnb = _geometry(oh, ow, channels, m)[2]
    size = (m + 2) ** 2 * channels * wnb * 4
    return _WS_SLOTS * size if size > _MAX_V_BYTES else 0


def winograd_defs(channels: int, out_channels: int, oh: int, ow: int, m: int = 2) -> str:
    th, tw, wnb = _geometry(oh, ow, channels, m)
    kc = _kc(channels)
    taps = (m + 2) ** 2
    in_ws = taps * channels * wnb * 4 > _MAX_V_BYTES
    values = dict(WTH=th, WTW=tw, WNB=wnb, WQ=tw + 1, WKC=kc, WMC=_mc(out_channels, m),
                  WOCP=-(-out_channels // _MR) * _MR, WVWS=int(in_ws), WSLOTS=_WS_SLOTS, WTS=m, WAL=m + 2,
                  WTAPS=taps)
    return _named("".join(f"#define {k} {v}\n" for k, v in values.items()), m)


def _combination(coefficients, terms) -> str:
    """The C expression of ``sum(c * t)`` over the non-zero coefficients (``+-t`` for +-1)."""
    out = []
    for c, t in zip(coefficients, terms):
        c = float(c)
        if c == 0:
            continue
        sign = "-" if c < 0 else "+"
        mag = abs(c)
        out.append(f" {sign} {t}" if mag == 1 else f" {sign} {mag!r}f * {t}")
    text = "".join(out).strip()
    return text[2:] if text.startswith("+ ") else "-" + text[2:] if text.startswith("- ") else text


def _input_transform(m: int) -> str:
    """C statements: ``v[xi][tx] = (B^T d B)[xi]`` with ``d(r, s)`` the tile's input at row r, column s."""
    if m == 4:
        lines = []
        for r in range(6):  # t = d B, row by row
            lines.append(" ".join(f"const float t{r}{j} = {_combination(_BT4[j], [f'WD({r}, {c})' for c in range(6)])};"
                                  for j in range(6)))
        for i in range(6):  # v = B^T t
            lines.append(" ".join(f"v[{i * 6 + j}][tx] = {_combination(_BT4[i], [f't{r}{j}' for r in range(6)])};"
                                  for j in range(6)))
        return "\n            ".join(lines)
    lines = []
    for s in range(4):
        lines.append(f"const float d0{s} = WD(0, {s}), d1{s} = WD(1, {s}), d2{s} = WD(2, {s}), d3{s} = WD(3, {s});")
        lines.append(f"const float t0{s} = d0{s} - d2{s}, t1{s} = d1{s} + d2{s}, "
                     f"t2{s} = d2{s} - d1{s}, t3{s} = d1{s} - d3{s};")
    for r in range(4):
        lines.append(f"v[{r * 4}][tx] = t{r}0 - t{r}2; v[{r * 4 + 1}][tx] = t{r}1 + t{r}2; "
                     f"v[{r * 4 + 2}][tx] = t{r}2 - t{r}1; v[{r * 4 + 3}][tx] = t{r}1 - t{r}3;")
    return "\n            ".join(lines)


def winograd_body(n_c: str, head: str, u_slot: int, m: int = 2) -> str:
    """The ``conv_winograd`` (``m`` 2) or ``conv_winograd4`` (``m`` 4) entry's body. ``n_c`` is the
    batch as a C expression, ``head`` the shared input/output prologue (``X``, ``Bv``, ``R``, ``Y``),
    ``u_slot`` the tensor index of the transformed weight. Needs ``winograd_defs`` and
    ``winograd_helpers`` of the same ``m``."""
    return head + _named(f"""    const float *U = (const float *)t[{u_slot}];
    const int64_t tiles = {n_c} * (WTH * WTW), groups = (tiles + WNB - 1) / WNB;
    const int64_t mblocks = (OC + WMC - 1) / WMC;
#ifdef _OPENMP
#define THREAD_NUM omp_get_thread_num()
    const int team = WVWS && omp_get_max_threads() > WSLOTS ? WSLOTS : omp_get_max_threads();
#else
#define THREAD_NUM 0
    const int team = 1;
#endif
    (void)team;
    #pragma omp parallel num_threads(team) if (groups * mblocks > 1)
    {{
#if WVWS
        float *vl = (float *)ws + (int64_t)THREAD_NUM * (WTAPS * C * WNB);
#else
        float vl[WTAPS * C * WNB] __attribute__((aligned(64)));
#endif
        float mb[WTAPS * WMC * WNB] __attribute__((aligned(64)));
        int64_t vg = -1;  /* the group whose V is in vl */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * mblocks; item++) {{
            const int64_t g = item / mblocks, m0 = (item % mblocks) * WMC;
            const int64_t mc = OC - m0 < WMC ? OC - m0 : WMC;
            const int64_t t0 = g * WNB, nt = tiles - t0 < WNB ? tiles - t0 : WNB, nc = (nt + 15) / 16 * 16;
            for (int64_t k0 = 0; k0 < C; k0 += WKC) {{
                const int64_t kc = C - k0 < WKC ? C - k0 : WKC;
                float *vb = vl + WTAPS * WNB * k0;
                if (g != vg) wino_input_group(X, t0, nt, k0, kc, vb);
                const float *ub = U + WTAPS * WOCP * k0 + m0 * kc;
                for (int64_t xi = 0; xi < WTAPS; xi++)
                    gemm_macro(mc, nc, kc, ub + xi * WOCP * kc, vb + xi * WNB * kc, mb + xi * WMC * WNB, WNB,
                               k0 > 0);
            }}
            vg = g;
            for (int64_t m = 0; m < mc; m++)
                wino_store(mb + m * WNB, t0, nt, nc, m0 + m, Bv, R, Y);
        }}
    }}
""", m)


_HELPERS = r"""
#ifndef WINO_V8SI
#define WINO_V8SI
typedef int32_t v8si __attribute__((vector_size(32)));
#endif
#pragma GCC push_options
/* no-tree-loop-distribute-patterns: the short copies of a run (the taps of at most 16 lanes) would
   otherwise become memcpy calls and rep movs, slower than the transform itself */
#pragma GCC optimize("fp-contract=fast", "no-tree-loop-distribute-patterns")
/* V of tiles tx0 .. tx0 + len - 1 of tile row ty of one channel plane xc: the WAL input rows split
   into WTS column phases (column k of phase ph is input column WTS * k + ph - PL, zero outside the
   image; kept from column tx0 on), so tap (r, s) of tile tx is phase s % WTS at column
   tx + s / WTS; computed along the run, then stored as lanes lane0 .. of the group's panels (tap xi,
   lane l at vc[xi * WNB * kc + (l / 16) * kc * 16 + l % 16], vc already at the channel's row). */
static inline __attribute__((always_inline)) void wino_input_run(const float *xc, int64_t ty, int64_t tx0,
                                                                 int64_t len, int64_t lane0, int64_t kc, float *vc) {
    float ph[WAL][WTS][WQ + 1];
    float v[WTAPS][WTW + 8];  /* + 8: whole vectors are read past a run's end */
    /* interior columns [lo, hi): every phase inside the image, no condition (vectorises) */
    const int64_t k1 = tx0 + len + 1, klo = (PL + WTS - 1) / WTS, khi = (W + PL) / WTS;
    const int64_t lo = klo > tx0 ? klo : tx0, hi = khi < k1 ? khi : k1;
    for (int64_t r = 0; r < WAL; r++) {
        const int64_t ih = WTS * ty - PT + r;
        if (ih < 0 || ih >= H) {
            for (int64_t p = 0; p < WTS; p++)
                for (int64_t k = tx0; k < k1; k++) ph[r][p][k - tx0] = 0.0f;
            continue;
        }
        const float *xr = xc + ih * W;
        for (int64_t k = tx0; k < k1; k++) {
            if (k == lo && lo < hi) {
                for (; k < hi; k++)
                    for (int64_t p = 0; p < WTS; p++) ph[r][p][k - tx0] = xr[WTS * k + p - PL];
                if (k >= k1) break;
            }
            for (int64_t p = 0; p < WTS; p++) {
                const int64_t i = WTS * k + p - PL;
                ph[r][p][k - tx0] = i >= 0 && i < W ? xr[i] : 0.0f;
            }
        }
    }
    for (int64_t tx = 0; tx < len; tx++) {
#define WD(r, s) ph[r][(s) % WTS][tx + (s) / WTS]
        INPUT_TRANSFORM
#undef WD
    }
    for (int64_t j = 0; j < len; ) {
        const int64_t lane = lane0 + j, run = 16 - lane % 16 < len - j ? 16 - lane % 16 : len - j;
        float *dst = vc + (lane / 16) * kc * 16 + lane % 16;
        /* whole vectors while they stay inside the panel: lanes past the run are rewritten by the
           group's next run (the same panel row, later) or zeroed at the end */
        const int64_t vec = 16 - lane % 16 >= 8 * ((run + 7) / 8) ? (run + 7) / 8 * 8 : run / 8 * 8;
        for (int64_t xi = 0; xi < WTAPS; xi++, dst += WNB * kc) {
            for (int64_t q = 0; q < vec; q += 8) st8(dst + q, ld8(&v[xi][j + q]));
            for (int64_t q = vec; q < run; q++) dst[q] = v[xi][j + q];
        }
        j += run;
    }
}

/* V of the group's nt tiles (from tile t0 of the batch: image, tile row, tile column in that order),
   channels k0 .. k0 + kc - 1, into vb in gemm_macro's packed B layout (per tap, WNB / 16 panels of
   kc x 16), one run per tile row; the lanes after the last tile up to its panel's end are zeros. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void wino_input_group(const float *X, int64_t t0, int64_t nt, int64_t k0, int64_t kc, float *vb) {
    for (int64_t t = t0; t < t0 + nt; ) {
        const int64_t nn = t / (WTH * WTW), ty = t % (WTH * WTW) / WTW, tx = t % WTW;
        const int64_t len = WTW - tx < t0 + nt - t ? WTW - tx : t0 + nt - t;
        const float *xn = X + (nn * C + k0) * (H * W);
        for (int64_t c = 0; c < kc; c++)
            wino_input_run(xn + c * (H * W), ty, tx, len, t - t0, kc, vb + c * 16);
        t += len;
    }
    for (int64_t l = nt; l < (nt + 15) / 16 * 16; l++)
        for (int64_t xi = 0; xi < WTAPS; xi++)
            for (int64_t c = 0; c < kc; c++) vb[xi * WNB * kc + (l / 16) * kc * 16 + c * 16 + l % 16] = 0.0f;
}

/* Y = A^T M A of one output channel's first n tiles (tap xi of tile l at m[xi * WMC * WNB + l]), as
   WTS output rows: ob[a][WTS * l + b] is output (WTS * ty + a, WTS * tx + b) of tile l. */
static inline __attribute__((always_inline)) void wino_output(const float *m, int64_t n, float ob[WTS][WTS * WNB]) {
    for (int64_t l = 0; l < n; l += 8) {
#define WM(r, s) ld8(m + ((r) * WAL + (s)) * WMC * WNB + l)
OUTPUT_TRANSFORM
#undef WM
    }
}

/* Output channel oc of the group's nt tiles from t0 (M of its first nc tiles at m): the output
   transform, then bias, residual and activation, one run per tile row (WTS output rows of
   WTS * len columns), in the AVX2 clone where the machine has it. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void wino_store(const float *m, int64_t t0, int64_t nt, int64_t nc, int64_t oc, const float *Bv,
                       const float *R, float *Y) {
    float ob[WTS][WTS * WNB] __attribute__((aligned(64)));
    wino_output(m, nc, ob);
    const float bias = Bv[oc];
    for (int64_t l = 0; l < nt; ) {
        const int64_t tile = t0 + l;
        const int64_t nn = tile / (WTH * WTW), ty = tile % (WTH * WTW) / WTW, tx = tile % WTW;
        float *y = YPLANE(nn, oc);
        const float *res = RPLANE(nn, oc); (void)res;
        const int64_t len = WTW - tx < nt - l ? WTW - tx : nt - l;
        const int64_t ow0 = WTS * tx, cols = WTS * len < OW - ow0 ? WTS * len : OW - ow0;
        for (int64_t a = 0; a < WTS && WTS * ty + a < OH; a++) {
            const int64_t base = (WTS * ty + a) * OW + ow0;
            const float *src = ob[a] + WTS * l;
            for (int64_t j = 0; j < cols; j++) {
                const int64_t i = base + j;
                const float v = src[j];
                y[i] = EPILOGUE;
            }
        }
        l += len;
    }
}
#pragma GCC pop_options
"""

# F(2x2)'s output transform: Y = A^T M A with A^T = [[1, 1, 1, 0], [0, 1, -1, -1]], the two columns
# of each output row interleaved with two shuffles.
_OUTPUT2 = """        const v8sf u00 = WM(0, 0) + WM(1, 0) + WM(2, 0), u10 = WM(1, 0) - WM(2, 0) - WM(3, 0);
        const v8sf u01 = WM(0, 1) + WM(1, 1) + WM(2, 1), u11 = WM(1, 1) - WM(2, 1) - WM(3, 1);
        const v8sf u02 = WM(0, 2) + WM(1, 2) + WM(2, 2), u12 = WM(1, 2) - WM(2, 2) - WM(3, 2);
        const v8sf u03 = WM(0, 3) + WM(1, 3) + WM(2, 3), u13 = WM(1, 3) - WM(2, 3) - WM(3, 3);
        const v8si lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
        const v8sf y00 = u00 + u01 + u02, y01 = u01 - u02 - u03, y10 = u10 + u11 + u12, y11 = u11 - u12 - u13;
        st8(ob[0] + 2 * l, __builtin_shuffle(y00, y01, lo)); st8(ob[0] + 2 * l + 8, __builtin_shuffle(y00, y01, hi));
        st8(ob[1] + 2 * l, __builtin_shuffle(y10, y11, lo)); st8(ob[1] + 2 * l + 8, __builtin_shuffle(y10, y11, hi));"""


def _output4() -> str:
    """F(4x4)'s output transform: ``u = A^T M`` by rows, ``y = u A`` per output row, the four columns
    of a row interleaved over 8 tiles (two rounds of shuffles: a 4 x 8 transpose)."""
    lines = []
    for a in range(4):
        lines.append("        {")
        for c in range(6):
            lines.append(f"        const v8sf u{c} = {_combination(_AT4[a], [f'WM({r}, {c})' for r in range(6)])};")
        for b in range(4):
            lines.append(f"        const v8sf y{b} = {_combination(_AT4[b], [f'u{c}' for c in range(6)])};")
        lines.append("        const v8si lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};\n"
                     "        const v8si l2 = {0, 1, 8, 9, 2, 3, 10, 11}, h2 = {4, 5, 12, 13, 6, 7, 14, 15};\n"
                     "        /* p = (y0 y1 interleaved), q = (y2 y3 interleaved); then pairs of p and q */\n"
                     "        const v8sf p0 = __builtin_shuffle(y0, y1, lo), p1 = __builtin_shuffle(y0, y1, hi);\n"
                     "        const v8sf q0 = __builtin_shuffle(y2, y3, lo), q1 = __builtin_shuffle(y2, y3, hi);\n"
                     "        const v8sf r0 = __builtin_shuffle(p0, q0, l2), r1 = __builtin_shuffle(p0, q0, h2);\n"
                     "        const v8sf r2 = __builtin_shuffle(p1, q1, l2), r3 = __builtin_shuffle(p1, q1, h2);\n"
                     "        /* r0: tiles 0 and 1, r2: 2 and 3, r1: 4 and 5, r3: 6 and 7 (4 columns each) */\n"
                     f"        float *o = ob[{a}] + 4 * l;\n"
                     "        st8(o, r0); st8(o + 8, r2); st8(o + 16, r1); st8(o + 24, r3);")
        lines.append("        }")
    return "\n".join(lines)


def winograd_helpers(epilogue: Callable[[str], str], m: int = 2) -> str:
    """The body's helpers (C, after ``winograd_defs`` of the same ``m``): the input transform of one
    group of tiles and the output store. ``epilogue(v)`` is the C expression of the output from the
    accumulated value ``v`` (bias, residual ``res[i]`` and activation; ``i`` is the output index in
    the plane); output and residual planes are addressed through ``YPLANE`` and ``RPLANE``
    (``conv.py``)."""
    text = (_HELPERS.replace("INPUT_TRANSFORM", _input_transform(m))
            .replace("OUTPUT_TRANSFORM", _OUTPUT2 if m == 2 else _output4()))
    return _named(text.replace("EPILOGUE", epilogue("v")), m)
