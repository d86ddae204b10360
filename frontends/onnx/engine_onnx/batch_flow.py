"""Whether a value's leading axis is the batch, row for row: what a symbolic batch may rewrite.

A model exported at batch 1 bakes that 1 into constant shapes (``Reshape(x, [1, 2048])``). Making
the batch a symbol is only sound where the importer can show that row ``i`` of a value depends on
sample ``i`` alone (the value is *sample-major*): then replacing the baked 1 by the batch gives, row
for row, what running each sample alone gives. This module proves that property by a forward walk
over the nodes already lowered, with rules that are conservative by construction:

* a graph input is sample-major when its leading axis is exactly the batch symbol;
* a node's output is sample-major when its op is one whose rows are computed independently (an
  allow-list: an op not listed proves nothing), every input computed at run time is sample-major,
  the op does not work along axis 0 (Softmax, TopK, LayerNormalization or a Gather of run-time data
  there mix rows while keeping the shape), and the output's leading axis is exactly the symbol,
  which appears on no other axis. The shape condition is what catches every op that moves, sums or
  contracts the batch axis (Transpose, Concat or a reduction along it, a MatMul over it): the symbol
  then leaves axis 0 or shows up elsewhere.

Outputs whose shape is not recorded (an activation fused into its producer) are judged by the op
rules alone: fusion only joins ops whose shapes equal a neighbour's that is checked.

The walk also gives the final check of a symbolic batch (``refused_outputs``): with
``batch_symbol`` given, a graph output declared with the batch on axis 0 must carry the symbol there.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import onnx

from engine_onnx.dims import Dim, Mono, dim_expr, symbols_of
from engine_onnx.errors import UnsupportedNode

__all__ = ["BatchFlow", "LoweredGraph", "refused_outputs", "shape_text"]


class _Shaped(Protocol):
    @property
    def shape(self) -> tuple[Dim, ...]: ...


class LoweredGraph(Protocol):
    """What the batch flow reads of a lowering (``engine_onnx.lowering.Lowering``). Typed here, not
    by importing the lowering: the lowering imports the ops, and the ops' context imports this
    module's types."""

    @property
    def graph(self) -> onnx.GraphProto: ...

    @property
    def opset(self) -> int: ...

    @property
    def inputs(self) -> Sequence[tuple[str, np.dtype, tuple[Dim, ...]]]: ...

    @property
    def consts(self) -> Mapping[str, np.ndarray]: ...

    @property
    def tensors(self) -> Mapping[str, _Shaped]: ...

    @property
    def poisoned(self) -> set[str]: ...

    def attr(self, node: onnx.NodeProto, name: str, default: Any = None) -> Any: ...

    def shape(self, name: str) -> tuple[Dim, ...]: ...

