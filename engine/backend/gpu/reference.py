"""The project's reference kernels in the CUDA dialect of C++ that CUDA (NVRTC) and HIP (hiprtc)
both compile, written once for every ``GpuBackend`` (``BackendBase.reference_kernels``), plus a
faulting one.

Names and semantics are ``engine.testing.REFERENCE_KERNELS``; the argument ABI is bundle format
§12.2 (tensor pointers, inputs then outputs, one ``int64_t`` per symbol, then the workspace pointer
when the kernel declares one). ``mlp_*`` sources use the macros ``K``/``N`` their caller defines,
and their launch dicts use them too (``engine.demo.mlp`` substitutes the values: launch
expressions may only name the kernel's symbols). Every grid dimension is at least 1, so a zero
batch still makes a valid launch (each thread checks its bounds).

What differs between the vendors is a ``Dialect``'s prelude, prepended to every source: CUDA needs
``<stdint.h>`` for ``int64_t`` (hiprtc defines it itself, and the system header then clashes), and
the softmax's row reduction is ``SHFL_XOR(v, lane_mask)`` — ``__shfl_xor_sync`` over the full warp
on CUDA, ``__shfl_xor(v, mask, 32)`` on HIP, where a 32-thread block is one wavefront on RDNA
(wave32) and half of one on CDNA (wave64), and a shuffle of width 32 stays within those lanes.

``mlp_matmul`` has two candidates with the same result, so tuning has a real choice: ``mm_naive``
(each thread reads its row of ``a`` and column of ``w`` from global memory) and ``mm_tiled`` (16x16
tiles staged in shared memory), on one launch geometry (a ``ReferenceKernel`` has one launch).
``fail_code`` is absent: GPU kernels cannot return a code. ``FAULT`` is not a reference kernel: it
writes far out of bounds, which the plugin must report as a ``KernelError`` (the error is sticky on
CUDA, and ROCm usually aborts the process, so tests run it in a process of its own).
"""

from __future__ import annotations

from typing import Mapping

import attrs

from engine.backend.contract import ReferenceKernel

__all__ = ["Dialect", "CUDA", "HIP", "MLP_MACROS", "sources", "reference_kernels", "fault_kernel"]


@attrs.frozen
class Dialect:
    """How one vendor's runtime compiler reads the shared sources."""

    #: ``ReferenceKernel.language`` (``"cuda"``, ``"hip"``).
    language: str
    #: Prepended to every source: headers and the ``SHFL_XOR(v, lane_mask)`` macro.
    prelude: str


CUDA = Dialect("cuda", "#include <stdint.h>\n#define SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))\n")
HIP = Dialect("hip", "#define SHFL_XOR(v, o) __shfl_xor((v), (o), 32)\n")

#: Threads per block of the element-wise kernels.
_BLOCK = 256
_PER_ITEM = {"grid": [f"max(ceil_div(n, {_BLOCK}), 1)", 1, 1], "block": [_BLOCK, 1, 1]}
_PER_ELEMENT = {"grid": [f"max(ceil_div(batch * N, {_BLOCK}), 1)", 1, 1], "block": [_BLOCK, 1, 1]}
#: One geometry for both matmul candidates: 16x16 threads per 16x16 tile of the output.
_TILE_GRID = {"grid": ["ceil_div(N, 16)", "max(ceil_div(batch, 16), 1)", 1], "block": [16, 16, 1]}
_ROW_PER_BLOCK = {"grid": ["max(batch, 1)", 1, 1], "block": [32, 1, 1]}

#: Macro values the compile tests and the benchmarks specialise the mlp kernels with (the demo's
#: first layer; the softmax's width is the demo's class count).
MLP_MACROS: Mapping[str, Mapping[str, int]] = {
    "mlp_matmul": {"K": 64, "N": 128}, "mlp_bias_relu": {"N": 128}, "mlp_bias_add": {"N": 128},
    "mlp_softmax": {"N": 10},
}

_ADD = r"""
/* z[n] = x[n] + y[n] */
extern "C" __global__ void add(const float *x, const float *y, float *z, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = x[i] + y[i];
}
"""

_SCALE_WS = r"""
/* ws[i] = 2 x[i], then y[i] = ws[i] + 1: right only if the workspace pointer is usable. */
extern "C" __global__ void scale_ws(const float *x, float *y, int64_t n, float *ws) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { ws[i] = 2.0f * x[i]; y[i] = ws[i] + 1.0f; }
}
"""

_BUSY = r"""
/* y[i] = x[i] + iters by adding 1.0f iters times: the run time grows with iters (no fast math, so
   the float additions are not folded). */
extern "C" __global__ void busy(const float *x, float *y, int64_t n, int64_t iters) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int64_t k = 0; k < iters; k++) v += 1.0f;
    y[i] = v;
}
"""

