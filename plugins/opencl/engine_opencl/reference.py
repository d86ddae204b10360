"""The project's reference kernels in OpenCL C (``BackendBase.reference_kernels``).

They follow the kernel ABI of ``docs/opencl.md`` and are written for clarity, not speed. Launch
expressions may only use the kernel's symbols, so the MLP kernels whose width ``N`` is a macro run
one work-group of 64 per row (``grid = batch``) and stride over the columns. ``fail_code`` is
absent: OpenCL kernels cannot return a code.
"""

from __future__ import annotations

from typing import Mapping

from engine.backend import ReferenceKernel

__all__ = ["reference_kernels"]

_PER_ITEM = {"grid": ["ceil_div(n, 64)", 1, 1], "block": [64, 1, 1]}
_PER_ROW = {"grid": ["batch", 1, 1], "block": [64, 1, 1]}
_PER_ROW_ITEM = {"grid": ["ceil_div(batch, 64)", 1, 1], "block": [64, 1, 1]}

ADD = r"""
__kernel void add(__global const float *x, __global const float *y, __global float *z, long n) {
    long i = get_global_id(0);
    if (i < n) z[i] = x[i] + y[i];
}
"""

SCALE_WS = r"""
__kernel void scale_ws(__global const float *x, __global float *y, long n, __global float *ws) {
    long i = get_global_id(0);
    if (i < n) { ws[i] = 2.0f * x[i]; y[i] = ws[i] + 1.0f; }
}
"""

BUSY = r"""
__kernel void busy(__global const float *x, __global float *y, long n, long iters) {
    long i = get_global_id(0);
    if (i >= n) return;
    float v = x[i];
    for (long k = 0; k < iters; k++) v += 1.0f;
    y[i] = v;
}
"""

MATMUL = r"""
/* c[batch, N] = a[batch, K] @ w[K, N]: one work-group per row; two candidates, same result. */
__kernel void mm_rows(__global const float *a, __global const float *w, __global float *c, long batch) {
    long r = get_group_id(0);
    for (long j = get_local_id(0); j < N; j += get_local_size(0)) {
        float acc = 0.0f;
        for (long k = 0; k < K; k++) acc += a[r * K + k] * w[k * N + j];
        c[r * N + j] = acc;
    }
}
__kernel void mm_local_row(__global const float *a, __global const float *w, __global float *c, long batch) {
    __local float row[K];
    long r = get_group_id(0);
    for (long k = get_local_id(0); k < K; k += get_local_size(0)) row[k] = a[r * K + k];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (long j = get_local_id(0); j < N; j += get_local_size(0)) {
        float acc = 0.0f;
        for (long k = 0; k < K; k++) acc += row[k] * w[k * N + j];
        c[r * N + j] = acc;
    }
}
"""

BIAS = r"""
/* y[batch, N] = act(x + b), in place over x (share_map {0: 0}): y may be x. */
__kernel void bias_relu(__global float *x, __global const float *b, __global float *y, long batch) {
    long r = get_group_id(0);
    for (long j = get_local_id(0); j < N; j += get_local_size(0)) y[r * N + j] = fmax(x[r * N + j] + b[j], 0.0f);
}
__kernel void bias_add(__global float *x, __global const float *b, __global float *y, long batch) {
    long r = get_group_id(0);
    for (long j = get_local_id(0); j < N; j += get_local_size(0)) y[r * N + j] = x[r * N + j] + b[j];
}
"""

SOFTMAX = r"""
/* Row-wise softmax, one work-item per row; the workspace holds each row's maximum. */
__kernel void softmax_rows(__global const float *x, __global float *y, long batch, __global float *row_max) {
    long r = get_global_id(0);
    if (r >= batch) return;
    __global const float *xr = x + r * N;
    __global float *yr = y + r * N;
    float m = xr[0];
    for (long j = 1; j < N; j++) m = fmax(m, xr[j]);
    row_max[r] = m;
    float s = 0.0f;
    for (long j = 0; j < N; j++) { float e = exp(xr[j] - row_max[r]); yr[j] = e; s += e; }
    for (long j = 0; j < N; j++) yr[j] /= s;
}
"""


def reference_kernels() -> Mapping[str, ReferenceKernel]:
    def ref(source: str, entries: tuple[str, ...], launch: Mapping[str, object]) -> ReferenceKernel:
        return ReferenceKernel(source, "opencl", entries, launch)

    return {
        "add": ref(ADD, ("add",), _PER_ITEM),
        "scale_ws": ref(SCALE_WS, ("scale_ws",), _PER_ITEM),
        "busy": ref(BUSY, ("busy",), _PER_ITEM),
        "mlp_matmul": ref(MATMUL, ("mm_rows", "mm_local_row"), _PER_ROW),
        "mlp_bias_relu": ref(BIAS, ("bias_relu",), _PER_ROW),
        "mlp_bias_add": ref(BIAS, ("bias_add",), _PER_ROW),
        "mlp_softmax": ref(SOFTMAX, ("softmax_rows",), _PER_ROW_ITEM),
    }
