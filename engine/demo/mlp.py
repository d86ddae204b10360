"""A small MLP classifier as hand-written kernels, the way a compiler would emit them.

``x[batch, d_in] -> matmul -> bias+relu (in place) -> matmul -> bias (in place) -> softmax``.
Shapes other than ``batch`` are baked into each kernel's source (compilers specialise them);
``batch`` is a dynamic symbol. The matmul has two candidates with the same result and different
loop orders, so the runtime has something real to tune. On the CPU the kernels are the C sources
below; on other device kinds they come from the backend's reference kernels (``build_mlp``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import numpy as np

from engine.backend import ReferenceKernel
from engine.build import GraphBuilder
from engine.device import Device
from engine.errors import Unsupported
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
              weights: Mapping[str, np.ndarray] | None = None, registry: Registry | None = None,
              device: str = "cpu", kernels: Mapping[str, ReferenceKernel] | None = None,
              io_device: str | None = None) -> GraphBuilder:
    """The classifier as a ``GraphBuilder`` (call ``.build()`` or ``.save(path)``) on one device kind.

    On the CPU the kernels are this module's C sources. On any other kind they are the ``mlp_*``
    reference kernels its backend supplies (``Backend.reference_kernels()``, in the device's own
    language): the same model through a third-party device with no kernel code in the core.
    ``kernels`` overrides both (the conformance suite passes the backend's reference kernels).

    ``io_device`` (a kind, e.g. ``"cpu"``) puts the input and the output there instead, with builtin
    copies to and from ``device`` around the model: ``build_mlp(device="cuda", io_device="cpu")`` takes
    and returns host arrays and computes on the GPU. Such a bundle needs both kinds to load.
    """
    w = weights if weights is not None else mlp_weights(d_in, hidden, classes, seed)
    kind = Device.parse(device).kind
    io_kind = Device.parse(io_device).kind if io_device is not None else kind
    b = GraphBuilder("mlp_classifier", registry=registry)
    x = b.input("x", "float32", ["batch", d_in], device=io_kind)
    w1, b1, w2, b2 = (b.weight(name, w[name], device=kind) for name in ("w1", "b1", "w2", "b2"))
    if io_kind != kind:
        x = b.copy(x, kind)
    kernel = _kernels(b, kind, kernels)

    mm1 = kernel("matmul_1", "mlp_matmul", K=d_in, N=hidden)
    mm2 = kernel("matmul_2", "mlp_matmul", K=hidden, N=classes)
    act1 = kernel("bias_relu", "mlp_bias_relu", N=hidden)
    add2 = kernel("bias_add", "mlp_bias_add", N=classes)
    smax = kernel("softmax", "mlp_softmax", N=classes)

    (h,) = b.call(mm1, [x, w1], [("float32", ["batch", hidden])], symbols=["batch"])
    (h,) = b.call(act1, [h, b1], [("float32", ["batch", hidden])], symbols=["batch"], share_map={0: 0})
    (z,) = b.call(mm2, [h, w2], [("float32", ["batch", classes])], symbols=["batch"])
    (z,) = b.call(add2, [z, b2], [("float32", ["batch", classes])], symbols=["batch"], share_map={0: 0})
    (p,) = b.call(smax, [z], [("float32", ["batch", classes])], symbols=["batch"], workspace="batch * 4")
    b.output(p if io_kind == kind else b.copy(p, io_kind), "probs")
    return b


_CPU_KERNELS = {
    "mlp_matmul": (MATMUL_SOURCE, ("mm_ijk", "mm_ikj"), None),
    "mlp_bias_relu": (BIAS_SOURCE, ("bias_relu",), None),
    "mlp_bias_add": (BIAS_SOURCE, ("bias_add",), None),
    "mlp_softmax": (SOFTMAX_SOURCE, ("softmax_rows",), {"flags": ["-lm"]}),
}


def _kernels(b: GraphBuilder, kind: str, refs: Mapping[str, ReferenceKernel] | None) -> Callable[..., Any]:
    """``kernel(name, reference_name, **macros)`` defining one of the model's kernels on ``kind``."""
    if kind == "cpu" and refs is None:
        def cpu_kernel(name: str, ref: str, **macros: int) -> Any:
            source, entries, options = _CPU_KERNELS[ref]
            return b.kernel(name, entries=list(entries), source=_specialise(source, **macros), options=options)
        return cpu_kernel
    if refs is None:
        refs = b.registry.backend(kind).reference_kernels()
    missing = [name for name in _CPU_KERNELS if name not in refs]
    if missing:
        raise Unsupported(f"the {kind} backend supplies no reference kernel {', '.join(missing)}; the demo model "
                          f"needs every mlp_* kernel (Backend.reference_kernels)")

    def device_kernel(name: str, ref: str, **macros: int) -> Any:
        kernel = refs[ref]
        launch = None if kernel.launch is None else _substitute(kernel.launch, macros)
        return b.kernel(name, device=kind, entries=list(kernel.entries), source=_specialise(kernel.source, **macros),
                        language=kernel.language, options=dict(kernel.options or {}), launch=launch)
    return device_kernel


def _substitute(launch: Mapping[str, Any], macros: Mapping[str, int]) -> dict[str, Any]:
    """Launch expressions with the macros' values in place of their names (expressions only know
    the kernel's symbols)."""
    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(macros.get(m.group(0), m.group(0))), value)
        if isinstance(value, (list, tuple)):
            return [fill(v) for v in value]
        return value
    return {k: fill(v) for k, v in launch.items()}


def reference_mlp(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """The same model in numpy (float64 accumulation), for checking results."""
    h = np.maximum(x.astype(np.float64) @ w["w1"] + w["b1"], 0.0)
    z = h @ w["w2"] + w["b2"]
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
