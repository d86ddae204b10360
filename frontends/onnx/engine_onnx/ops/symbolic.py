"""Shape arithmetic on dynamic dimensions, at import.

Values are numpy object arrays whose elements are ``int`` or ``dims.Mono``; numpy's own
``take``/``concatenate``/broadcasting do the indexing, and ``Mono`` does the arithmetic. A result
without any symbol becomes an ordinary int64 constant again.
"""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.dims import DimError, Mono, dims_product
from engine_onnx.ops.context import LoweringContext

__all__ = ["fold", "fold_shape", "SYMBOLIC_OPS"]


def _finish(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr, dtype=object)
    if not any(isinstance(x, Mono) for x in arr.flat):
        return arr.astype(np.int64)
    return arr


def fold_shape(ctx: LoweringContext, node: onnx.NodeProto) -> bool:
    """``Shape``/``Size`` of a tensor whose shape is known (possibly symbolic)."""
    src = node.input[0]
    if src in ctx.poisoned:
        return False
    shape = list(ctx.shape(src))
    if node.op_type == "Size":
        ctx.set_const(node.output[0], _finish(np.array(dims_product(shape), dtype=object)))
        return True
    start = ctx.attr(node, "start", 0)
    end = ctx.attr(node, "end", None)
    shape = shape[start:end] if end is not None else shape[start:]
    ctx.set_const(node.output[0], _finish(np.array(shape, dtype=object).reshape(len(shape))))
    return True


def _axes(ctx: LoweringContext, node: onnx.NodeProto, index: int = 1):
    if len(node.input) > index and node.input[index]:
        v = ctx.const(node.input[index])
        return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    a = ctx.attr(node, "axes", None)
    return None if a is None else list(a)


def fold(ctx: LoweringContext, node: onnx.NodeProto) -> bool:
    """Evaluate a shape-computation node over symbolic values; False if this op is not one."""
    fn = SYMBOLIC_OPS.get(node.op_type)
    if fn is None:
        return False
    vals = [ctx.value(n) if n else None for n in node.input]
    try:
        out = fn(ctx, node, vals)
    except (DimError, TypeError, ValueError, IndexError):
        return False
    if out is None:
        return False
    out = np.asarray(out)
    ctx.set_const(node.output[0], out if out.dtype == bool else _finish(out))
    return True


def _gather(ctx: LoweringContext, node: onnx.NodeProto, v):
    return np.take(v[0], np.asarray(v[1]).astype(np.int64), axis=ctx.attr(node, "axis", 0))


def _unsqueeze(ctx: LoweringContext, node: onnx.NodeProto, v):
    axes = _axes(ctx, node)
    if axes is None:
        return None
    out = v[0]
    rank = out.ndim + len(axes)
    for a in sorted(a % rank for a in axes):
        out = np.expand_dims(out, a)
    return out


def _squeeze(ctx: LoweringContext, node: onnx.NodeProto, v):
    axes = _axes(ctx, node)
    return np.squeeze(v[0]) if axes is None else np.squeeze(v[0], axis=tuple(a % v[0].ndim for a in axes))


def _concat(ctx: LoweringContext, node: onnx.NodeProto, v):
    return np.concatenate([np.asarray(x, dtype=object) for x in v], axis=ctx.attr(node, "axis", 0))


def _slice(ctx: LoweringContext, node: onnx.NodeProto, v):
    data = v[0]
    if ctx.opset < 10:
        starts, ends = ctx.attr(node, "starts"), ctx.attr(node, "ends")
        axes = ctx.attr(node, "axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = [int(x) for x in v[1]], [int(x) for x in v[2]]
        axes = [int(x) for x in v[3]] if len(v) > 3 and v[3] is not None else list(range(len(starts)))
        steps = [int(x) for x in v[4]] if len(v) > 4 and v[4] is not None else [1] * len(starts)
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[a % data.ndim] = slice(s, e, st)
    return data[tuple(index)]


def _cast(ctx: LoweringContext, node: onnx.NodeProto, v):
    to = ctx.attr(node, "to")
    if to not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    return v[0]


def _binary(op):
    def fn(ctx: LoweringContext, node: onnx.NodeProto, v):
        a, b = (np.asarray(x, dtype=object) for x in v[:2])
        return op(a, b)
    return fn


def _reshape(ctx: LoweringContext, node: onnx.NodeProto, v):
    shape = [int(x) for x in v[1]]
    return v[0].reshape([x if x != 0 else v[0].shape[i] for i, x in enumerate(shape)])


def _where(ctx: LoweringContext, node: onnx.NodeProto, v):
    return np.where(np.asarray(v[0], dtype=bool), v[1], v[2])


def _equal(ctx: LoweringContext, node: onnx.NodeProto, v):
    a, b = (np.asarray(x, dtype=object) for x in v[:2])
    return np.vectorize(lambda x, y: x == y, otypes=[object])(a, b).astype(bool)


def _max(ctx: LoweringContext, node: onnx.NodeProto, v):
    out = np.asarray(v[0], dtype=object)
    for x in v[1:]:
        x = np.asarray(x, dtype=object)
        out = np.vectorize(lambda p, q: p if q == 1 else q if p == 1 else p if p == q else None,
                           otypes=[object])(out, x)
    if any(e is None for e in out.flat):
        return None
    return out


SYMBOLIC_OPS = {
    "Gather": _gather, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Concat": _concat, "Slice": _slice,
    "Cast": _cast, "Identity": lambda ctx, node, v: v[0], "Mul": _binary(lambda a, b: a * b),
    "Add": _binary(lambda a, b: a + b), "Sub": _binary(lambda a, b: a - b),
    "Div": _binary(lambda a, b: a // b), "Reshape": _reshape, "Where": _where, "Equal": _equal,
    "Max": _max,
}
