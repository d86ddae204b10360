"""Node arguments that ONNX moved from an attribute to an input between opsets.

Squeeze, Unsqueeze and the reductions take ``axes`` as an attribute in older opsets and as an
optional constant input in newer ones; the handlers read both forms through one function so
every op family accepts the same models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

if TYPE_CHECKING:
    from engine_onnx.ops.context import LoweringContext

__all__ = ["axes_of"]


def axes_of(ctx: LoweringContext, node: onnx.NodeProto, index: int = 1, attr: str = "axes") -> list[int] | None:
    """Axes from the ``index``-th input (newer opsets) or the attribute (older ones)."""
    if len(node.input) > index and node.input[index]:
        return [int(a) for a in ctx.require_const(node.input[index], attr).reshape(-1)]
    v = ctx.attr(node, attr, None)
    return None if v is None else [int(a) for a in v]
