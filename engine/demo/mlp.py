"""A small MLP classifier as hand-written C kernels, the way a compiler would emit them.

``x[batch, d_in] -> matmul -> bias+relu (in place) -> matmul -> bias (in place) -> softmax``.
Shapes other than ``batch`` are baked into each kernel's source (compilers specialise them);
``batch`` is a dynamic symbol. The matmul has two candidates with the same result and different
loop orders, so the runtime has something real to tune.
"""

from __future__ import annotations

import numpy as np

from engine.build import GraphBuilder
from engine.plugins import Registry

__all__ = ["MATMUL_SOURCE", "build_mlp", "mlp_weights", "reference_mlp"]

MATMUL_SOURCE = r"""
#include <stdint.h>
/* C[batch, N] = A[batch, K] @ W[K, N]; two candidates with different loop orders. */
int32_t mm_ijk(void *const *t, const int64_t *sym, void *ws) {
    const float *a = t[0], *w = t[1]; float *c = t[2]; int64_t batch = sym[0];
    for (int64_t i = 0; i < batch; i++)
        for (int64_t j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += a[i * K + k] * w[k * N + j];
            c[i * N + j] = acc;
        }
    return 0;
}
int32_t mm_ikj(void *const *t, const int64_t *sym, void *ws) {
    const float *a = t[0], *w = t[1]; float *c = t[2]; int64_t batch = sym[0];
    for (int64_t i = 0; i < batch; i++) {
        float *row = c + i * N;
        for (int64_t j = 0; j < N; j++) row[j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float av = a[i * K + k]; const float *wr = w + k * N;
            for (int64_t j = 0; j < N; j++) row[j] += av * wr[j];
        }
    }
    return 0;
}
"""

BIAS_SOURCE = r"""
#include <stdint.h>
/* y[batch, N] = act(x + b), written in place over x (share_map {0: 0}). */
int32_t bias_relu(void *const *t, const int64_t *sym, void *ws) {
    float *x = t[0]; const float *b = t[1]; float *y = t[2]; int64_t batch = sym[0];
    for (int64_t i = 0; i < batch * N; i++) { float v = x[i] + b[i % N]; y[i] = v > 0.0f ? v : 0.0f; }
    return 0;
}
int32_t bias_add(void *const *t, const int64_t *sym, void *ws) {
    float *x = t[0]; const float *b = t[1]; float *y = t[2]; int64_t batch = sym[0];
    for (int64_t i = 0; i < batch * N; i++) y[i] = x[i] + b[i % N];
    return 0;
}
"""

SOFTMAX_SOURCE = r"""
#include <stdint.h>
#include <math.h>
/* Row-wise softmax; the workspace holds one float per row (the row maximum). */
int32_t softmax_rows(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1]; float *row_max = ws; int64_t batch = sym[0];
    for (int64_t i = 0; i < batch; i++) {
        float m = x[i * N];
        for (int64_t j = 1; j < N; j++) m = x[i * N + j] > m ? x[i * N + j] : m;
        row_max[i] = m;
    }
    for (int64_t i = 0; i < batch; i++) {
        float s = 0.0f;
        for (int64_t j = 0; j < N; j++) { float e = expf(x[i * N + j] - row_max[i]); y[i * N + j] = e; s += e; }
        for (int64_t j = 0; j < N; j++) y[i * N + j] /= s;
    }
    return 0;
}
"""


def _specialise(source: str, **dims: int) -> str:
    defines = "".join(f"#define {k} {v}\n" for k, v in dims.items())
    return defines + source


def mlp_weights(d_in: int = 64, hidden: int = 128, classes: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": (rng.standard_normal(hidden) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
        "b2": (rng.standard_normal(classes) * 0.1).astype(np.float32),
    }


def build_mlp(*, d_in: int = 64, hidden: int = 128, classes: int = 10, seed: int = 0,
              weights: dict[str, np.ndarray] | None = None, registry: Registry | None = None) -> GraphBuilder:
    """The classifier as a ``GraphBuilder`` (call ``.build()`` or ``.save(path)``)."""
    w = weights if weights is not None else mlp_weights(d_in, hidden, classes, seed)
    b = GraphBuilder("mlp_classifier", registry=registry)
    x = b.input("x", "float32", ["batch", d_in])
    w1, b1, w2, b2 = (b.weight(name, w[name]) for name in ("w1", "b1", "w2", "b2"))

    mm1 = b.kernel("matmul_1", entries=["mm_ijk", "mm_ikj"], source=_specialise(MATMUL_SOURCE, K=d_in, N=hidden))
    mm2 = b.kernel("matmul_2", entries=["mm_ijk", "mm_ikj"], source=_specialise(MATMUL_SOURCE, K=hidden, N=classes))
    act1 = b.kernel("bias_relu", entries=["bias_relu"], source=_specialise(BIAS_SOURCE, N=hidden))
    add2 = b.kernel("bias_add", entries=["bias_add"], source=_specialise(BIAS_SOURCE, N=classes))
    smax = b.kernel("softmax", entries=["softmax_rows"], source=_specialise(SOFTMAX_SOURCE, N=classes),
                    options={"flags": ["-lm"]})

    (h,) = b.call(mm1, [x, w1], [("float32", ["batch", hidden])], symbols=["batch"])
    (h,) = b.call(act1, [h, b1], [("float32", ["batch", hidden])], symbols=["batch"], share_map={0: 0})
    (z,) = b.call(mm2, [h, w2], [("float32", ["batch", classes])], symbols=["batch"])
    (z,) = b.call(add2, [z, b2], [("float32", ["batch", classes])], symbols=["batch"], share_map={0: 0})
    (p,) = b.call(smax, [z], [("float32", ["batch", classes])], symbols=["batch"], workspace="batch * 4")
    b.output(p, "probs")
    return b


def reference_mlp(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """The same model in numpy (float64 accumulation), for checking results."""
    h = np.maximum(x.astype(np.float64) @ w["w1"] + w["b1"], 0.0)
    z = h @ w["w2"] + w["b2"]
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
