"""Elementwise ops with ONNX multidirectional broadcasting: unary, binary, variadic, Where, Cast.

Broadcasting is resolved at import: adjacent axes that broadcast the same way for every input are
merged, so ``[N, C, H, W] + [C, 1, 1]`` becomes a two-level loop nest with plain strides (and a
single flat loop when no input broadcasts). Activations that directly follow an elementwise node
(or a Conv/Gemm/MatMul, see ``Lowering.take_epilogue``) are fused into the same kernel.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.dims import Dim, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops import register

__all__ = ["unary_expression", "broadcast_shape", "emit_elementwise", "lit", "loop_nest"]

FLOATS = ("float32", "float64", "float16")


def lit(value: float, dtype: np.dtype) -> str:
    """A C literal of ``value`` in ``dtype``'s C type."""
    if np.dtype(dtype).kind == "f":
        v = float(value)
        text = "INFINITY" if v == math.inf else "(-INFINITY)" if v == -math.inf else repr(v)
        return f"(({'float' if np.dtype(dtype).name == 'float16' else ctype(dtype)}){text})"
    return f"(({ctype(dtype)}){int(value)})"


def _float_only(op: str, dtype: np.dtype) -> None:
    if np.dtype(dtype).name not in FLOATS:
        raise NodeUnsupported(f"{op} on {np.dtype(dtype).name} is not supported (float types only)")


def unary_expression(ctx, node, dtype: np.dtype) -> Callable[[str], str] | None:
    """The C expression of a unary elementwise node (a function of the operand's expression), or
    None when ``node`` is not a unary elementwise op. Raises ``NodeUnsupported`` for bad attributes."""
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
        return lambda x: f"({x} < {L(lo)} ? {L(lo)} : ({x} > {L(hi)} ? {L(hi)} : {x}))"
    if op == "Sign":
        return lambda x: f"(({ctype(dtype)})(({x} > 0) - ({x} < 0)))"
    if op == "Not":
        return lambda x: f"(!({x}))"
    floats: dict[str, Callable[[str], str]] = {
        "Sigmoid": lambda x: f"({L(1)} / ({L(1)} + exp(-({x}))))",
        "Tanh": lambda x: f"tanh({x})",
        "Exp": lambda x: f"exp({x})",
        "Log": lambda x: f"log({x})",
        "Sqrt": lambda x: f"sqrt({x})",
        "Erf": lambda x: f"erf({x})",
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
        return lambda x: f"({L(0.5)} * {x} * ({L(1)} + erf({x} * {L(1 / math.sqrt(2))})))"
    return None


UNARY = ("Relu", "Neg", "Abs", "Clip", "Sign", "Not", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Erf",
         "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
         "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Gelu")


def broadcast_shape(shapes: Sequence[Sequence[Dim]]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for d in range(rank):
        size: Dim = 1
        for s in shapes:
            k = d - (rank - len(s))
            if k < 0:
                continue
            v = s[k]
            if v == 1:
                continue
            if size == 1:
                size = v
            elif size != v:
                raise NodeUnsupported(f"shapes {[list(x) for x in shapes]} do not broadcast (or their dynamic "
                                      f"dimensions cannot be proved equal)")
        out.append(size)
    return tuple(out)


def loop_nest(out_shape: Sequence[Dim], in_shapes: Sequence[Sequence[Dim]]) -> tuple[list[Dim], list[list[Dim]]]:
    """Merged loop sizes and, per input, the stride of each loop (0 where it broadcasts)."""
    rank = len(out_shape)
    padded = [[1] * (rank - len(s)) + list(s) for s in in_shapes]
    groups: list[tuple[Dim, tuple[bool, ...]]] = []
    for d in range(rank):
        if out_shape[d] == 1:
            continue
        status = tuple(p[d] != 1 for p in padded)
        if groups and groups[-1][1] == status:
            groups[-1] = (groups[-1][0] * out_shape[d], status)
        else:
            groups.append((out_shape[d], status))
    sizes = [g[0] for g in groups]
    strides: list[list[Dim]] = []
    for j in range(len(in_shapes)):
        run: Dim = 1
        st: list[Dim] = [0] * len(groups)
        for k in range(len(groups) - 1, -1, -1):
            if groups[k][1][j]:
                st[k] = run
                run = run * groups[k][0]
        strides.append(st)
    return sizes, strides


def elementwise_source(out_shape: Sequence[Dim], in_shapes: Sequence[Sequence[Dim]], in_types: Sequence[str],
                       out_type: str, expr: Callable[[list[str]], str], scalars: dict[int, str]) -> str:
    """C source of one kernel computing ``out = expr(inputs)`` with broadcasting; ``scalars`` maps an
    input position to a literal used instead of reading the tensor."""
    sizes, strides = loop_nest(out_shape, in_shapes)
    symbols = symbols_of(out_shape)
    tensor_inputs = [j for j in range(len(in_shapes)) if j not in scalars]
    lines = []
    for slot, j in enumerate(tensor_inputs):
        lines.append(f"    const {in_types[j]} *restrict in{j} = (const {in_types[j]} *)t[{slot}];")
    lines.append(f"    {out_type} *restrict out = ({out_type} *)t[{len(tensor_inputs)}];")
    total = dims_product(out_shape)
    if not sizes:
        sizes, strides = [1], [[0] for _ in in_shapes]
    idx = [f"i{k}" for k in range(len(sizes))]
    big = "" if isinstance(total, int) and total < (1 << 18) else (
        f"    #pragma omp parallel for if({dim_c(total)} >= 262144)\n")
    body = big
    for k, size in enumerate(sizes):
        body += "    " * (k + 1) + f"for (int64_t {idx[k]} = 0; {idx[k]} < {dim_c(size)}; {idx[k]}++)\n"
    ostr: list[Dim] = []
    run: Dim = 1
    for size in reversed(sizes):
        ostr.insert(0, run)
        run = run * size
    off = lambda st: " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, st) if s != 0) or "0"  # noqa: E731
    # half-precision operands are computed in float (the C library has no _Float16 functions)
    args = [scalars[j] if j in scalars else
            (f"((float)in{j}[{off(strides[j])}])" if in_types[j] == "_Float16" else f"in{j}[{off(strides[j])}]")
            for j in range(len(in_shapes))]
    body += "    " * (len(sizes) + 1) + f"out[{off(ostr)}] = ({out_type})({expr(args)});\n"
    return source_with_entries("", [("elementwise", "\n".join(lines) + "\n" + body)], symbols)


def emit_elementwise(ctx, node, inputs: Sequence[str], out_dtype: np.dtype, expr: Callable[[list[str]], str],
                     *, fuse: bool = True, out_name: str | None = None) -> None:
    """Lower one elementwise node (inputs broadcast against each other)."""
    shapes = [ctx.shape(n) for n in inputs]
    out_shape = broadcast_shape(shapes)
    target = out_name or node.output[0]
    ep, final = (lambda x: x), target
    if fuse and out_dtype.kind == "f":
        ep, final = ctx.take_epilogue(node, out_dtype)
    scalars: dict[int, str] = {}
    for j, n in enumerate(inputs):
        v = ctx.const(n)
        if v is not None and v.size == 1 and v.dtype.kind in "fiub":
            scalars[j] = lit(v.reshape(()).item(), v.dtype)
    types = [ctype(ctx.dtype(n)) for n in inputs]
    source = elementwise_source(out_shape, shapes, types, ctype(out_dtype), lambda args: ep(expr(args)), scalars)
    spec = KernelSpec(node.op_type.lower(), source, ("elementwise",), tuple(symbols_of(out_shape)))
    ctx.emit(spec, [n for j, n in enumerate(inputs) if j not in scalars], [(final, out_dtype, out_shape)])


@register(*UNARY)
def _unary(ctx, node) -> None:
    dtype = ctx.dtype(node.input[0])
    fn = unary_expression(ctx, node, dtype)
    if fn is None:
        raise NodeUnsupported("Clip bounds must be constants")
    out_dtype = np.dtype(bool) if node.op_type == "Not" else dtype
    emit_elementwise(ctx, node, [node.input[0]], out_dtype, lambda a: fn(a[0]))


_ARITH = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}
_COMPARE = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}
_LOGIC = {"And": "&&", "Or": "||", "Xor": "!="}


