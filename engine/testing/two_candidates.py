"""A kernel with two candidates of the same result and known relative cost, for tuning.

``heavy`` (candidate 0) does eight times the passes of ``light``, so a tuner that picks ``light``
shows the timing worked: the "first" policy and index tie-breaks would pick 0. Shared by
tests/test_tuning.py and benchmarks/tuning.py, so the test and the benchmark time the same kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["WORK_C", "work_bundle"]

WORK_C = r"""
#include <stdint.h>
/* y = x, computed by `passes` rounds of y = y/2 + x/2 (exact in float, not foldable). */
static void work(const float *x, float *y, int64_t n, int passes) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
    for (int p = 0; p < passes; p++)
        for (int64_t i = 0; i < n; i++) y[i] = 0.5f * y[i] + 0.5f * x[i];
}
int32_t heavy(void *const *t, const int64_t *sym, void *ws) { work(t[0], t[1], sym[0], 64); return 0; }
int32_t light(void *const *t, const int64_t *sym, void *ws) { work(t[0], t[1], sym[0], 8); return 0; }
"""


def work_bundle(registry: Any, path: Path) -> Path:
    """The one-kernel graph ``y = work(x)`` over symbol ``n``, saved at ``path``."""
    from engine.build import GraphBuilder

    b = GraphBuilder("work", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("work", entries=["heavy", "light"], source=WORK_C)
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    b.save(path)
    return path
