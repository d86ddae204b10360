"""Pad (constant, reflect, edge, wrap; negative pads crop), any dtype, pads known at import.

The pads (an attribute before opset 11, an input since; ``axes`` since 18) and the constant value
must be known at import. Each padded axis gets an index table computed with ``numpy.pad`` on the
axis' index range, which is exactly the rule ONNX's reference evaluator applies, and the copy is
one ``axis_map`` kernel (on GPU kinds too); unpadded axes (a dynamic batch among them) are copied
unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.dims import Mono
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.axis_map import emit_axis_map
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.registry import register

_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _index_table(n: int, before: int, after: int, mode: str) -> np.ndarray:
    """Input index of every output position along one axis (-1: the constant value)."""
    idx = np.arange(n, dtype=np.int64)
    if before < 0:
        idx = idx[-before:]
    if after < 0:
        idx = idx[:len(idx) + after] if len(idx) + after > 0 else idx[:0]
    b, a = max(before, 0), max(after, 0)
    if mode == "constant":
        return np.pad(idx, (b, a), mode="constant", constant_values=-1)
    if len(idx) == 0:
        raise NodeUnsupported(f"{mode} padding of an empty axis")
    if mode == "reflect" and len(idx) == 1:
        return np.pad(idx, (b, a), mode="edge")
    return np.pad(idx, (b, a), mode=_MODES[mode])


@register("Pad")
def _pad(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x = node.input[0]
    xs = list(ctx.shape(x))
    rank = len(xs)
    dt = ctx.dtype(x)
    mode = ctx.attr(node, "mode", "constant")
    if mode not in _MODES:
        raise NodeUnsupported(f"mode={mode!r} (expected constant, reflect, edge or wrap)")
    if ctx.opset < 11:
        pads = [int(v) for v in ctx.attr(node, "pads", ctx.attr(node, "paddings", []))]
        value = float(ctx.attr(node, "value", 0.0))
        axes = list(range(rank))
    else:
        pads = [int(v) for v in ctx.require_const(node.input[1], "the Pad pads").reshape(-1)]
        value = 0
        if len(node.input) > 2 and node.input[2]:
            cv = ctx.require_const(node.input[2], "the Pad constant_value").reshape(-1)
            value = cv[0].item() if cv.size else 0
        axes = ([int(a) % rank for a in ctx.require_const(node.input[3], "the Pad axes").reshape(-1)]
                if len(node.input) > 3 and node.input[3] else list(range(rank)))
    if len(pads) != 2 * len(axes):
        raise NodeUnsupported(f"{len(pads)} pads for {len(axes)} axes (expected two per axis)")
    before = dict(zip(axes, pads[:len(axes)]))
    after = dict(zip(axes, pads[len(axes):]))
    tables: list[np.ndarray | None] = []
    out = []
    for k, d in enumerate(xs):
        b, a = before.get(k, 0), after.get(k, 0)
        if b == 0 and a == 0:
            tables.append(None)
            out.append(d)
            continue
        if isinstance(d, Mono):
            raise NodeUnsupported(f"padding dynamic axis {k}")
        tab = _index_table(int(d), b, a, mode)
        tables.append(tab)
        out.append(len(tab))
    if dt.kind in "iub" and mode == "constant":
        value = int(value)
    emit_axis_map(ctx, "pad", x, node.output[0], out, xs, tables, dt, value)
