"""The reference kernels (names and semantics: ``engine.testing.REFERENCE_KERNELS``) in C, for
devices that run the CPU kernel ABI (bundle format §12.1): the CPU plugin, the plugin template,
and any third-party device built on the same ABI.

The MLP sources are the demo's own (``engine.demo.mlp``), so the demo model and the reference
kernels cannot drift apart; they use the macros ``K``/``N`` the caller defines. The ABI has no
launch geometry, so every ``launch`` is ``None``.
"""

from __future__ import annotations

from typing import Mapping

from engine.backend import ReferenceKernel

__all__ = ["ADD_SOURCE", "SCALE_WS_SOURCE", "BUSY_SOURCE", "FAIL_CODE_SOURCE", "c_reference_kernels"]

ADD_SOURCE = r"""
#include <stdint.h>
/* z[n] = x[n] + y[n] */
int32_t ref_add(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *y = t[1]; float *z = t[2];
    for (int64_t i = 0; i < sym[0]; i++) z[i] = x[i] + y[i];
    return 0;
}
"""

SCALE_WS_SOURCE = r"""
#include <stdint.h>
/* ws[i] = 2 x[i], then y[i] = ws[i] + 1: the result is only right if the workspace is usable. */
int32_t ref_scale_ws(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1], *w = ws;
    if (w == 0) return 1;
    for (int64_t i = 0; i < sym[0]; i++) w[i] = 2.0f * x[i];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = w[i] + 1.0f;
    return 0;
}
"""

BUSY_SOURCE = r"""
#include <stdint.h>
/* y[i] = x[i] + iters, by adding 1.0f iters times: the run time grows with iters (float additions
   are not reassociated without -ffast-math, so the loop is not folded away). */
int32_t ref_busy(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1]; int64_t n = sym[0], iters = sym[1];
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        for (int64_t k = 0; k < iters; k++) v += 1.0f;
        y[i] = v;
    }
    return 0;
}
"""

FAIL_CODE_SOURCE = r"""
#include <stdint.h>
/* Always fails with code 7 (the core must turn it into a KernelError naming the kernel). */
int32_t ref_fail_code(void *const *t, const int64_t *sym, void *ws) { return 7; }
"""


def c_reference_kernels(*, link_math: bool = True) -> Mapping[str, ReferenceKernel]:
    """Every reference kernel as C for the CPU ABI, by name. ``link_math=False`` leaves out the
    ``-lm`` compile option of the softmax, for a compiler that takes no options and links it anyway."""
    from engine.demo.mlp import BIAS_SOURCE, MATMUL_SOURCE, SOFTMAX_SOURCE  # lazy: it imports the builder

    return {
        "add": ReferenceKernel(ADD_SOURCE, "c", ("ref_add",)),
        "scale_ws": ReferenceKernel(SCALE_WS_SOURCE, "c", ("ref_scale_ws",)),
        "busy": ReferenceKernel(BUSY_SOURCE, "c", ("ref_busy",)),
        "fail_code": ReferenceKernel(FAIL_CODE_SOURCE, "c", ("ref_fail_code",)),
        "mlp_matmul": ReferenceKernel(MATMUL_SOURCE, "c", ("mm_ijk", "mm_ikj")),
        "mlp_bias_relu": ReferenceKernel(BIAS_SOURCE, "c", ("bias_relu",)),
        "mlp_bias_add": ReferenceKernel(BIAS_SOURCE, "c", ("bias_add",)),
        "mlp_softmax": ReferenceKernel(SOFTMAX_SOURCE, "c", ("softmax_rows",),
                                       options={"flags": ["-lm"]} if link_math else None),
    }
