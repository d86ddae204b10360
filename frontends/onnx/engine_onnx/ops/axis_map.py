"""Copies whose output index maps to the input index axis by axis: Pad, Tile, nearest Resize.

Each output axis ``k`` has a table ``T_k[o] -> input index`` computed at import (``-1``: the
output element is the fill value, as a constant Pad's border), or no table when the axis is
copied unchanged (the only form a dynamic axis may take). The kernel walks the output in memory
order (blocks of the outermost axis shared out to OpenMP threads when the output is large) and,
at each axis, either copies the sub-block the table points at or fills it: one
generated loop nest whatever the op, every rule (reflect, wrap, edge, nearest rounding…) being
resolved in Python at import where it is easy to check against ONNX's reference.

On GPU kinds (``emit_axis_map``) the same tables drive one thread per output element
(``gpu_indexing.axis_map_kernel``), which reads them from an int64 weight.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.dims import Dim, Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gpu_indexing import axis_map_kernel
from engine_onnx.ops.kernel_exprs import lit

__all__ = ["axis_map_spec", "emit_axis_map"]


def _check(out_shape: Sequence[Dim], in_shape: Sequence[Dim], tables: Sequence[np.ndarray | None]) -> None:
    rank = len(out_shape)
    if rank != len(in_shape) or rank != len(tables):
        raise NodeUnsupported(f"axis map of rank {rank} with {len(in_shape)} input axes and {len(tables)} tables")
    for k, tab in enumerate(tables):
        if tab is None:
            if out_shape[k] != in_shape[k]:
                raise NodeUnsupported(f"axis {k} changes size ({out_shape[k]} from {in_shape[k]}) without a table")
        elif isinstance(out_shape[k], Mono) or isinstance(in_shape[k], Mono):
            raise NodeUnsupported(f"a dynamic axis ({k}) that is padded, tiled or resized")


def emit_axis_map(ctx: LoweringContext, name: str, x: str, output: str, out_shape: Sequence[Dim],
                  in_shape: Sequence[Dim], tables: Sequence[np.ndarray | None], dtype: np.dtype,
                  fill: float | int = 0) -> None:
    """Emit the axis map reading ``x`` into ``output``: ``axis_map_spec`` on the CPU, on GPU kinds
    ``gpu_indexing.axis_map_kernel`` with the tables as a second (weight) input."""
    if not ctx.gpu:
        ctx.emit(axis_map_spec(name, out_shape, in_shape, tables, dtype, fill), [x], [(output, dtype, out_shape)])
        return
    _check(out_shape, in_shape, tables)
    spec, joined = axis_map_kernel(name, out_shape, in_shape, tables, dtype, lit(fill, dtype))
    inputs = [x] if joined is None else [x, ctx.add_weight(joined, f"{output}.{name}_tables")]
    ctx.emit(spec, inputs, [(output, dtype, out_shape)])


def axis_map_spec(name: str, out_shape: Sequence[Dim], in_shape: Sequence[Dim],
                  tables: Sequence[np.ndarray | None], dtype: np.dtype, fill: float | int = 0) -> KernelSpec:
    """A kernel ``out[o] = in[T_0[o_0], …]`` (or ``fill`` where some ``T_k[o_k] < 0``)."""
    rank = len(out_shape)
    _check(out_shape, in_shape, tables)
    t = ctype(dtype)
    pre = []
    for k, tab in enumerate(tables):
        if tab is not None:
            values = ", ".join(str(int(v)) for v in tab) or "0"
            pre.append(f"static const int64_t T{k}[{max(len(tab), 1)}] = {{{values}}};")
    in_strides: list[Dim] = []
    run: Dim = 1
    for d in reversed(list(in_shape)):
        in_strides.insert(0, run)
        run = run * d
    inner_out = [dims_product(out_shape[k + 1:]) for k in range(rank)]
    fill_c = lit(fill, dtype) if np.dtype(dtype).name != "float16" else f"(({t}){lit(fill, np.float32)})"
    body = [f"    const {t} *restrict X = (const {t} *)t[0]; {t} *restrict P = ({t} *)t[1];"]
    if rank == 0:
        body.append("    P[0] = X[0];")
    ind = "    "
    for k in range(rank):
        prev = f"b{k - 1}" if k else "0"
        if k == 0:  # blocks of the outermost axis are independent: threads share them out
            body.append(f"{ind}#pragma omp parallel for schedule(static) if ({dim_c(dims_product(out_shape))} "
                        f">= 262144)")
        body.append(f"{ind}for (int64_t o{k} = 0; o{k} < {dim_c(out_shape[k])}; o{k}++) {{")
        ind += "    "
        if k == 0:
            body.append(f"{ind}{t} *restrict p = P + o0 * {dim_c(inner_out[0])};")
        if tables[k] is None:
            body.append(f"{ind}const int64_t b{k} = {prev} + o{k} * {dim_c(in_strides[k])};")
        else:
            body.append(f"{ind}const int64_t a{k} = T{k}[o{k}];")
            body.append(f"{ind}if (a{k} < 0) {{ for (int64_t j = 0; j < {dim_c(inner_out[k])}; j++) *p++ = "
                        f"{fill_c}; continue; }}")
            body.append(f"{ind}const int64_t b{k} = {prev} + a{k} * {dim_c(in_strides[k])};")
        if k == rank - 1:
            body.append(f"{ind}*p++ = X[b{k}];")
    for k in range(rank):
        ind = ind[:-4]
        body.append(f"{ind}}}")
    syms = tuple(symbols_of([*out_shape, *in_shape]))
    source = source_with_entries("\n".join(pre) + "\n", [("axis_map", "\n".join(body) + "\n")], syms)
    return KernelSpec(name, source, ("axis_map",), syms)
