"""Elementwise ops with ONNX multidirectional broadcasting: unary, binary, variadic, Where, Cast.

Broadcasting is resolved at import: adjacent axes that broadcast the same way for every input are
merged, so ``[N, C, H, W] + [C, 1, 1]`` becomes a two-level loop nest with plain strides (and a
single flat loop when no input broadcasts).

**Fusion.** Connected elementwise nodes become one kernel (a ``Group``): a node whose value has
exactly one consumer, that consumer elementwise too, and that is not a graph output, defers its
kernel (``Lowering.defer``); the consumer inlines it when the value has the consumer's own output
shape. The kernel reads each input tensor once per output element, at its own broadcast position,
and computes the nodes in order in locals of their own C types (so a Cast, an integer wrap-around or
a half-precision rounding in the middle of a chain gives what separate kernels would). A value with
two consumers, a graph output, or a value that the consumer broadcasts (a ``[batch, seq, 1]``
statistic divided into ``[batch, seq, d]``) ends a group and is written to memory: inlining the
last would compute each of its elements again for every element it is broadcast to. Reductions,
MatMul and the other ops are never inside a group; activations that follow a Conv/Gemm/MatMul, pool
or LayerNormalization are fused into that kernel instead (``Lowering.take_epilogue``).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import attrs
import numpy as np
import onnx

from engine_onnx.codegen import (PARALLEL_WORK, TRANSCENDENTAL_COST, KernelSpec, ctype, parallel_rows,
                                 source_with_entries)
from engine_onnx.dims import Dim, dim_c, dims_product, symbols_of
from engine_onnx.dtypes import onnx_dtype
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gpu_kernels import group_kernel
from engine_onnx.ops.kernel_exprs import broadcast_shape, lit, loop_nest
from engine_onnx.ops.registry import register
from engine_onnx.vecmath import math_preamble

__all__ = ["unary_expression", "emit_elementwise", "Group", "Step", "FUSIBLE"]

FLOATS = ("float32", "float64", "float16")


def _float_only(op: str, dtype: np.dtype) -> None:
    if np.dtype(dtype).name not in FLOATS:
        raise NodeUnsupported(f"{op} on {np.dtype(dtype).name} is not supported (float types only)")


def unary_expression(ctx: LoweringContext, node: onnx.NodeProto, dtype: np.dtype, *,
                     vector_math: bool = False) -> Callable[[str], str] | None:
    """The C expression of a unary elementwise node (a function of the operand's expression), or
    None when ``node`` is not a unary elementwise op. Raises ``NodeUnsupported`` for bad attributes.
    ``vector_math``: float32/float16 ``erf`` and ``exp`` (Exp, Sigmoid, GELU) call the vectorisable
    ``vecmath`` functions (for kernels written by ``group_source``, which defines them), else the C
    library's."""
    single = vector_math and np.dtype(dtype).name in ("float32", "float16")
    erf, exp = ("eng_erff", "eng_expf") if single else ("erf", "exp")
    op = node.op_type
    a = ctx.attr
    L = lambda v: lit(v, dtype)  # noqa: E731
    if op == "Relu":
        return lambda x: f"({x} > {L(0)} ? {x} : {L(0)})"
    if op == "Neg":
        return lambda x: f"(-({x}))"
    if op == "Abs":
        return (lambda x: f"fabs({x})") if dtype.kind == "f" else (lambda x: f"({x} < 0 ? -({x}) : {x})")
    if op == "Clip":
        lo, hi = (a(node, "min", -math.inf), a(node, "max", math.inf)) if ctx.opset < 11 else (-math.inf, math.inf)
        if ctx.opset >= 11:
            for idx in (1, 2):
                if len(node.input) > idx and node.input[idx]:
                    v = ctx.const(node.input[idx])
                    if v is None:
                        return None
                    if idx == 1:
                        lo = v.item()
                    else:
                        hi = v.item()
        if dtype.kind != "f" and (math.isinf(lo) or math.isinf(hi)):
            info = np.iinfo(dtype)
            lo = info.min if math.isinf(lo) else lo
            hi = info.max if math.isinf(hi) else hi
        if lo > hi:  # ONNX: every element becomes max
            return lambda x: L(hi)
        return lambda x: f"({x} < {L(lo)} ? {L(lo)} : ({x} > {L(hi)} ? {L(hi)} : {x}))"
    if op == "Sign":
        return lambda x: f"(({ctype(dtype)})(({x} > 0) - ({x} < 0)))"
    if op == "Not":
        return lambda x: f"(!({x}))"
    floats: dict[str, Callable[[str], str]] = {
        "Sigmoid": lambda x: f"({L(1)} / ({L(1)} + {exp}(-({x}))))",
        "Tanh": lambda x: f"tanh({x})",
        "Exp": lambda x: f"{exp}({x})",
        "Log": lambda x: f"log({x})",
        "Sqrt": lambda x: f"sqrt({x})",
        "Erf": lambda x: f"{erf}({x})",
        "Reciprocal": lambda x: f"({L(1)} / ({x}))",
        "Floor": lambda x: f"floor({x})",
        "Ceil": lambda x: f"ceil({x})",
        "Round": lambda x: f"nearbyint({x})",
        "Sin": lambda x: f"sin({x})", "Cos": lambda x: f"cos({x})", "Tan": lambda x: f"tan({x})",
        "Asin": lambda x: f"asin({x})", "Acos": lambda x: f"acos({x})", "Atan": lambda x: f"atan({x})",
        "Sinh": lambda x: f"sinh({x})", "Cosh": lambda x: f"cosh({x})",
        "Softplus": lambda x: f"({x} > {L(20)} ? {x} : log1p(exp({x})))",
        "Softsign": lambda x: f"({x} / ({L(1)} + fabs({x})))",
    }
    if op in floats:
        _float_only(op, dtype)
        return floats[op]
    if op == "LeakyRelu":
        _float_only(op, dtype)
        al = a(node, "alpha", 0.01)
        return lambda x: f"({x} >= {L(0)} ? {x} : {L(al)} * {x})"
    if op == "Elu":
        _float_only(op, dtype)
        al = a(node, "alpha", 1.0)
        return lambda x: f"({x} >= {L(0)} ? {x} : {L(al)} * (exp({x}) - {L(1)}))"
    if op == "Selu":
        _float_only(op, dtype)
        al, ga = a(node, "alpha", 1.67326319217681884765625), a(node, "gamma", 1.05070102214813232421875)
        return lambda x: f"({L(ga)} * ({x} > {L(0)} ? {x} : {L(al)} * (exp({x}) - {L(1)})))"
    if op == "HardSigmoid":
        _float_only(op, dtype)
        al, be = a(node, "alpha", 0.2), a(node, "beta", 0.5)
        return lambda x: f"fmax({L(0)}, fmin({L(1)}, {L(al)} * {x} + {L(be)}))"
    if op == "HardSwish":
        _float_only(op, dtype)
        return lambda x: f"({x} * fmax({L(0)}, fmin({L(1)}, {L(1 / 6)} * {x} + {L(0.5)})))"
    if op == "Gelu":
        _float_only(op, dtype)
        if a(node, "approximate", "none") == "tanh":
            return lambda x: (f"({L(0.5)} * {x} * ({L(1)} + tanh({L(math.sqrt(2 / math.pi))} * "
                              f"({x} + {L(0.044715)} * {x} * {x} * {x}))))")
        return lambda x: f"({L(0.5)} * {x} * ({L(1)} + {erf}({x} * {L(1 / math.sqrt(2))})))"
    return None


UNARY = ("Relu", "Neg", "Abs", "Clip", "Sign", "Not", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Erf",
         "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
         "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Gelu")


#: Op types whose handlers go through ``emit_elementwise``: a value whose one consumer is one of
#: these is left for that consumer to compute inline.
FUSIBLE = frozenset({*UNARY, "Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
                     "And", "Or", "Xor", "Pow", "Mod", "PRelu", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Sum", "Max",
                     "Min", "Mean", "Where", "Cast", "CastLike"})


@attrs.frozen
class Step:
    """One node of a fused group: ``expr`` of its operands' C values, held in ``dtype``'s C type.
    An operand is ``("leaf", j)`` (the group's ``j``-th input tensor) or ``("step", k)`` (an earlier step)."""

    op: str
    dtype: np.dtype
    expr: Callable[[list[str]], str]
    operands: tuple[tuple[str, int], ...]


@attrs.frozen
class Group:
    """Elementwise nodes computed by one kernel. For each output element every leaf is read once, at
    its own broadcast position, then the steps run in order; the last step is the group's value.
    Every intermediate has the group's shape (an intermediate that broadcasts is not inlined: it
    would be computed again for each element it is broadcast to)."""

    leaves: tuple[str, ...]
    steps: tuple[Step, ...]
    dtype: np.dtype
    shape: tuple[Dim, ...]

    @property
    def kernel_name(self) -> str:
        ops = [s.op.lower() for s in self.steps]
        if len(ops) == 1:
            return ops[0]
        return "fused_" + "_".join(ops[:5]) + (f"_and_{len(ops) - 5}_more" if len(ops) > 5 else "")


def _held(dtype: np.dtype, value: str) -> tuple[str, str]:
    """The C type of a local holding an intermediate of ``dtype`` and its initialiser: rounded to
    ``dtype`` as the unfused kernel's store would (half precision is rounded, then computed in float)."""
    if np.dtype(dtype).name == "float16":
        return "float", f"(float)(_Float16)({value})"
    t = ctype(dtype)
    return t, f"({t})({value})"


def _same_elements(shape: Sequence[Dim], out_shape: Sequence[Dim]) -> bool:
    """Whether a value of ``shape`` meets one output element each (no broadcast to ``out_shape``)."""
    pad = len(out_shape) - len(shape)
    return pad >= 0 and all(d == 1 for d in out_shape[:pad]) and list(shape) == list(out_shape[pad:])


#: Calls to a function (erf, exp, tanh…) in a group: each weighs ``TRANSCENDENTAL_COST`` in its threads.
_TRANSCENDENTAL = re.compile(r"\b(?:eng_erff|eng_expf|exp|expm1|log|log1p|tanh|pow|sqrt|erf|sin|cos|tan|asin|"
                             r"acos|atan|sinh|cosh|asinh|acosh|atanh|round|nearbyint)\(")


def group_source(group: Group, leaf_shapes: Sequence[Sequence[Dim]], leaf_types: Sequence[str],
                 scalars: dict[int, str]) -> str:
    """C source of one kernel computing ``group`` with broadcasting; ``scalars`` maps a leaf position
    to a literal used instead of reading the tensor."""
    out_shape = group.shape
    out_type = ctype(group.dtype)
    sizes, strides = loop_nest(out_shape, leaf_shapes)
    symbols = symbols_of(out_shape)
    tensor_leaves = [j for j in range(len(leaf_shapes)) if j not in scalars]
    lines = []
    for slot, j in enumerate(tensor_leaves):
        lines.append(f"    const {leaf_types[j]} *restrict in{j} = (const {leaf_types[j]} *)t[{slot}];")
    lines.append(f"    {out_type} *restrict out = ({out_type} *)t[{len(tensor_leaves)}];")
    total = dims_product(out_shape)
    if not sizes:
        sizes, strides = [1], [[0] for _ in leaf_shapes]
    idx = [f"i{k}" for k in range(len(sizes))]
    loops = f"        const int64_t {idx[0]} = r;\n"
    for k, size in enumerate(sizes[1:], start=1):
        loops += "    " * (k + 1) + f"for (int64_t {idx[k]} = 0; {idx[k]} < {dim_c(size)}; {idx[k]}++)\n"
    ostr: list[Dim] = []
    run: Dim = 1
    for size in reversed(sizes):
        ostr.insert(0, run)
        run = run * size
    off = lambda st: " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, st) if s != 0) or "0"  # noqa: E731
    pad = "    " * (len(sizes) + 1)
    stmts: list[str] = []
    leaf_values: list[str] = []
    for j in range(len(leaf_shapes)):
        if j in scalars:
            leaf_values.append(scalars[j])
            continue
        # half-precision operands are computed in float (the C library has no _Float16 functions)
        held = "float" if leaf_types[j] == "_Float16" else leaf_types[j]
        stmts.append(f"const {held} a{j} = in{j}[{off(strides[j])}];")
        leaf_values.append(f"a{j}")
    step_values: list[str] = []
    for k, step in enumerate(group.steps):
        args = [leaf_values[i] if kind == "leaf" else step_values[i] for kind, i in step.operands]
        value = step.expr(args)
        if k == len(group.steps) - 1:
            stmts.append(f"out[{off(ostr)}] = ({out_type})({value});")
        else:
            held, init = _held(step.dtype, value)
            stmts.append(f"const {held} v{k} = {init};")
            step_values.append(f"v{k}")
    row_body = loops + pad[:-4] + "{\n" + "".join(f"{pad}{s}\n" for s in stmts) + pad[:-4] + "}\n"
    threshold = PARALLEL_WORK // (1 + TRANSCENDENTAL_COST * len(_TRANSCENDENTAL.findall(row_body)))
    fn, body = parallel_rows("elementwise", symbols, "".join(f"{line}\n" for line in lines), dim_c(sizes[0]),
                             row_body, total, threshold)
    return source_with_entries(math_preamble(row_body) + fn, [("elementwise", body)], symbols)


def _extend(ctx: LoweringContext, op: str, inputs: Sequence[str], out_shape: Sequence[Dim], out_dtype: np.dtype,
            expr: Callable[[list[str]], str], inline: bool) -> Group:
    """The group computing one node: its inputs that are deferred groups of the same shape are
    inlined (their steps come first), every other input is a leaf."""
    leaves: list[str] = []
    steps: list[Step] = []
    operands: list[tuple[str, int]] = []

    def leaf(name: str) -> tuple[str, int]:
        if name not in leaves:
            leaves.append(name)
        return ("leaf", leaves.index(name))

    for name in inputs:
        g = ctx.pending(name) if inline else None
        if isinstance(g, Group) and _same_elements(g.shape, out_shape):
            ctx.take_pending(name)
            base = len(steps)
            for st in g.steps:
                steps.append(attrs.evolve(st, operands=tuple(
                    leaf(g.leaves[i]) if kind == "leaf" else ("step", base + i) for kind, i in st.operands)))
            operands.append(("step", len(steps) - 1))
        else:
            operands.append(leaf(name))
    steps.append(Step(op, np.dtype(out_dtype), expr, tuple(operands)))
    return Group(tuple(leaves), tuple(steps), np.dtype(out_dtype), tuple(out_shape))


def _emit_group(ctx: LoweringContext, name: str, group: Group) -> None:
    shapes = [ctx.shape(n) for n in group.leaves]
    scalars: dict[int, str] = {}
    for j, n in enumerate(group.leaves):
        v = ctx.const(n)
        if v is not None and v.size == 1 and v.dtype.kind in "fiub":
            scalars[j] = lit(v.reshape(()).item(), v.dtype)
    if ctx.gpu:
        spec_gpu = group_kernel(group.kernel_name, group.steps, group.dtype, group.shape, shapes,
                                [ctx.dtype(n) for n in group.leaves], scalars, _held)
        ctx.emit(spec_gpu, [n for j, n in enumerate(group.leaves) if j not in scalars],
                 [(name, group.dtype, group.shape)])
        return
    types = [ctype(ctx.dtype(n)) for n in group.leaves]
    source = group_source(group, shapes, types, scalars)
    spec = KernelSpec(group.kernel_name, source, ("elementwise",), tuple(symbols_of(group.shape)))
    ctx.emit(spec, [n for j, n in enumerate(group.leaves) if j not in scalars], [(name, group.dtype, group.shape)])


def _joins_consumer(ctx: LoweringContext, name: str) -> bool:
    user = ctx.sole_value_consumer(name)
    return user is not None and user.domain in ("", "ai.onnx") and user.op_type in FUSIBLE


def emit_elementwise(ctx: LoweringContext, node: onnx.NodeProto, inputs: Sequence[str], out_dtype: np.dtype,
                     expr: Callable[[list[str]], str], *, fuse: bool = True, out_name: str | None = None) -> None:
    """Lower one elementwise node (inputs broadcast against each other).

    With ``fuse``, inputs that are deferred elementwise groups of the output's shape are computed
    inline, and when the node's one consumer is elementwise too, the node's own kernel is deferred
    (``Lowering.defer``): a chain becomes one kernel written by its last node.
    """
    out_dtype = np.dtype(out_dtype)
    out_shape = broadcast_shape([ctx.shape(n) for n in inputs])
    target = out_name or node.output[0]
    group = _extend(ctx, node.op_type, inputs, out_shape, out_dtype, expr, fuse)
    if fuse and target == node.output[0] and _joins_consumer(ctx, target):
        ctx.defer(target, out_dtype, out_shape, group, lambda: _emit_group(ctx, target, group))
    else:
        _emit_group(ctx, target, group)


@register(*UNARY)
def _unary(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    dtype = ctx.dtype(node.input[0])
    fn = unary_expression(ctx, node, dtype, vector_math=not ctx.gpu)
    if fn is None:
        raise NodeUnsupported("Clip bounds must be constants")
    out_dtype = np.dtype(bool) if node.op_type == "Not" else dtype
    emit_elementwise(ctx, node, [node.input[0]], out_dtype, lambda a: fn(a[0]))


_ARITH = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}
_COMPARE = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}
_LOGIC = {"And": "&&", "Or": "||", "Xor": "!="}


