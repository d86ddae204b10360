"""GPU kernels (``engine_onnx.gpu`` dialect) for table-driven copies and index searches: axis maps
(Pad, Tile, nearest Resize), separable Resize taps (linear, cubic), ArgMax/ArgMin, TopK and
ConvTranspose. One thread per output element (per output line for ArgMax/ArgMin and TopK).

The per-axis tables computed at import (``axis_map``, ``resize.axis_taps``) reach the kernel as
extra weight inputs (int64 indices, float32 weights; every axis' table concatenated into one
array, each axis reading from its own offset), not as constant arrays in the source. A weight is a
plain device buffer: no size limit (CUDA's and OpenCL's constant memory is 64 KiB per module on
common devices, and a Resize table of a wide image would press on it), no dialect change for
file-scope constant data, and the kernel source depends only on the shapes, not on the table
values. The tables are read once per element and stay in cache.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from engine_onnx.dims import Dim, dims_product, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, gpu_ctype, launch_1d, params
from engine_onnx.ops.kernel_exprs import coordinates

__all__ = ["axis_map_kernel", "taps_kernel", "arg_kernel", "topk_kernel", "convtranspose_kernel"]


def _kernel(name: str, entry: str, ins: Sequence[str], outs: Sequence[str], symbols: Sequence[str],
            total: Dim, body: str) -> GpuKernelSpec:
    source = (f"KERNEL {entry}({params(ins, outs, symbols)}) {{\n"
              f"    const int64_t i = GLOBAL_ID;\n    if (i >= {gdim(total)}) return;\n{body}}}\n")
    return GpuKernelSpec(name, source, (entry,), (launch_1d(total),), tuple(symbols))


def _strides(shape: Sequence[Dim]) -> list[Dim]:
    return [dims_product(shape[k + 1:]) for k in range(len(shape))]


def _concat(tables: Sequence[np.ndarray | None], dtype) -> tuple[np.ndarray | None, list[int]]:
    """Every table one after the other (None when there is none) and the offset of each."""
    offsets, run = [], 0
    for tab in tables:
        offsets.append(run)
        run += 0 if tab is None else tab.size
    present = [np.asarray(tab, dtype).reshape(-1) for tab in tables if tab is not None]
    if not present:
        return None, offsets
    joined = np.concatenate(present)
    return (joined if joined.size else np.zeros(1, dtype)), offsets


def axis_map_kernel(name: str, out_shape: Sequence[Dim], in_shape: Sequence[Dim],
                    tables: Sequence[np.ndarray | None], dtype: np.dtype,
                    fill_c: str) -> tuple[GpuKernelSpec, np.ndarray | None]:
    """``out[o] = in[T_0[o_0], …]`` (``fill_c`` where some ``T_k[o_k] < 0``), and the int64 array
    of the tables, the kernel's second input (None when no axis has a table: a plain copy)."""
    t = gpu_ctype(dtype)
    joined, offsets = _concat(tables, np.int64)
    in_strides = _strides(in_shape)
    body = coordinates(out_shape) if out_shape else ""
    terms = []
    for k, tab in enumerate(tables):
        if tab is None:
            terms.append(f"c{k} * {gdim(in_strides[k])}")
            continue
        body += f"    const int64_t a{k} = in1[{offsets[k]} + c{k}];\n"
        if (tab < 0).any():
            body += f"    if (a{k} < 0) {{ out0[i] = {fill_c}; return; }}\n"
        terms.append(f"a{k} * {gdim(in_strides[k])}")
    body += f"    out0[i] = in0[{' + '.join(terms) or '0'}];\n"
    ins = [t] + (["int64_t"] if joined is not None else [])
    symbols = symbols_of([*out_shape, *in_shape])
    return _kernel(name, "axis_map", ins, [t], symbols, dims_product(out_shape), body), joined