_ELEMENTWISE = frozenset({
    "Relu", "Neg", "Abs", "Clip", "Sign", "Not", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Erf", "Reciprocal",
    "Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Softplus", "Softsign",
    "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Gelu", "Add", "Sub", "Mul", "Div", "Equal", "Less",
    "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Pow", "Mod", "PRelu", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor", "Sum", "Max", "Min", "Mean", "Where", "Cast", "CastLike"})

#: Ops whose output rows depend only on the same rows of their run-time inputs, given the shape
#: condition of the module docstring.
_ROW_WISE = _ELEMENTWISE | frozenset({
    "Conv", "ConvTranspose", "BatchNormalization", "InstanceNormalization", "LRN", "MaxPool", "AveragePool",
    "GlobalAveragePool", "GlobalMaxPool", "MatMul", "Gemm", "Pad", "Resize", "Upsample", "Identity", "Dropout",
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Expand", "Concat", "Split", "Tile",
    "ConstantOfShape", "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceProd",
    "ReduceMax", "ReduceMin", "ArgMax", "ArgMin"})

#: Ops that work along their ``axis`` attribute (default given) keeping its size: row-wise only
#: when that axis is not 0.
_ALONG_AXIS = {"Softmax": (1, -1), "LogSoftmax": (1, -1), "LayerNormalization": (-1, -1), "TopK": (-1, -1),
               "ArgMax": (0, 0), "ArgMin": (0, 0)}


def shape_text(shape) -> str:
    return "[" + ", ".join(str(dim_expr(d)) for d in shape) + "]"


def _batch_symbol(lowering: LoweredGraph, batch_symbol: str | None) -> str | None:
    """The symbol sample-major values lead with: ``batch_symbol``, else the one single-symbol
    leading axis every graph input with a symbolic leading axis shares (None when they differ)."""
    if batch_symbol:
        return batch_symbol
    leads = {shape[0].syms[0] for _, _, shape in lowering.inputs
             if shape and isinstance(shape[0], Mono) and shape[0].coef == 1 and len(shape[0].syms) == 1}
    return leads.pop() if len(leads) == 1 else None


class BatchFlow:
    """The sample-major values of one lowering, computed on demand in node order."""

    def __init__(self, lowering: LoweredGraph, batch_symbol: str | None):
        self._ctx = lowering
        self.symbol = _batch_symbol(lowering, batch_symbol)
        #: Whether the user asked for the batch symbol (then outputs are checked: ``refused_outputs``).
        self.asked = bool(batch_symbol)
        self._sample: set[str] = set()
        self._next = 0
        for name, _, shape in lowering.inputs:
            if self.leads(shape):
                self._sample.add(name)

    def leads(self, shape) -> bool:
        """``shape``'s leading axis is exactly the batch symbol, and no other axis holds it."""
        if self.symbol is None or not shape or shape[0] != Mono(1, (self.symbol,)):
            return False
        return self.symbol not in symbols_of(shape[1:])

    def is_sample_major(self, name: str) -> bool:
        """Whether row ``i`` of lowered value ``name`` is proved to depend on sample ``i`` alone."""
        if self.symbol is None:
            return False
        nodes = self._ctx.graph.node
        while name not in self._sample and self._next < len(nodes):
            node = nodes[self._next]
            self._next += 1
            if self._row_wise(node):
                self._sample.update(o for o in node.output if o and self._output_leads(o))
            if name in node.output:
                break
        return name in self._sample

    def _output_leads(self, name: str) -> bool:
        ctx = self._ctx
        if name in ctx.consts:
            return False
        op = ctx.tensors.get(name)
        return op is None or self.leads(op.shape)

    def _row_wise(self, node: onnx.NodeProto) -> bool:
        ctx = self._ctx
        if node.domain not in ("", "ai.onnx") or node.op_type not in _ROW_WISE | set(_ALONG_AXIS) | {"Gather"}:
            return False
        if node.op_type == "Gather" and node.input[0] not in ctx.consts:
            return False  # a row of run-time data picked by index: rows move (an embedding table is constant)
        runtime = [n for n in node.input if n and n not in ctx.consts]
        if node.op_type == "CastLike":
            runtime = runtime[:1]  # the second input gives only the type
        if not runtime and node.op_type != "ConstantOfShape":
            return False
        if any(n not in self._sample for n in runtime):
            return False
        if node.op_type in _ALONG_AXIS:
            old, new = _ALONG_AXIS[node.op_type]
            axis = int(ctx.attr(node, "axis", new if ctx.opset >= 13 else old))
            rank = len(ctx.shape(node.input[0]))
            if axis % max(rank, 1) == 0:
                return False
        return True


def refused_outputs(lowering: LoweredGraph, flow: BatchFlow) -> list[UnsupportedNode]:
    """With a batch symbol asked for, the graph outputs declared with the batch on axis 0 (the
    declared leading size of the graph's inputs) that do not carry the symbol there: rows of such an
    output would not be the samples'."""
    if flow.symbol is None or not flow.asked:
        return []
    declared_leads = set()
    for vi in lowering.graph.input:
        if vi.name not in lowering.consts and vi.type.tensor_type.shape.dim:
            declared_leads.add(_declared(vi.type.tensor_type.shape.dim[0]))
    refused = []
    for vi in lowering.graph.output:
        dims = vi.type.tensor_type.shape.dim
        lead = _declared(dims[0]) if dims else None
        if lead is None or lead not in declared_leads or vi.name in lowering.poisoned:
            continue
        shape: tuple[Dim, ...] = lowering.shape(vi.name)
        if not flow.leads(shape):
            refused.append(UnsupportedNode(vi.name, "output", f"declared with the batch on axis 0, but its shape is "
                                           f"{shape_text(shape)}: its rows would not be the samples' (a constant "
                                           f"shape baked in the batch the model was exported at)"))
    return refused


def _declared(dim: onnx.TensorShapeProto.Dimension) -> object:
    if dim.HasField("dim_value"):
        return dim.dim_value
    return dim.dim_param if dim.HasField("dim_param") else None
