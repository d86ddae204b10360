"""Pieces of kernel source shared by the op modules: C literals, broadcast loop nests, GPU index math.

Several op families write kernels over the same merged loop nest (elementwise groups, MatMul's
batch broadcasting, reductions, their GPU forms); keeping these here lets each op module import
them without importing another op family's handlers (and so without an import circle).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from engine_onnx.codegen import ctype
from engine_onnx.dims import Dim
from engine_onnx.errors import NodeUnsupported
from engine_onnx.gpu import gdim

__all__ = ["lit", "broadcast_shape", "loop_nest", "coordinates", "offset"]


def lit(value: float, dtype: np.dtype) -> str:
    """A C literal of ``value`` in ``dtype``'s C type."""
    if np.dtype(dtype).kind == "f":
        v = float(value)
        text = ("INFINITY" if v == math.inf else "(-INFINITY)" if v == -math.inf else "NAN" if math.isnan(v)
                else repr(v))
        return f"(({'float' if np.dtype(dtype).name == 'float16' else ctype(dtype)}){text})"
    return f"(({ctype(dtype)}){int(value)})"


def broadcast_shape(shapes: Sequence[Sequence[Dim]]) -> tuple[Dim, ...]:
    """The shape ONNX's multidirectional broadcasting gives ``shapes``; refuses shapes that do not
    broadcast or whose dynamic dimensions cannot be proved equal."""
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for d in range(rank):
        size: Dim = 1
        for s in shapes:
            k = d - (rank - len(s))
            if k < 0:
                continue
            v = s[k]
            if v == 1:
                continue
            if size == 1:
                size = v
            elif size != v:
                raise NodeUnsupported(f"shapes {[list(x) for x in shapes]} do not broadcast (or their dynamic "
                                      f"dimensions cannot be proved equal)")
        out.append(size)
    return tuple(out)


def loop_nest(out_shape: Sequence[Dim], in_shapes: Sequence[Sequence[Dim]]) -> tuple[list[Dim], list[list[Dim]]]:
    """Merged loop sizes and, per input, the stride of each loop (0 where it broadcasts)."""
    rank = len(out_shape)
    padded = [[1] * (rank - len(s)) + list(s) for s in in_shapes]
    groups: list[tuple[Dim, tuple[bool, ...]]] = []
    for d in range(rank):
        if out_shape[d] == 1:
            continue
        status = tuple(p[d] != 1 for p in padded)
        if groups and groups[-1][1] == status:
            groups[-1] = (groups[-1][0] * out_shape[d], status)
        else:
            groups.append((out_shape[d], status))
    sizes = [g[0] for g in groups]
    strides: list[list[Dim]] = []
    for j in range(len(in_shapes)):
        run: Dim = 1
        st: list[Dim] = [0] * len(groups)
        for k in range(len(groups) - 1, -1, -1):
            if groups[k][1][j]:
                st[k] = run
                run = run * groups[k][0]
        strides.append(st)
    return sizes, strides


def coordinates(sizes: Sequence[Dim], flat: str = "i") -> str:
    """Statements defining ``c0…`` (outermost first) from the flat row-major index ``flat``."""
    if not sizes:
        return ""
    lines = [f"    int64_t rest = {flat};"]
    for k in range(len(sizes) - 1, 0, -1):
        lines.append(f"    const int64_t c{k} = rest % {gdim(sizes[k])}; rest /= {gdim(sizes[k])};")
    lines.append("    const int64_t c0 = rest;")
    return "\n".join(lines) + "\n"


def offset(strides: Sequence[Dim]) -> str:
    """The element offset ``sum(c_k * strides[k])`` (``0`` when every stride is 0)."""
    return " + ".join(f"c{k} * {gdim(s)}" for k, s in enumerate(strides) if s != 0) or "0"