@register(*_ARITH, *_COMPARE, *_LOGIC, "Pow", "Mod", "PRelu", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _binary(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    op = node.op_type
    a_dt = ctx.dtype(node.input[0])
    t = ctype(a_dt)
    if op in _ARITH:
        sym = _ARITH[op]
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"{a[0]} {sym} {a[1]}")
    elif op in _COMPARE:
        sym = _COMPARE[op]
        emit_elementwise(ctx, node, node.input[:2], np.dtype(bool), lambda a: f"{a[0]} {sym} {a[1]}")
    elif op in _LOGIC:
        sym = _LOGIC[op]
        emit_elementwise(ctx, node, node.input[:2], np.dtype(bool), lambda a: f"(!!{a[0]}) {sym} (!!{a[1]})")
    elif op.startswith("Bitwise"):
        sym = {"BitwiseAnd": "&", "BitwiseOr": "|", "BitwiseXor": "^"}[op]
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"{a[0]} {sym} {a[1]}")
    elif op == "Pow":
        if a_dt.kind == "f":
            emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"pow({a[0]}, ({t})({a[1]}))")
        else:
            emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"pow((double){a[0]}, (double){a[1]})")
    elif op == "Mod":
        if ctx.attr(node, "fmod", 0):
            expr = (lambda a: f"fmod({a[0]}, {a[1]})") if a_dt.kind == "f" else (lambda a: f"{a[0]} % {a[1]}")
        elif a_dt.kind == "f":  # the result takes the divisor's sign, as numpy.mod
            expr = lambda a: (f"(fmod({a[0]}, {a[1]}) != 0 && ((fmod({a[0]}, {a[1]}) < 0) != ({a[1]} < 0)) ? "  # noqa: E731
                              f"fmod({a[0]}, {a[1]}) + {a[1]} : fmod({a[0]}, {a[1]}))")
        else:
            expr = lambda a: (f"(({a[0]} % {a[1]}) != 0 && ((({a[0]} % {a[1]}) < 0) != ({a[1]} < 0)) ? "  # noqa: E731
                              f"({a[0]} % {a[1]}) + {a[1]} : ({a[0]} % {a[1]}))")
        emit_elementwise(ctx, node, node.input[:2], a_dt, expr)
    elif op == "PRelu":
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"({a[0]} < 0 ? {a[0]} * {a[1]} : {a[0]})")


