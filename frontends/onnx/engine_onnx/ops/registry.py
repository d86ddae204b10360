"""The op registry: ONNX op type to the one handler that lowers it.

A module of its own so that op modules can register their handlers without importing the package
that imports them all (``engine_onnx.ops``), which would make every op module part of one import
circle. Registration refuses a second handler for an op type: two modules claiming one op would
otherwise leave whichever was imported last in charge, silently.
"""

from __future__ import annotations

from typing import Callable

import onnx

from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import Handler

__all__ = ["register", "handler_for", "supported_ops", "OPS", "DuplicateHandlerError"]

OPS: dict[str, Handler] = {}


class DuplicateHandlerError(ValueError):
    """A second handler registered for an op type that has one (a programming error in the importer)."""


def register(*op_types: str) -> Callable[[Handler], Handler]:
    """Decorator: ``fn`` lowers each of ``op_types``; raises ``DuplicateHandlerError`` for an op
    type another handler already lowers (naming both)."""
    def wrap(fn: Handler) -> Handler:
        for op in op_types:  # every op checked first, so a refusal registers none of them
            other = OPS.get(op)
            if other is not None and other is not fn:
                raise DuplicateHandlerError(f"op type {op!r} already has a handler, {_name(other)}; "
                                            f"{_name(fn)} cannot register it too")
        for op in op_types:
            OPS[op] = fn
        return fn
    return wrap


def _name(fn: Handler) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def handler_for(node: onnx.NodeProto) -> Handler:
    """The handler of ``node``'s op type; ``NodeUnsupported`` for another domain or an unknown op."""
    if node.domain not in ("", "ai.onnx"):
        raise NodeUnsupported(f"operator domain {node.domain!r} is not supported (only the default ONNX domain)")
    try:
        return OPS[node.op_type]
    except KeyError:
        raise NodeUnsupported("op type not supported by the importer") from None


def supported_ops() -> list[str]:
    """Every op type some handler lowers, sorted."""
    return sorted(OPS)
