"""The engine's reference kernels (names and semantics in ``engine.testing``) for this device.

The conformance suite compiles and runs each of them, and ``engine demo --device template`` builds
its model from the ``mlp_*`` ones; a missing kernel only skips the tests that need it. This device
runs the CPU kernel ABI, so the sources are C; the MLP kernels are the demo's own sources
(``engine.demo.mlp``), which use the macros ``K``/``N`` the caller defines. A device with launch
geometry also gives each kernel its ``launch`` dict, e.g.
``{"grid": ["ceil_div(n, 64)", 1, 1], "block": [64, 1, 1]}``.
"""

from __future__ import annotations

from typing import Mapping

from engine.backend import ReferenceKernel

__all__ = ["SOURCE", "reference_kernels"]

#: ``add``, ``scale_ws``, ``busy`` and ``fail_code`` in one C file.
SOURCE = r"""
#include <stdint.h>

/* add: z[n] = x[n] + y[n] */
int32_t t_add(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *y = t[1]; float *z = t[2];
    for (int64_t i = 0; i < sym[0]; i++) z[i] = x[i] + y[i];
    return 0;
}

/* scale_ws: ws[i] = 2 x[i], then y[i] = ws[i] + 1 */
int32_t t_scale_ws(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1], *w = ws;
    if (w == 0) return 1;
    for (int64_t i = 0; i < sym[0]; i++) w[i] = 2.0f * x[i];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = w[i] + 1.0f;
    return 0;
}

/* busy: y[i] = x[i] + iters, adding 1.0f iters times (run time grows with iters) */
int32_t t_busy(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1]; int64_t n = sym[0], iters = sym[1];
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        for (int64_t k = 0; k < iters; k++) v += 1.0f;
        y[i] = v;
    }
    return 0;
}

/* fail_code: always returns 7 */
int32_t t_fail_code(void *const *t, const int64_t *sym, void *ws) { return 7; }
"""


def reference_kernels() -> Mapping[str, ReferenceKernel]:
    from engine.demo.mlp import BIAS_SOURCE, MATMUL_SOURCE, SOFTMAX_SOURCE  # lazy: it imports the builder

    return {
        "add": ReferenceKernel(SOURCE, "c", ("t_add",)),
        "scale_ws": ReferenceKernel(SOURCE, "c", ("t_scale_ws",)),
        "busy": ReferenceKernel(SOURCE, "c", ("t_busy",)),
        "fail_code": ReferenceKernel(SOURCE, "c", ("t_fail_code",)),
        "mlp_matmul": ReferenceKernel(MATMUL_SOURCE, "c", ("mm_ijk", "mm_ikj")),
        "mlp_bias_relu": ReferenceKernel(BIAS_SOURCE, "c", ("bias_relu",)),
        "mlp_bias_add": ReferenceKernel(BIAS_SOURCE, "c", ("bias_add",)),
        # The template links -lm into every kernel and takes no compile options.
        "mlp_softmax": ReferenceKernel(SOFTMAX_SOURCE, "c", ("softmax_rows",)),
    }
