"""Lowering an ONNX graph into a ``GraphBuilder``: the context op handlers work against.

The graph is walked once in ONNX's (topological) node order. Each node is, in this order:

1. **folded** when its value is known at import: every input is a constant (ONNX's reference
   evaluator computes it), or it is a shape computation on known dimensions (``Shape``,
   ``Gather``, ``Concat``… over symbolic dimensions, ``ops.symbolic``);
2. skipped when it was **fused** as the epilogue of its producer (an activation after a Conv);
3. else **lowered** by its op handler into kernel calls (or into a view: a ``Reshape`` of a
   contiguous tensor is the same bytes with another logical shape, so no kernel runs).

A handler may also **defer** its value (``defer``): an elementwise node whose one consumer is
elementwise too leaves its kernel unwritten, and the consumer computes it inline in its own kernel
(``take_pending``), which is how elementwise chains become one kernel. Anything else that reads a
deferred value's elements (``emit``, ``alias``) first emits the kernel that computes it, so no
handler has to know about deferral.

Calls are recorded first and handed to the builder at the end, because the bundle needs every
weight declared before the first call and a handler may create weights (a transposed Gemm
weight, a BatchNormalization folded into a Conv). A node that cannot be lowered is recorded
with its reason and its outputs are marked *poisoned* so that the walk goes on and reports every
unsupported node in one ``UnsupportedModelError``; no bundle is built from a poisoned graph.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from engine.build import GraphBuilder
from engine_onnx.batch_flow import BatchFlow, refused_outputs, shape_text
from engine_onnx.codegen import KernelSpec, cpu_options
from engine_onnx.concat_slices import ConcatFill, ConcatSlice, ConcatSlices
from engine_onnx.dims import Dim, DimError, Mono, dim_expr, dims_product
from engine_onnx.dtypes import ONNX_DTYPES, onnx_dtype
from engine_onnx.errors import (ModelLoadError, NodeUnsupported, PinSymbol, SymbolPin, SymbolPinnedWarning,
                                UnsupportedModelError, UnsupportedNode)
from engine_onnx.folding import try_fold
from engine_onnx.gpu import GPU_KINDS, GpuKernelSpec, render
from engine_onnx.model import older_definition
from engine_onnx.ops import handler_for
from engine_onnx.ops.elementwise import unary_expression
from engine_onnx.ops.shape import emit_constant, emit_copy

__all__ = ["Lowering", "Operand", "Ref", "Deferred", "sanitize_symbol", "lower"]


@attrs.frozen
class Ref:
    """A physical tensor of the plan: a graph input, a weight, or output ``pos`` of call ``index``."""

    kind: str
    index: int
    pos: int
    dtype: np.dtype
    shape: tuple[Dim, ...]


@attrs.frozen
class Operand:
    """An ONNX value computed at run time: a physical tensor seen with a logical shape."""

    ref: Ref
    dtype: np.dtype
    shape: tuple[Dim, ...]


@attrs.frozen
class Deferred:
    """A value whose kernel is not emitted yet: what its consumer needs to compute it inline
    (``payload``, owned by the op module that deferred it) and how to emit it after all."""

    payload: Any
    materialize: Callable[[], None]


#: Ops that read only their input's shape, never its elements: they do not keep a value from
#: being computed inside its consumer's kernel.
SHAPE_READERS = frozenset({"Shape", "Size"})


def sanitize_symbol(name: str) -> str:
    """An ONNX ``dim_param`` as a bundle symbol name (``[A-Za-z_]\\w*``, not a function name)."""
    s = re.sub(r"\W", "_", name) or "dim"
    if s[0].isdigit():
        s = "d_" + s
    return s + "_" if s in ("ceil_div", "min", "max") else s


class Lowering:
    """Walks one model's graph; ``run()`` then ``builder()`` gives the bundle's ``GraphBuilder``."""

    def __init__(self, model: onnx.ModelProto, *, batch_symbol: str | None = None, name: str = "model",
                 device: str = "cpu", io_device: str | None = None, pins: Sequence[SymbolPin] = ()):
        if device != "cpu" and device not in GPU_KINDS:
            raise ValueError(f"engine-onnx generates kernels for device kinds cpu, {', '.join(GPU_KINDS)}; "
                             f"not {device!r}")
        #: The device kind every kernel, weight and intermediate lives on; ``io_device`` holds the
        #: graph's inputs and outputs (copied to and from ``device`` around the model) when it differs.
        self.device = device
        self.io_device = io_device or device
        self.model = model
        self.graph = model.graph
        self.name = name
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.inputs: list[tuple[str, np.dtype, tuple[Dim, ...]]] = []
        self.weights: list[tuple[str, np.ndarray]] = []
        self.calls: list[tuple[KernelSpec | GpuKernelSpec, list[Ref], list[tuple[np.dtype, tuple[Dim, ...]]],
                               dict[int, int]]] = []
        self.consts: dict[str, np.ndarray] = {}
        self.tensors: dict[str, Operand] = {}
        self.unsupported: list[UnsupportedNode] = []
        #: Declared dimensions taken as constants (``lower``), and those this walk found (``PinSymbol``).
        self.pins = tuple(pins)
        self.new_pins: list[SymbolPin] = []
        self.poisoned: set[str] = set()
        self._weight_refs: dict[str, Ref] = {}
        self._fused: set[int] = set()
        self._pending: dict[str, Deferred] = {}
        self._consumers: dict[str, list[onnx.NodeProto]] = {}
        self._counter = 0
        self._concat_slices = ConcatSlices()
        self.outputs = [o.name for o in self.graph.output]
        self._declared = {vi.name: vi for vi in [*self.graph.value_info, *self.graph.output, *self.graph.input]}
        for node in self.graph.node:
            for name in node.input:
                if name:
                    self._consumers.setdefault(name, []).append(node)
        for init in self.graph.initializer:
            self.consts[init.name] = _initializer_array(init)
        self._declare_inputs(batch_symbol)
        self.batch_flow = BatchFlow(self, sanitize_symbol(batch_symbol) if batch_symbol else None)

    # -- declarations ----------------------------------------------------------------------------
    def _declare_inputs(self, batch_symbol: str | None) -> None:
        pinned: dict[str, Dim] = {p.symbol: p.value for p in self.pins}
        for vi in self.graph.input:
            if vi.name in self.consts:
                continue  # opsets before 9 list initializers among the inputs
            tt = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                self.unsupported.append(UnsupportedNode(vi.name, "graph input", "not a tensor (sequences, maps "
                                                        "and optionals are not supported)"))
                self.poisoned.add(vi.name)
                continue
            try:
                dtype = onnx_dtype(tt.elem_type)
            except NodeUnsupported as exc:
                self.unsupported.append(UnsupportedNode(vi.name, "graph input", str(exc)))
                self.poisoned.add(vi.name)
                continue
            shape: list[Dim] = []
            for axis, d in enumerate(tt.shape.dim):
                if axis == 0 and batch_symbol:
                    shape.append(Mono(1, (sanitize_symbol(batch_symbol),)))
                elif d.HasField("dim_value"):
                    shape.append(int(d.dim_value))
                elif d.HasField("dim_param"):
                    sym = sanitize_symbol(d.dim_param)
                    shape.append(pinned.get(sym, Mono(1, (sym,))))
                else:
                    raise ModelLoadError(f"{self.name}: input {vi.name!r} dimension {axis} has neither a size nor a "
                                         f"name; expected a dim_value or dim_param (or pass batch_symbol)")
            shape_t = tuple(shape)
            self.inputs.append((vi.name, dtype, shape_t))
            ref = Ref("input", len(self.inputs) - 1, 0, dtype, shape_t)
            self.tensors[vi.name] = Operand(ref, dtype, shape_t)

    # -- what handlers read ------------------------------------------------------------------------
    @property
    def gpu(self) -> bool:
        """Whether kernels are generated for a GPU-like kind (``engine_onnx.gpu``), not the CPU."""
        return self.device != "cpu"

    def attr(self, node: onnx.NodeProto, name: str, default: Any = None) -> Any:
        for a in node.attribute:
            if a.name == name:
                value = helper.get_attribute_value(a)
                if isinstance(value, bytes):
                    return value.decode("utf-8")
                if isinstance(value, onnx.TensorProto):
                    return numpy_helper.to_array(value)
                return value
        return default

    def is_const(self, name: str) -> bool:
        return name in self.consts and self.consts[name].dtype != object

    def const(self, name: str) -> np.ndarray | None:
        """The value known at import (numeric), else None."""
        v = self.consts.get(name)
        return v if v is not None and v.dtype != object else None

    def require_const(self, name: str, what: str) -> np.ndarray:
        v = self.const(name)
        if v is None:
            raise NodeUnsupported(f"{what} must be known at import (a constant), got a tensor computed at run time")
        return v

    def value(self, name: str) -> np.ndarray | None:
        """The value known at import, possibly symbolic (an object array of dimensions)."""
        return self.consts.get(name)

    def shape(self, name: str) -> tuple[Dim, ...]:
        if name in self.consts:
            return tuple(int(d) for d in self.consts[name].shape)
        return self.tensors[name].shape

    def static_size(self, name: str, axis: int) -> int | None:
        """``name``'s size along ``axis`` where it is a number known now: from the value when it is
        lowered already, else from ONNX's shape inference; None otherwise."""
        if name in self.consts or name in self.tensors:
            shape = self.shape(name)
            return shape[axis] if axis < len(shape) and isinstance(shape[axis], int) else None
        vi = self._declared.get(name)
        if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            return None
        dims = vi.type.tensor_type.shape.dim
        return int(dims[axis].dim_value) if axis < len(dims) and dims[axis].HasField("dim_value") else None

    def dtype(self, name: str) -> np.dtype:
        if name in self.consts:
            v = self.consts[name]
            return np.dtype("int64") if v.dtype == object else v.dtype
        return self.tensors[name].dtype

    # -- what handlers produce ---------------------------------------------------------------------
    def set_const(self, name: str, value: np.ndarray) -> None:
        self.consts[name] = value

    def add_weight(self, array: np.ndarray, hint: str) -> str:
        """A new constant (e.g. a transposed or folded weight) under a fresh name."""
        self._counter += 1
        name = f"{hint}#{self._counter}"
        self.consts[name] = np.require(array, requirements="C")
        return name

    def alias(self, out: str, src: str, shape: Sequence[Dim]) -> None:
        """``out`` is ``src``'s bytes with another shape (Reshape, Flatten, Squeeze, Identity…). The
        element counts must agree exactly (as monomials): a view of fewer elements would silently
        drop the rest (a batch-1 shape applied to a symbolic batch)."""
        old, new = dims_product(self.shape(src)), dims_product(shape)
        if old != new:
            raise NodeUnsupported(f"a view of {shape_text(self.shape(src))} ({dim_expr(old)} elements) as "
                                  f"{shape_text(shape)} ({dim_expr(new)} elements) changes the element count")
        if src in self.consts:
            self.consts[out] = self.consts[src].reshape([int(d) for d in shape])
            return
        if src in self._pending:
            self._materialize(src)
        op = self.tensors[src]
        self.tensors[out] = Operand(op.ref, op.dtype, tuple(shape))

    def _ref(self, name: str) -> Ref:
        if name in self._pending:
            self._materialize(name)
        if name in self.tensors:
            if self.tensors[name].ref.kind == "slice":
                raise AssertionError(f"{name!r} was written into a Concat's buffer; only that Concat reads it")
            return self.tensors[name].ref
        if name not in self.consts:
            raise NodeUnsupported(f"input {name!r} is not produced by any node")
        if name not in self._weight_refs:
            arr = self.consts[name]
            if arr.dtype == object:
                raise NodeUnsupported(f"{name!r} holds dynamic dimensions as data, which kernels cannot read")
            arr = np.require(arr, requirements="C")
            self.weights.append((name, arr))
            self._weight_refs[name] = Ref("weight", len(self.weights) - 1, 0, arr.dtype,
                                          tuple(int(d) for d in arr.shape))
        return self._weight_refs[name]

    def emit(self, spec: KernelSpec | GpuKernelSpec, inputs: Iterable[str],
             outputs: Sequence[tuple[str, Any, Sequence[Dim]]],
             *, in_place: Mapping[int, int] | None = None) -> None:
        """Record one kernel call reading ``inputs`` (names) and producing ``outputs`` (name, dtype, shape);
        ``in_place`` maps an output position to the input position it is written over (the bundle's
        ``share_map``)."""
        if self.gpu != isinstance(spec, GpuKernelSpec):
            raise NodeUnsupported(f"no {self.device} kernel for this operator yet ({spec.name})")
        refs = [self._ref(n) for n in inputs]
        idx = len(self.calls)
        outs = [(np.dtype(dt), tuple(shape)) for _, dt, shape in outputs]
        self.calls.append((spec, refs, outs, dict(in_place or {})))
        for pos, ((name, _, _), (dt, shape)) in enumerate(zip(outputs, outs)):
            self.tensors[name] = Operand(Ref("call", idx, pos, dt, shape), dt, shape)

    def take_concat_slice(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> ConcatSlice | None:
        """Where the producer of ``name`` writes when a channel Concat is its only reader
        (``concat_slices``); None when it writes a tensor of its own. The caller must emit next."""
        if self.gpu:
            return None
        return self._concat_slices.take(self, name, dtype, shape)

    def concat_fill(self, node: onnx.NodeProto) -> ConcatFill | None:
        """The buffer producers have written for Concat ``node``, if any."""
        return self._concat_slices.fill(node)

    def mark_sliced(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> None:
        """``name`` is written into its Concat's buffer (``concat_slices``): its shape stays known,
        but no kernel may read it as a tensor of its own."""
        shape_t = tuple(shape)
        self.tensors[name] = Operand(Ref("slice", self.next_id(), 0, np.dtype(dtype), shape_t), np.dtype(dtype), shape_t)

    def sole_consumer(self, name: str) -> onnx.NodeProto | None:
        """The one node reading ``name`` when nothing else (and no graph output) does, else None."""
        users = self._consumers.get(name, [])
        if name in self.outputs or len(users) != 1:
            return None
        return users[0]

    def sole_value_consumer(self, name: str) -> onnx.NodeProto | None:
        """The one node reading ``name``'s elements (``Shape``/``Size`` read only its shape) when no
        other node reads it and it is not a graph output, else None."""
        if name in self.outputs:
            return None
        users = [u for u in self._consumers.get(name, []) if u.op_type not in SHAPE_READERS]
        return users[0] if len(users) == 1 else None

    def defer(self, name: str, dtype: np.dtype, shape: Sequence[Dim], payload: Any,
              materialize: Callable[[], None]) -> None:
        """``name`` (``dtype``, ``shape``) is computed later: inline by its consumer, which takes
        ``payload`` with ``take_pending``, or by ``materialize()`` (which must ``emit`` ``name``) as soon
        as anything else reads it."""
        shape_t = tuple(shape)
        self._pending[name] = Deferred(payload, materialize)
        self.tensors[name] = Operand(Ref("pending", self.next_id(), 0, np.dtype(dtype), shape_t),
                                     np.dtype(dtype), shape_t)

    def pending(self, name: str) -> Any | None:
        """The payload of a deferred value, else None."""
        d = self._pending.get(name)
        return None if d is None else d.payload

    def take_pending(self, name: str) -> Any:
        """The caller computes deferred ``name`` inside its own kernel: no kernel will produce it."""
        return self._pending.pop(name).payload

    def _materialize(self, name: str) -> None:
        deferred = self._pending.pop(name)
        deferred.materialize()
        if self.tensors[name].ref.kind != "call":
            raise AssertionError(f"deferred value {name!r} was not emitted by its materialize()")

    def is_used(self, name: str) -> bool:
        """Whether any node or graph output reads ``name``."""
        return bool(name) and (name in self.outputs or bool(self._consumers.get(name)))

    def mark_fused(self, node: onnx.NodeProto) -> None:
        """``node`` was folded into another node's kernel: the walk skips it."""
        self._fused.add(id(node))

    def take_epilogue(self, node: onnx.NodeProto, dtype: np.dtype,
                      start: str | None = None) -> tuple[Callable[[str], str], str]:
        """Unary activations that only consume ``node``'s first output (or ``start``), fused into its
        kernel. Returns the composed C expression builder and the ONNX name the fused kernel produces.
        """
        current = start or node.output[0]
        chain: list[Callable[[str], str]] = []
        while current not in self.outputs:
            users = self._consumers.get(current, [])
            if len(users) != 1 or users[0].input[0] != current or len(users[0].output) != 1:
                break
            user = users[0]
            try:
                fn = unary_expression(self, user, dtype)
            except NodeUnsupported:
                break
            if fn is None:
                break
            chain.append(fn)
            self._fused.add(id(user))
            current = user.output[0]

        def apply(x: str) -> str:
            for fn in chain:
                x = fn(x)
            return x
        return apply, current

    def take_residual_add(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> tuple[str, str] | None:
        """A same-shape ``Add`` (or two-input ``Sum``) that is ``name``'s only consumer, fused into
        the kernel producing ``name`` (ResNet's ``Conv → BN → Add → Relu``): returns (the other
        operand, the Add's output), or None. The other operand must already be computed (or be a
        constant) with exactly ``shape`` and ``dtype``, so the kernel reads it without broadcasting."""
        add = self.sole_consumer(name)
        if add is None or add.op_type not in ("Add", "Sum") or len(add.input) != 2:
            return None
        if add.input[0] == add.input[1]:
            return None
        other = add.input[1] if add.input[0] == name else add.input[0]
        if other in self.poisoned or (other not in self.tensors and self.const(other) is None):
            return None
        if tuple(self.shape(other)) != tuple(shape) or self.dtype(other) != dtype:
            return None
        self._fused.add(id(add))
        return other, add.output[0]

    def take_bias_add(self, name: str, n: Dim, rank: int) -> tuple[np.ndarray, str] | None:
        """A constant float32 ``Add`` along the last axis (``[n]``, or ``[1, …, 1, n]`` of at most
        ``rank`` axes) that is ``name``'s only consumer, fused into the kernel producing ``name`` (a
        MatMul's bias, as torch exports ``Linear``): returns (the bias as ``[n]``, the Add's
        output), or None."""
        add = self.sole_consumer(name)
        if add is None or add.op_type != "Add" or len(add.input) != 2 or add.input[0] == add.input[1]:
            return None
        other = add.input[1] if add.input[0] == name else add.input[0]
        bias = self.const(other)
        if bias is None or bias.dtype != np.float32 or not isinstance(n, int) or bias.ndim > rank or bias.ndim == 0:
            return None
        if bias.shape[-1] != n or bias.size != n:
            return None
        self._fused.add(id(add))
        return bias.reshape(n), add.output[0]

    def next_id(self) -> int:
        self._counter += 1
        return self._counter

    # -- the walk --------------------------------------------------------------------------------
    def run(self) -> None:
        # Nodes computed from constants alone first (in order, so chains of them too): exporters
        # place them anywhere (torch puts a ReLU6's Clip bounds after the Conv; Caffe2 unsqueezes a
        # Scale's weight right before its Mul), and a fusion decided at the producer needs the
        # values of what it fuses. Any order that keeps each node after its inputs is a valid one.
        done: set[int] = set()
        for node in self.graph.node:
            if all(n in self.consts for n in node.input if n):
                self._lower(node)
                done.add(id(node))
        for node in self.graph.node:
            if id(node) not in done:
                self._lower(node)
        if self.new_pins:
            return  # ``lower`` walks again with these dimensions constant: what else failed may not
        self.unsupported.extend(refused_outputs(self, self.batch_flow))
        if self.unsupported:
            raise UnsupportedModelError(self.unsupported, self.name)
        # A value still deferred here was read by no kernel (only CastLike's type operand reads a
        # value without its elements) and is no graph output: nothing needs it computed.
        self._pending.clear()
        self._finish_outputs()

    def _lower(self, node: onnx.NodeProto) -> None:
        """Folds, skips (fused) or lowers one node; an unsupported one is recorded and poisons its outputs."""
        if id(node) in self._fused:
            return
        if any(n in self.poisoned for n in node.input if n):
            self.poisoned.update(o for o in node.output if o)
            return
        try:
            if node.domain in ("", "ai.onnx") and (why := older_definition(node.op_type, self.opset)):
                raise NodeUnsupported(why)
            if not try_fold(self, node):
                handler_for(node)(self, node)
        except (NodeUnsupported, DimError) as exc:
            self.unsupported.append(UnsupportedNode(node.name, node.op_type, str(exc)))
            self.poisoned.update(o for o in node.output if o)
        except PinSymbol as pin:
            if all(p.symbol != pin.symbol for p in self.new_pins):
                self.new_pins.append(SymbolPin(pin.symbol, pin.value, node.name, node.op_type, pin.reason))
            self.poisoned.update(o for o in node.output if o)

    def _finish_outputs(self) -> None:
        seen: set[Ref] = set()
        self.output_operands: list[tuple[str, Operand]] = []
        for name in self.outputs:
            if name in self.consts or name not in self.tensors:
                if self.value(name) is not None and self.value(name).dtype == object:
                    raise UnsupportedModelError([UnsupportedNode(name, "output", "a graph output that holds "
                                                                 "dynamic dimensions as data")], self.name)
            if name in self.consts and self.consts[name].size <= 65536:
                fresh = f"{name}#const{self.next_id()}"
                emit_constant(self, name, fresh)
                self.output_operands.append((name, self.tensors[fresh]))
                continue
            op = self.tensors.get(name)
            if op is None or op.ref.kind != "call" or op.ref in seen or op.ref.shape != op.shape:
                fresh = f"{name}#copy{self.next_id()}"
                emit_copy(self, name, fresh)
                op = self.tensors[fresh]
            seen.add(op.ref)
            self.output_operands.append((name, op))

    # -- into the builder --------------------------------------------------------------------------
    def specs(self) -> list[KernelSpec | GpuKernelSpec]:
        unique: dict[tuple[str, tuple[str, ...]], KernelSpec | GpuKernelSpec] = {}
        for spec, _, _, _ in self.calls:
            unique.setdefault((spec.source, spec.entries), spec)
        return list(unique.values())

    def builder(self, registry=None) -> GraphBuilder:
        b = GraphBuilder(self.name, registry=registry)
        values: dict[Ref, Any] = {}
        for i, (name, dtype, shape) in enumerate(self.inputs):
            values[Ref("input", i, 0, dtype, shape)] = b.input(name, dtype.name, [dim_expr(d) for d in shape],
                                                               device=self.io_device)
        for i, (name, arr) in enumerate(self.weights):
            values[self._weight_refs[name]] = b.weight(name, arr, device=self.device)
        if self.io_device != self.device:  # copies are calls: after every weight is declared
            for ref in [r for r in values if r.kind == "input"]:
                values[ref] = b.copy(values[ref], self.device)
        kdefs: dict[tuple[str, tuple[str, ...]], Any] = {}
        for idx, (spec, refs, outs, in_place) in enumerate(self.calls):
            key = (spec.source, spec.entries)
            if key not in kdefs and isinstance(spec, GpuKernelSpec):
                kdefs[key] = b.kernel(f"{spec.name}_{len(kdefs)}", device=self.device, entries=list(spec.entries),
                                      source=render(spec.source, self.device), language=GPU_KINDS[self.device],
                                      launch=[dict(la) for la in spec.launches])
            elif key not in kdefs:
                kdefs[key] = b.kernel(f"{spec.name}_{len(kdefs)}", entries=list(spec.entries), source=spec.source,
                                      options=spec.options,
                                      entry_code={e: (src, cpu_options(src)) for e, src in spec.entry_sources})
            produced = b.call(kdefs[key], [values[r] for r in refs],
                              [(dt.name, [dim_expr(d) for d in shape]) for dt, shape in outs],
                              symbols=list(spec.symbols), workspace=spec.workspace, share_map=in_place)
            for pos, ((dt, shape), v) in enumerate(zip(outs, produced)):
                values[Ref("call", idx, pos, dt, shape)] = v
        for name, op in self.output_operands:
            value = values[op.ref]
            b.output(value if self.io_device == self.device else b.copy(value, self.io_device), name)
        return b


def lower(model: onnx.ModelProto, *, batch_symbol: str | None = None, name: str = "model", device: str = "cpu",
          io_device: str | None = None) -> Lowering:
    """``Lowering(model).run()``, walked again with a declared dimension made constant each time a
    node proves the model holds at one value of it only (``PinSymbol``: torch's attention reshapes
    bake in the traced sequence length). Each pin is announced with a ``SymbolPinnedWarning``; the
    inputs then declare that size, so any other is refused before a kernel runs. A symbol becomes
    an integer once pinned, so the walks end after at most one more than the model has symbols."""
    pins: list[SymbolPin] = []
    while True:
        lowering = Lowering(model, batch_symbol=batch_symbol, name=name, device=device, io_device=io_device,
                            pins=pins)
        lowering.run()
        if not lowering.new_pins:
            break
        pins.extend(lowering.new_pins)
    for pin in pins:
        warnings.warn(SymbolPinnedWarning(pin, name), stacklevel=3)
    return lowering


def _initializer_array(init: onnx.TensorProto) -> np.ndarray:
    """An initializer's array; raw little-endian data is viewed in place, not copied."""
    if init.data_location == onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    if init.raw_data and init.data_type in ONNX_DTYPES and init.data_type != onnx.TensorProto.BOOL:
        dtype = np.dtype(ONNX_DTYPES[init.data_type]).newbyteorder("<")
        return np.frombuffer(init.raw_data, dtype=dtype).reshape(tuple(init.dims))
    return numpy_helper.to_array(init)