@register("Sum", "Max", "Min", "Mean")
def _variadic(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    names = [n for n in node.input if n]
    dt = ctx.dtype(names[0])
    op = node.op_type
    if len(names) == 1:
        emit_elementwise(ctx, node, names, dt, lambda a: a[0])
        return

    def expr(a: list[str]) -> str:
        if op in ("Sum", "Mean"):
            s = " + ".join(a)
            return s if op == "Sum" else f"({s}) / {lit(len(a), dt)}"
        out = a[0]
        for x in a[1:]:
            cmp = ">" if op == "Max" else "<"
            out = (f"({x} != {x} ? {x} : ({out}) {cmp} {x} ? ({out}) : {x})" if dt.kind == "f"
                   else f"(({out}) {cmp} {x} ? ({out}) : {x})")
        return out
    emit_elementwise(ctx, node, names, dt, expr)


@register("Where")
def _where(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    dt = ctx.dtype(node.input[1])
    emit_elementwise(ctx, node, node.input[:3], dt, lambda a: f"{a[0]} ? {a[1]} : {a[2]}")


@register("Cast")
def _cast(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    to = onnx_dtype(ctx.attr(node, "to"))
    src = ctx.dtype(node.input[0])
    ctype(src)
    ctype(to)
    if to == src:
        ctx.alias(node.output[0], node.input[0], ctx.shape(node.input[0]))
        return
    if to == np.dtype(bool):
        emit_elementwise(ctx, node, [node.input[0]], to, lambda a: f"{a[0]} != 0")
    else:
        emit_elementwise(ctx, node, [node.input[0]], to, lambda a: a[0])


@register("CastLike")
def _cast_like(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    to = ctx.dtype(node.input[1])
    expr = (lambda a: f"{a[0]} != 0") if to == np.dtype(bool) else (lambda a: a[0])
    emit_elementwise(ctx, node, [node.input[0]], to, expr)