_MATMUL = r"""
/* c[batch, N] = a[batch, K] @ w[K, N]; two candidates, same result, same launch: a 16x16 block
   of threads per 16x16 tile of c (blockIdx.x over columns, blockIdx.y over rows). */
#define MM_TILE 16
extern "C" __global__ void mm_naive(const float *a, const float *w, float *c, int64_t batch) {
    int64_t row = (int64_t)blockIdx.y * MM_TILE + threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * MM_TILE + threadIdx.x;
    if (row >= batch || col >= N) return;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) acc += a[row * K + k] * w[k * N + col];
    c[row * N + col] = acc;
}

extern "C" __global__ void mm_tiled(const float *a, const float *w, float *c, int64_t batch) {
    __shared__ float at[MM_TILE][MM_TILE];
    __shared__ float wt[MM_TILE][MM_TILE + 1];
    int64_t row = (int64_t)blockIdx.y * MM_TILE + threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * MM_TILE + threadIdx.x;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += MM_TILE) {
        int64_t ka = k0 + threadIdx.x, kw = k0 + threadIdx.y;
        at[threadIdx.y][threadIdx.x] = (row < batch && ka < K) ? a[row * K + ka] : 0.0f;
        wt[threadIdx.y][threadIdx.x] = (kw < K && col < N) ? w[kw * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < MM_TILE; k++) acc += at[threadIdx.y][k] * wt[k][threadIdx.x];
        __syncthreads();
    }
    if (row < batch && col < N) c[row * N + col] = acc;
}
"""

_BIAS = r"""
/* y[batch, N] = act(x + b[N]), in place over x (share_map {0: 0}): y may be x, so no __restrict__. */
extern "C" __global__ void bias_relu(float *x, const float *b, float *y, int64_t batch) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < batch * N) y[i] = fmaxf(x[i] + b[i % N], 0.0f);
}
extern "C" __global__ void bias_add(float *x, const float *b, float *y, int64_t batch) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < batch * N) y[i] = x[i] + b[i % N];
}
"""

_SOFTMAX = r"""
/* Row-wise softmax, one 32-thread block per row (a shuffle of width 32: one warp on
   CUDA, wave32 and half of wave64 on AMD); the workspace holds each row's maximum. */
extern "C" __global__ void softmax_rows(const float *x, float *y, int64_t batch, float *row_max) {
    int64_t r = blockIdx.x;
    if (r >= batch) return;
    const float *xr = x + r * N;
    float *yr = y + r * N;
    float m = xr[0];
    for (int j = threadIdx.x; j < N; j += 32) m = fmaxf(m, xr[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, SHFL_XOR(m, o));
    if (threadIdx.x == 0) row_max[r] = m;
    float s = 0.0f;
    for (int j = threadIdx.x; j < N; j += 32) { float e = expf(xr[j] - m); yr[j] = e; s += e; }
    for (int o = 16; o > 0; o >>= 1) s += SHFL_XOR(s, o);
    for (int j = threadIdx.x; j < N; j += 32) yr[j] /= s;
}
"""

_FAULT = r"""
/* Writes 16 TiB past y: an illegal address / memory access fault on every GPU (a stand-in for an indexing bug). */
extern "C" __global__ void fault(const float *x, float *y, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i + ((int64_t)1 << 42)] = x[i];
}
"""

#: name -> (source without the prelude, entries, launch); ``fault`` is not a reference kernel.
_KERNELS: Mapping[str, tuple[str, tuple[str, ...], object]] = {
    "add": (_ADD, ("add",), _PER_ITEM),
    "scale_ws": (_SCALE_WS, ("scale_ws",), _PER_ITEM),
    "busy": (_BUSY, ("busy",), _PER_ITEM),
    "mlp_matmul": (_MATMUL, ("mm_naive", "mm_tiled"), _TILE_GRID),
    "mlp_bias_relu": (_BIAS, ("bias_relu",), _PER_ELEMENT),
    "mlp_bias_add": (_BIAS, ("bias_add",), _PER_ELEMENT),
    "mlp_softmax": (_SOFTMAX, ("softmax_rows",), _ROW_PER_BLOCK),
    "fault": (_FAULT, ("fault",), _PER_ITEM),
}


def sources(dialect: Dialect) -> Mapping[str, tuple[str, tuple[str, ...]]]:
    """Every shipped source by name, in ``dialect``, with its entries (the compile tests build each)."""
    return {name: (dialect.prelude + src, entries) for name, (src, entries, _) in _KERNELS.items()}


def reference_kernels(dialect: Dialect) -> Mapping[str, ReferenceKernel]:
    """The reference kernels (``engine.testing.REFERENCE_KERNELS`` names) in ``dialect``."""
    return {name: ReferenceKernel(dialect.prelude + src, dialect.language, entries, launch)  # type: ignore[arg-type]
            for name, (src, entries, launch) in _KERNELS.items() if name != "fault"}


def fault_kernel(dialect: Dialect) -> ReferenceKernel:
    """A kernel shaped like ``add`` less one input (``x -> y``, symbol ``n``) that faults on launch."""
    src, entries, launch = _KERNELS["fault"]
    return ReferenceKernel(dialect.prelude + src, dialect.language, entries, launch)  # type: ignore[arg-type]