def taps_kernel(out_shape: Sequence[Dim], in_shape: Sequence[Dim], tables, dtype: np.dtype,
                fill_c: str) -> tuple[GpuKernelSpec, np.ndarray, np.ndarray]:
    """Separable Resize: ``out[o] = sum over the taps of every resized axis of prod(weights) *
    in[indices]`` (``fill_c`` where a resized axis extrapolates). ``tables[k]`` is ``resize.axis_taps``'
    (indices, weights, extrapolated) or None for an axis copied unchanged. Returns the kernel and
    its two table inputs: int64 indices (-1 on an extrapolated row) and float32 weights."""
    t = gpu_ctype(dtype)
    acc_t = "double" if t == "double" else "float"
    rank = len(out_shape)
    resized = [k for k in range(rank) if tables[k] is not None]
    idx_tabs = [None if tab is None else np.where(tab[2][:, None], -1, tab[0]) for tab in tables]
    w_tabs = [None if tab is None else tab[1] for tab in tables]
    idx, offsets = _concat(idx_tabs, np.int64)
    weights, _ = _concat(w_tabs, np.float32)
    if idx is None:  # nothing resized: a copy (the kernel still takes both table inputs)
        idx, weights = np.zeros(1, np.int64), np.zeros(1, np.float32)
    strides = _strides(in_shape)
    body = coordinates(out_shape)
    base = " + ".join(f"c{k} * {gdim(strides[k])}" for k in range(rank) if tables[k] is None) or "0"
    for k in resized:
        n_taps = tables[k][0].shape[1]
        body += f"    const int64_t r{k} = {offsets[k]} + c{k} * {n_taps};\n"
        if tables[k][2].any():
            body += f"    if (in1[r{k}] < 0) {{ out0[i] = {fill_c}; return; }}\n"
    body += f"    {acc_t} acc = 0;\n"
    ind = "    "
    prev_w, prev_f = f"({acc_t})1", f"({base})"
    for k in resized:
        n_taps = tables[k][0].shape[1]
        body += f"{ind}for (int64_t t{k} = 0; t{k} < {n_taps}; t{k}++) {{\n"
        ind += "    "
        body += f"{ind}const {acc_t} w{k} = {prev_w} * ({acc_t})in2[r{k} + t{k}];\n"
        body += f"{ind}const int64_t f{k} = {prev_f} + in1[r{k} + t{k}] * {gdim(strides[k])};\n"
        prev_w, prev_f = f"w{k}", f"f{k}"
    body += f"{ind}acc += {prev_w} * ({acc_t})in0[{prev_f}];\n"
    for _ in resized:
        ind = ind[:-4]
        body += f"{ind}}}\n"
    body += f"    out0[i] = ({t})acc;\n"
    symbols = symbols_of([*out_shape, *in_shape])
    spec = _kernel("resize", "resize", [t, "int64_t", "float"], [t], symbols, dims_product(out_shape), body)
    return spec, idx, weights


def arg_kernel(name: str, in_shape: Sequence[Dim], axis: int, dtype: np.dtype, cmp: str) -> GpuKernelSpec:
    """ArgMax/ArgMin: one thread per (outer, inner) line scans the axis; ``cmp`` (``>``, ``>=``,
    ``<``, ``<=``) says when a value replaces the best so far (``=`` keeps the last of equal ones).
    A NaN best (float types) is always replaced, as the CPU kernel does."""
    t = gpu_ctype(dtype)
    nan = " || bv != bv" if np.dtype(dtype).kind == "f" else ""
    dim, inner = in_shape[axis], dims_product(in_shape[axis + 1:])
    total = dims_product(in_shape[:axis]) * inner
    body = (f"    const int64_t D = {gdim(dim)}, I = {gdim(inner)};\n"
            f"    GLOBAL const {t} *x = in0 + (i / I) * D * I + i % I;\n"
            f"    int64_t best = 0; {t} bv = x[0];\n"
            f"    for (int64_t j = 1; j < D; j++) {{\n"
            f"        const {t} v = x[j * I];\n"
            f"        if (v {cmp} bv{nan}) {{ bv = v; best = j; }}\n"
            f"    }}\n    out0[i] = best;\n")
    return _kernel(name, "arg", [t], ["int64_t"], symbols_of(in_shape), total, body)


#: The largest TopK ``k`` the GPU kernel keeps in per-thread arrays.
TOPK_MAX_K = 64


