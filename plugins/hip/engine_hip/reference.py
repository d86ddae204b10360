"""The project's reference kernels in HIP C++ (``BackendBase.reference_kernels``), plus a faulting one.

Names and semantics are ``engine.testing.REFERENCE_KERNELS``; the argument ABI is bundle format
§12.2 (tensor pointers, inputs then outputs, one ``int64_t`` per symbol, then the workspace pointer
when the kernel declares one), the same as CUDA's. ``mlp_*`` sources use the macros ``K``/``N`` their
caller defines, and their launch dicts use them too (``engine.demo.mlp`` substitutes the values).
Every grid dimension is at least 1, so a zero batch still makes a valid launch.

Differences from the CUDA sources (``engine_cuda.reference``): no ``#include <stdint.h>`` (hiprtc
defines ``int64_t`` itself, and the system header then clashes with its definition), and the
softmax's row reduction uses ``__shfl_xor(v, lane_mask, 32)``: a 32-thread block is one wavefront
on RDNA (wave32) and half of one on CDNA (wave64), and a shuffle of width 32 stays within those 32
lanes on both. ``mlp_matmul`` has the same two candidates (``mm_naive``, ``mm_tiled``) on one
geometry. ``FAULT`` writes far out of bounds: on ROCm a GPU memory fault usually ends the process
(the HSA runtime aborts), so tests run it in a process of its own and accept either a
``KernelError`` or that abort.
"""

from __future__ import annotations

from typing import Mapping

from engine.backend import ReferenceKernel

__all__ = ["reference_kernels", "fault_kernel", "SOURCES", "ADD", "SCALE_WS", "BUSY", "MATMUL", "BIAS",
           "SOFTMAX", "FAULT", "MLP_MACROS", "LANGUAGE"]

LANGUAGE = "hip"
_BLOCK = 256
_PER_ITEM = {"grid": [f"max(ceil_div(n, {_BLOCK}), 1)", 1, 1], "block": [_BLOCK, 1, 1]}
_PER_ELEMENT = {"grid": [f"max(ceil_div(batch * N, {_BLOCK}), 1)", 1, 1], "block": [_BLOCK, 1, 1]}
_TILE_GRID = {"grid": ["ceil_div(N, 16)", "max(ceil_div(batch, 16), 1)", 1], "block": [16, 16, 1]}
_ROW_PER_BLOCK = {"grid": ["max(batch, 1)", 1, 1], "block": [32, 1, 1]}

#: Macro values the compile test specialises the mlp kernels with (the demo's first layer).
MLP_MACROS: Mapping[str, Mapping[str, int]] = {
    "mlp_matmul": {"K": 64, "N": 128}, "mlp_bias_relu": {"N": 128}, "mlp_bias_add": {"N": 128},
    "mlp_softmax": {"N": 10},
}

ADD = r"""
/* z[n] = x[n] + y[n] */
extern "C" __global__ void add(const float *x, const float *y, float *z, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = x[i] + y[i];
}
"""

SCALE_WS = r"""
/* ws[i] = 2 x[i], then y[i] = ws[i] + 1: right only if the workspace pointer is usable. */
extern "C" __global__ void scale_ws(const float *x, float *y, int64_t n, float *ws) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { ws[i] = 2.0f * x[i]; y[i] = ws[i] + 1.0f; }
}
"""

BUSY = r"""
/* y[i] = x[i] + iters by adding 1.0f iters times: the run time grows with iters. */
extern "C" __global__ void busy(const float *x, float *y, int64_t n, int64_t iters) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int64_t k = 0; k < iters; k++) v += 1.0f;
    y[i] = v;
}
"""

MATMUL = r"""
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

BIAS = r"""
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

SOFTMAX = r"""
/* Row-wise softmax, one 32-thread block per row (a shuffle of width 32: wave32 and wave64 alike);
   the workspace holds each row's maximum. */
extern "C" __global__ void softmax_rows(const float *x, float *y, int64_t batch, float *row_max) {
    int64_t r = blockIdx.x;
    if (r >= batch) return;
    const float *xr = x + r * N;
    float *yr = y + r * N;
    float m = xr[0];
    for (int j = threadIdx.x; j < N; j += 32) m = fmaxf(m, xr[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor(m, o, 32));
    if (threadIdx.x == 0) row_max[r] = m;
    float s = 0.0f;
    for (int j = threadIdx.x; j < N; j += 32) { float e = expf(xr[j] - m); yr[j] = e; s += e; }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor(s, o, 32);
    for (int j = threadIdx.x; j < N; j += 32) yr[j] /= s;
}
"""

FAULT = r"""
/* Writes 16 TiB past y: a memory access fault on every GPU (a stand-in for an indexing bug). */
extern "C" __global__ void fault(const float *x, float *y, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i + ((int64_t)1 << 42)] = x[i];
}
"""

#: Every shipped HIP source by name, with its entries (the compile test builds each one).
SOURCES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "add": (ADD, ("add",)),
    "scale_ws": (SCALE_WS, ("scale_ws",)),
    "busy": (BUSY, ("busy",)),
    "mlp_matmul": (MATMUL, ("mm_naive", "mm_tiled")),
    "mlp_bias_relu": (BIAS, ("bias_relu",)),
    "mlp_bias_add": (BIAS, ("bias_add",)),
    "mlp_softmax": (SOFTMAX, ("softmax_rows",)),
    "fault": (FAULT, ("fault",)),
}


def reference_kernels() -> Mapping[str, ReferenceKernel]:
    """The reference kernels (``engine.testing.REFERENCE_KERNELS`` names) as HIP C++."""
    def ref(source: str, entries: tuple[str, ...], launch: object) -> ReferenceKernel:
        return ReferenceKernel(source, LANGUAGE, entries, launch)  # type: ignore[arg-type]

    return {
        "add": ref(ADD, ("add",), _PER_ITEM),
        "scale_ws": ref(SCALE_WS, ("scale_ws",), _PER_ITEM),
        "busy": ref(BUSY, ("busy",), _PER_ITEM),
        "mlp_matmul": ref(MATMUL, ("mm_naive", "mm_tiled"), _TILE_GRID),
        "mlp_bias_relu": ref(BIAS, ("bias_relu",), _PER_ELEMENT),
        "mlp_bias_add": ref(BIAS, ("bias_add",), _PER_ELEMENT),
        "mlp_softmax": ref(SOFTMAX, ("softmax_rows",), _ROW_PER_BLOCK),
    }


def fault_kernel() -> ReferenceKernel:
    """A kernel shaped like ``add`` less one input (``x -> y``, symbol ``n``) that faults on launch."""
    return ReferenceKernel(FAULT, LANGUAGE, ("fault",), _PER_ITEM)
