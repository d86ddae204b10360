"""The CPU kernel of a MaxPool or AveragePool over three spatial axes (NCDHW; written for any rank).

The 2-D pools read each plane through the phase-split plane buffer (``phase_plane.py``), a layout
of two axes; a volume is pooled one window at a time instead: output rows (plane and outer output
coordinates) shared out to the threads (``parallel_rows``, AVX2 where the machine has it), each
output element's window taken by ``window_nd``'s loops, the same loops the GPU kernel runs, so
both skip the padding and count an average's elements alike.
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine_onnx.codegen import PARALLEL_WORK, KernelSpec, parallel_rows, source_with_entries
from engine_onnx.dims import Dim, dim_c, dims_product
from engine_onnx.ops.window_nd import Window, average_window, max_window, split_index, window_starts
from engine_onnx.vecmath import NO_TRAPS

__all__ = ["pool_nd_spec"]


def pool_nd_spec(is_max: bool, planes: Dim, w: Window, include_pad: bool, ep: Callable[[str], str],
                 symbols: Sequence[str]) -> KernelSpec:
    """MaxPool (``is_max``) or AveragePool of ``planes`` planes over window ``w``; ``ep`` builds
    the fused activations' expression of the pooled value."""
    last = w.rank - 1
    outer = [f"o{a}" for a in range(last)]
    indent = "            "
    value = (max_window(w, "x", indent) + f"{indent}y[ow] = {ep('m')};\n" if is_max
             else average_window(w, include_pad, "x", indent) + f"{indent}y[ow] = {ep('a')};\n")
    row = (split_index("r", w.out[:last], outer, "p", "        ")
           + f"        const float *x = X + p * {w.in_plane};\n        float *y = Y + r * {w.out[last]};\n"
           + window_starts(w, dict(enumerate(outer)), "        ")
           + f"        for (int64_t ow = 0; ow < {w.out[last]}; ow++) {{\n"
           + window_starts(w, {last: "ow"}, indent) + value + "        }\n")
    decls = "    const float *X = (const float *)t[0]; float *Y = (float *)t[1];\n"
    rows = dims_product([planes, w.out_plane // w.out[last]])
    work = dims_product([planes, w.out_plane * w.taps])
    syms = tuple(symbols)
    fn, body = parallel_rows("pool_nd", syms, decls, dim_c(rows), row, work, PARALLEL_WORK)
    # No traps: GCC may then take the maximum's ``?:`` as a branch-free max, as in the 2-D kernel.
    source = source_with_entries("#pragma GCC push_options\n" + NO_TRAPS + fn + "#pragma GCC pop_options\n",
                                 [("pool", body)], syms)
    name = "maxpool" if is_max else "averagepool"
    return KernelSpec(name, source, ("pool",), syms)