def topk_kernel(in_shape: Sequence[Dim], axis: int, k: int, dtype: np.dtype, largest: bool) -> GpuKernelSpec:
    """TopK: one thread per (outer, inner) line keeps the best ``k`` so far in private arrays, sorted
    by value then lower index first (insertion by shifting, as the CPU kernel); NaNs never enter.
    Missing entries (fewer than ``k`` non-NaN values) are 0 with index 0, as on the CPU."""
    t = gpu_ctype(dtype)
    better = ">" if largest else "<"
    nan_skip = "\n        if (v != v) continue;" if np.dtype(dtype).kind == "f" else ""
    dim, inner = in_shape[axis], dims_product(in_shape[axis + 1:])
    total = dims_product(in_shape[:axis]) * inner
    body = f"""    const int64_t D = {gdim(dim)}, I = {gdim(inner)}, o = i / I, r = i % I;
    GLOBAL const {t} *x = in0 + o * D * I + r;
    {t} bv[{k}]; int64_t bi[{k}];
    int64_t n = 0;
    for (int64_t j = 0; j < D; j++) {{
        const {t} v = x[j * I];{nan_skip}
        if (n == {k} && !(v {better} bv[{k - 1}])) continue;
        int64_t p = n < {k} ? n++ : {k - 1};
        while (p > 0 && v {better} bv[p - 1]) {{ bv[p] = bv[p - 1]; bi[p] = bi[p - 1]; p--; }}
        bv[p] = v; bi[p] = j;
    }}
    for (int64_t j = 0; j < {k}; j++) {{
        const int64_t q = (o * {k} + j) * I + r;
        out0[q] = j < n ? bv[j] : ({t})0; out1[q] = j < n ? bi[j] : 0;
    }}
"""
    return _kernel("topk", "topk", [t], [t, "int64_t"], symbols_of(in_shape), total, body)


def convtranspose_kernel(n: Dim, c: int, group: int, mg: int, spatial: Sequence[int], kernel: Sequence[int],
                         strides: Sequence[int], dil: Sequence[int], begin: Sequence[int], out_sp: Sequence[int],
                         epilogue: Callable[[str], str]) -> GpuKernelSpec:
    """ConvTranspose (3-D form; 1-D and 2-D have unit leading axes), float32: one thread per output
    element gathers ``x[ic, id, ih, iw] * w[ic, m, kd, kh, kw]`` over the input channels of its group
    and the taps whose full position ``i * stride + k * dilation - pad`` is this output position,
    then adds the bias (third input) and applies ``epilogue``."""
    D, H, W = spatial
    KD, KH, KW = kernel
    OD, OH, OW = out_sp
    oc, cg = mg * group, c // group

    taps = ""
    for o, i, k, size, n_taps, s, d, p in (("od", "id", "kd", D, KD, strides[0], dil[0], begin[0]),
                                          ("oh", "ih", "kh", H, KH, strides[1], dil[1], begin[1]),
                                          ("ow", "iw", "kw", W, KW, strides[2], dil[2], begin[2])):
        # the tap reaches this output when i * s = o + p - k * d for an input position i in [0, size)
        taps += (f"        for (int64_t {k} = 0; {k} < {n_taps}; {k}++) {{\n"
                 f"            const int64_t {i}s = {o} + {p} - {k} * {d};\n"
                 f"            if ({i}s < 0 || {i}s % {s} != 0 || {i}s / {s} >= {size}) continue;\n"
                 f"            const int64_t {i} = {i}s / {s};\n")
    body = f"""    int64_t rest = i;
    const int64_t ow = rest % {OW}; rest /= {OW};
    const int64_t oh = rest % {OH}; rest /= {OH};
    const int64_t od = rest % {OD}; rest /= {OD};
    const int64_t m = rest % {oc}, nn = rest / {oc}, g = m / {mg}, ml = m % {mg};
    float acc = 0.0f;
    for (int64_t ic = 0; ic < {cg}; ic++) {{
        GLOBAL const float *x = in0 + (nn * {c} + g * {cg} + ic) * {D * H * W};
        GLOBAL const float *w = in1 + ((g * {cg} + ic) * {mg} + ml) * {KD * KH * KW};
{taps}            acc += x[(id * {H} + ih) * {W} + iw] * w[(kd * {KH} + kh) * {KW} + kw];
        }}}}}}
    }}
    out0[i] = {epilogue("(acc + in2[m])")};
"""
    out_shape = [n, oc, OD, OH, OW]
    return _kernel("convtranspose", "convt", ["float", "float", "float"], ["float"], symbols_of([n]),
                   dims_product(out_shape), body)
