"""The window geometry shared by Conv and the pools: strides, dilations, padding and output size.

Conv, MaxPool and AveragePool read the same attributes (``strides``, ``dilations``, ``pads``,
``auto_pad``) by the same ONNX rules; one function keeps the two op families from disagreeing,
and keeps pool.py from importing the Conv handlers for it. ``ConvGeometry`` is one 2-D
convolution's shape as the GPU kernel generator takes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import onnx

from engine_onnx.dims import Dim
from engine_onnx.errors import NodeUnsupported

if TYPE_CHECKING:
    from engine_onnx.ops.context import LoweringContext

__all__ = ["conv_geometry", "ConvGeometry"]


def conv_geometry(ctx: LoweringContext, node: onnx.NodeProto, spatial: Sequence[int], kernel: Sequence[int], *,
                  ceil_mode: bool = False) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads_begin, pads_end, out_spatial) following ONNX's auto_pad rules."""
    r = len(spatial)
    strides = list(ctx.attr(node, "strides", [1] * r))
    dil = list(ctx.attr(node, "dilations", [1] * r))
    pads = list(ctx.attr(node, "pads", [0] * (2 * r)))
    auto = ctx.attr(node, "auto_pad", "NOTSET")
    begin, end = pads[:r], pads[r:]
    out = []
    for i in range(r):
        eff = (kernel[i] - 1) * dil[i] + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[i] // strides[i])
            total = max(0, (o - 1) * strides[i] + eff - spatial[i])
            small = total // 2
            begin[i], end[i] = (small, total - small) if auto == "SAME_UPPER" else (total - small, small)
        elif auto == "VALID":
            begin[i] = end[i] = 0
        elif auto != "NOTSET":
            raise NodeUnsupported(f"auto_pad={auto!r}")
        span = spatial[i] + begin[i] + end[i] - eff
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= spatial[i] + begin[i]:
            o -= 1
        out.append(o)
    return strides, dil, begin, end, out


@attrs.frozen
class ConvGeometry:
    """One 2-D convolution (a 1-D one as height 1) of ``batch`` images: channels in and out, the
    groups, and per spatial axis the input size, kernel, stride, dilation, leading padding and
    output size (``conv_geometry``'s values)."""

    batch: Dim
    channels: int
    out_channels: int
    groups: int
    spatial: Sequence[int]
    kernel: Sequence[int]
    strides: Sequence[int]
    dilations: Sequence[int]
    pads_begin: Sequence[int]
    out: Sequence[int]
