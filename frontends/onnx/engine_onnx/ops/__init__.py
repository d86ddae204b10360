"""The op handlers, one module per op family; importing this package registers them all.

A handler ``(ctx: LoweringContext, node) -> None`` (``ops.context``) reads its inputs through the
lowering context, raises ``NodeUnsupported`` with the reason for an attribute, dtype or shape it
does not handle, and emits kernel calls (``ctx.emit``), views (``ctx.alias``) or constants
(``ctx.set_const``). Handlers register with ``ops.registry.register``; the registry is a module of
its own so that no op module imports this package (which imports every op module).

On GPU-like kinds (``engine_onnx.gpu``; ``ctx.gpu`` is true there) a handler emits a
``GpuKernelSpec`` instead; ``ctx.emit`` refuses a CPU kernel there, naming the node, so no CPU
kernel reaches a GPU bundle.
"""

from __future__ import annotations

from engine_onnx.ops import (axis_map, conv, conv_transpose, elementwise, indexing, linalg, norm, pad,  # noqa: F401
                             pool, reduce, resize, shape)
from engine_onnx.ops.registry import OPS, handler_for, register, supported_ops

__all__ = ["register", "handler_for", "supported_ops", "OPS"]
