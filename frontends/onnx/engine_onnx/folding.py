"""Constant folding: nodes whose outputs are known at import never become kernels.

Numeric constants are evaluated by ONNX's own reference evaluator (``onnx.reference``), so folded
values follow the specification exactly, for every op it implements. Shape computations that
involve dynamic dimensions (``Shape`` → ``Gather`` → ``Concat`` → ``Reshape``, as torch exports
them) are evaluated on symbolic dimensions by ``ops.symbolic``.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from engine_onnx.ops import symbolic

__all__ = ["try_fold", "evaluate"]

#: Ops whose value must not be computed once at import (random generators).
NEVER_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})


def evaluate(node: onnx.NodeProto, opset: int, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``node``'s outputs on ``feeds`` by the reference evaluator at the model's opset."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = ReferenceEvaluator(node, opsets={"": opset})
        return ev.run(None, feeds)


def try_fold(ctx, node: onnx.NodeProto) -> bool:
    """Fold ``node`` into constants if its outputs are known now; True when it was folded."""
    if node.domain not in ("", "ai.onnx") or node.op_type in NEVER_FOLD:
        return False
    if node.op_type in ("Shape", "Size"):
        return symbolic.fold_shape(ctx, node)
    names = [n for n in node.input if n]
    if not all(n in ctx.consts for n in names):
        return False
    values = {n: ctx.consts[n] for n in names}
    if any(v.dtype == object for v in values.values()):
        return symbolic.fold(ctx, node)
    try:
        outs = evaluate(node, ctx.opset, values)
    except Exception:  # noqa: BLE001 - an op the reference cannot evaluate is lowered to a kernel instead
        return False
    for name, value in zip(node.output, outs):
        if name:
            ctx.set_const(name, np.asarray(value))
    return True
