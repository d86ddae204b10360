"""The op registry: ONNX op type → handler ``(ctx: Lowering, node) -> None``.

One module per op family registers its handlers with ``@register``; importing this package
imports them all. A handler reads its inputs through the lowering context, raises
``NodeUnsupported`` with the reason for an attribute, dtype or shape it does not handle, and
emits kernel calls (``ctx.emit``), views (``ctx.alias``) or constants (``ctx.set_const``).

On GPU-like kinds (``engine_onnx.gpu``; ``ctx.gpu`` is true there) a handler emits a
``GpuKernelSpec`` instead; ``ctx.emit`` refuses a CPU kernel there, naming the node, so no CPU
kernel reaches a GPU bundle.
"""

from __future__ import annotations

from typing import Callable

import onnx

from engine_onnx.errors import NodeUnsupported

__all__ = ["register", "handler_for", "supported_ops", "OPS"]

Handler = Callable[..., None]
OPS: dict[str, Handler] = {}


def register(*op_types: str) -> Callable[[Handler], Handler]:
    def wrap(fn: Handler) -> Handler:
        for op in op_types:
            OPS[op] = fn
        return fn
    return wrap


def handler_for(node: onnx.NodeProto) -> Handler:
    if node.domain not in ("", "ai.onnx"):
        raise NodeUnsupported(f"operator domain {node.domain!r} is not supported (only the default ONNX domain)")
    try:
        return OPS[node.op_type]
    except KeyError:
        raise NodeUnsupported("op type not supported by the importer") from None


def supported_ops() -> list[str]:
    return sorted(OPS)


from engine_onnx.ops import (elementwise, linalg, conv, conv_transpose, pool, norm, reduce, shape, axis_map, pad,
                             indexing, resize)  # noqa: E402,F401