@register(*_ARITH, *_COMPARE, *_LOGIC, "Pow", "Mod", "PRelu", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _binary(ctx, node) -> None:
    op = node.op_type
    a_dt = ctx.dtype(node.input[0])
    t = ctype(a_dt)
    if op in _ARITH:
        sym = _ARITH[op]
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"{a[0]} {sym} {a[1]}")
    elif op in _COMPARE:
        sym = _COMPARE[op]
        emit_elementwise(ctx, node, node.input[:2], np.dtype(bool), lambda a: f"{a[0]} {sym} {a[1]}", fuse=False)
    elif op in _LOGIC:
        sym = _LOGIC[op]
        emit_elementwise(ctx, node, node.input[:2], np.dtype(bool), lambda a: f"(!!{a[0]}) {sym} (!!{a[1]})",
                         fuse=False)
    elif op.startswith("Bitwise"):
        sym = {"BitwiseAnd": "&", "BitwiseOr": "|", "BitwiseXor": "^"}[op]
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"{a[0]} {sym} {a[1]}", fuse=False)
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
        emit_elementwise(ctx, node, node.input[:2], a_dt, expr, fuse=False)
    elif op == "PRelu":
        emit_elementwise(ctx, node, node.input[:2], a_dt, lambda a: f"({a[0]} < 0 ? {a[0]} * {a[1]} : {a[0]})")


@register("Sum", "Max", "Min", "Mean")
def _variadic(ctx, node) -> None:
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
def _where(ctx, node) -> None:
    dt = ctx.dtype(node.input[1])
    emit_elementwise(ctx, node, node.input[:3], dt, lambda a: f"{a[0]} ? {a[1]} : {a[2]}", fuse=False)


@register("Cast")
def _cast(ctx, node) -> None:
    from engine_onnx.lowering import onnx_dtype

    to = onnx_dtype(ctx.attr(node, "to"))
    src = ctx.dtype(node.input[0])
    ctype(src)
    ctype(to)
    if to == src:
        ctx.alias(node.output[0], node.input[0], ctx.shape(node.input[0]))
        return
    if to == np.dtype(bool):
        emit_elementwise(ctx, node, [node.input[0]], to, lambda a: f"{a[0]} != 0", fuse=False)
    else:
        emit_elementwise(ctx, node, [node.input[0]], to, lambda a: a[0], fuse=False)


@register("CastLike")
def _cast_like(ctx, node) -> None:
    to = ctx.dtype(node.input[1])
    expr = (lambda a: f"{a[0]} != 0") if to == np.dtype(bool) else (lambda a: a[0])
    emit_elementwise(ctx, node, [node.input[0]], to, expr, fuse=False)
