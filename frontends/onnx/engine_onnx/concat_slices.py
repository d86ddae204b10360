"""Channel Concats without copies: producers write straight into their slice of the Concat's buffer.

Why: SqueezeNet, Inception, DenseNet and ShuffleNet concatenate Conv outputs along the channels.
Copied, each Concat reads and writes its whole output once more, for no arithmetic; a Conv can as
well write its planes at their final place (``ops/conv.py``'s ``YPLANE``).

How, within the bundle's rules (every tensor has one producer; ``share_map`` writes in place):
the first producer to take a slice creates the buffer, the Concat's full shape with only its own
channels written; every later one receives the buffer so far as an extra input and writes its
channels over it in place, producing the next version; the Concat itself copies whatever inputs
were not written that way into the last version in place (or, when every input was, is just that
version under its own name). The plan's liveness keeps the storage alive from the first writer to
the Concat's last reader, and no kernel reads the unwritten channels in between: the only reader
of each producer's output is the Concat.

Eligible: a Concat along axis 1 whose inputs all have a channel count known at import (ONNX's
shape inference gives it before they are lowered), the producer's output read by that Concat alone
(once) and by no graph output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import attrs
import numpy as np

if TYPE_CHECKING:
    import onnx

    from engine_onnx.dims import Dim

__all__ = ["ConcatSlice", "ConcatSlices", "ConcatFill", "SliceHost"]


class SliceHost(Protocol):
    """What ``ConcatSlices.take`` asks of the lowering: a part of ``ops.context.LoweringContext``,
    typed here because that context imports this module's types."""

    def sole_value_consumer(self, name: str) -> onnx.NodeProto | None: ...

    def attr(self, node: onnx.NodeProto, name: str, default: Any = None) -> Any: ...

    def static_size(self, name: str, axis: int) -> int | None: ...

    def next_id(self) -> int: ...

    def mark_sliced(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> None: ...


@attrs.frozen
class ConcatSlice:
    """Where one producer writes: channels ``offset .. offset + own`` of ``channels``.

    The producer emits one output named ``name`` of shape ``shape`` (the Concat's); when
    ``buffer`` is not None it also reads that tensor (the buffer so far) and writes over it in place.
    """

    offset: int
    channels: int
    shape: tuple[Dim, ...]
    buffer: str | None
    name: str


@attrs.frozen
class ConcatFill:
    """What the Concat finds: the buffer's latest version and the input positions written into it."""

    buffer: str
    written: frozenset[int]


@attrs.define
class ConcatSlices:
    """The Concat buffers of one lowering, by Concat output name."""

    _fills: dict[str, ConcatFill] = attrs.field(factory=dict)

    def take(self, ctx: SliceHost, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> ConcatSlice | None:
        """A slice for the producer of ``name`` (``dtype``, ``shape``), or None where ``name`` is
        not eligible. Taking it commits: the caller must emit ``slice.name`` next."""
        node = ctx.sole_value_consumer(name)
        if node is None or node.op_type != "Concat" or len(shape) < 2:
            return None
        names = [n for n in node.input if n]
        axis = int(ctx.attr(node, "axis", 1))
        if names.count(name) != 1 or axis % len(shape) != 1:
            return None
        sizes = [ctx.static_size(n, 1) for n in names]
        pos = names.index(name)
        if any(s is None for s in sizes) or sizes[pos] != shape[1]:
            return None
        out = node.output[0]
        previous = self._fills.get(out)
        fresh = f"{out}#slices{ctx.next_id()}"
        self._fills[out] = ConcatFill(fresh, (previous.written if previous else frozenset()) | {pos})
        full = (shape[0], sum(sizes), *shape[2:])  # type: ignore[arg-type]
        ctx.mark_sliced(name, dtype, shape)
        return ConcatSlice(sum(sizes[:pos]), sum(sizes), full, previous.buffer if previous else None,  # type: ignore[arg-type]
                           fresh)

    def fill(self, node: onnx.NodeProto) -> ConcatFill | None:
        """The buffer producers have written for Concat ``node``, if any."""
        return self._fills.get(node.output[0])
