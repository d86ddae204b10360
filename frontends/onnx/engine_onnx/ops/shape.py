"""Data movement: views (Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout) and copies
(Transpose, Slice, Expand, Concat, Split, Gather, ConstantOfShape, Tile, output copies); Range is
folded when its inputs are constants and refused otherwise (its length would depend on data).

Tensors are contiguous and row-major, so a view costs nothing: the consumer reads the same bytes
with another logical shape. Every strided copy (Transpose, Slice, Expand) is one generated loop
nest over the output with per-axis input strides, axes merged where the strides allow.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.batch_flow import shape_text
from engine_onnx.dims import Dim, DimError, Mono, dim_c, dim_div, dim_expr, dims_product, merge_axes, symbols_of
from engine_onnx.errors import NodeUnsupported, PinSymbol, UnsupportedModelError, UnsupportedNode
from engine_onnx.gpu import gpu_ctype
from engine_onnx.ops import gpu_kernels
from engine_onnx.ops.axis_map import emit_axis_map
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.kernel_exprs import broadcast_shape, lit
from engine_onnx.ops.node_args import axes_of
from engine_onnx.ops.registry import register

__all__ = ["emit_copy", "emit_constant", "strided_copy_source"]

INT_MAX = 2 ** 62


def _strides(shape: Sequence[Dim]) -> list[Dim]:
    out: list[Dim] = []
    run: Dim = 1
    for d in reversed(shape):
        out.insert(0, run)
        run = run * d
    return out


def strided_copy_source(out_shape: Sequence[Dim], in_strides: Sequence[Dim], base: Dim, dtype: np.dtype,
                        refuse_if: Sequence[str] = ()) -> str:
    """``out[i...] = in[base + sum(i_k * in_strides[k])]`` over the output's axes; the kernel fails
    (returns 1) without writing when one of the C conditions ``refuse_if`` holds."""
    sizes, strides = merge_axes(out_shape, in_strides)
    t = ctype(dtype)
    body = "".join(f"    if ({cond}) return 1;\n" for cond in refuse_if)
    body += f"    const {t} *restrict in = (const {t} *)t[0] + {dim_c(base)};\n    {t} *restrict out = ({t} *)t[1];\n"
    if not sizes:
        body += "    out[0] = in[0];\n"
    else:
        idx = [f"i{k}" for k in range(len(sizes))]
        for k, size in enumerate(sizes):
            body += "    " * (k + 1) + f"for (int64_t {idx[k]} = 0; {idx[k]} < {dim_c(size)}; {idx[k]}++)\n"
        ostr = _strides(sizes)
        o = " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, ostr))
        src = " + ".join(f"{i} * {dim_c(s)}" for i, s in zip(idx, strides) if s != 0) or "0"
        body += "    " * (len(sizes) + 1) + f"out[{o}] = in[{src}];\n"
    return source_with_entries("", [("copy", body)], symbols_of([*out_shape, base, *in_strides]))


def _output_ctype(ctx: LoweringContext, name: str, dtype: np.dtype) -> str:
    """The C type of graph output ``name``; the walk is over, so a refusal is the model's error."""
    try:
        return gpu_ctype(dtype) if ctx.gpu else ctype(dtype)
    except NodeUnsupported as exc:
        raise UnsupportedModelError([UnsupportedNode(name, "output", str(exc))], ctx.name) from None


def emit_copy(ctx: LoweringContext, src: str, dst: str) -> None:
    """A fresh contiguous copy of ``src`` (for graph outputs that are views, inputs or weights)."""
    shape = ctx.shape(src)
    dtype = ctx.dtype(src)
    t = _output_ctype(ctx, src, dtype)
    if ctx.gpu:
        ctx.emit(gpu_kernels.copy_kernel(shape, dtype), [src], [(dst, dtype, shape)])
        return
    n = dims_product(shape)
    body = f"    memcpy(t[1], t[0], (size_t){dim_c(n)} * sizeof({t}));\n"
    spec = KernelSpec("copy", source_with_entries("", [("copy", body)], symbols_of(shape)), ("copy",),
                      tuple(symbols_of(shape)))
    ctx.emit(spec, [src], [(dst, dtype, shape)])


def emit_constant(ctx: LoweringContext, src: str, dst: str) -> None:
    """A graph output known at import, written by a kernel holding its (small) value."""
    arr = np.require(ctx.const(src), requirements="C")
    t = _output_ctype(ctx, src, arr.dtype)
    if ctx.gpu and arr.size:  # the value as a weight on the device, copied: kernels there hold no tables
        emit_copy(ctx, src, dst)
        return
    if ctx.gpu:  # nothing to write (a bundle's weights may not all be empty)
        ctx.emit(gpu_kernels.fill_kernel("constant", arr.shape, arr.dtype, "0"), [],
                 [(dst, arr.dtype, tuple(int(d) for d in arr.shape))])
        return
    if arr.dtype.kind == "f":
        items = [float(v).hex() if np.isfinite(v) else ("NAN" if np.isnan(v) else "INFINITY" if v > 0 else
                                                          "-INFINITY") for v in arr.reshape(-1).tolist()]
    else:
        items = [str(int(v)) + ("ULL" if arr.dtype.kind == "u" else "LL") for v in arr.reshape(-1).tolist()]
    if arr.size:
        pre = f"static const {t} VALUE[{arr.size}] = {{{', '.join(items)}}};\n"
        body = "    memcpy(t[0], VALUE, sizeof VALUE);\n"
    else:
        pre, body = "", ""
    spec = KernelSpec("constant", source_with_entries(pre, [("constant", body)], ()), ("constant",))
    ctx.emit(spec, [], [(dst, arr.dtype, tuple(int(d) for d in arr.shape))])


@register("Identity")
def _identity(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    ctx.alias(node.output[0], node.input[0], ctx.shape(node.input[0]))


@register("Dropout")
def _dropout(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    if len(node.input) > 2 and node.input[2]:
        mode = ctx.require_const(node.input[2], "Dropout training_mode")
        if bool(mode.reshape(-1)[0]):
            raise NodeUnsupported("training_mode=True (only inference is supported)")
    shape = list(ctx.shape(node.input[0]))
    ctx.alias(node.output[0], node.input[0], shape)
    if len(node.output) > 1 and ctx.is_used(node.output[1]) and ctx.gpu:
        ctx.emit(gpu_kernels.fill_kernel("mask", shape, np.dtype(bool), "1"), [],
                 [(node.output[1], np.dtype(bool), shape)])
    elif len(node.output) > 1 and ctx.is_used(node.output[1]):  # inference keeps every element: all true
        body = f"    memset(t[0], 1, (size_t){dim_c(dims_product(shape))});\n"
        syms = tuple(symbols_of(shape))
        ctx.emit(KernelSpec("mask", source_with_entries("", [("mask", body)], syms), ("mask",), syms), [],
                 [(node.output[1], np.dtype(bool), shape)])


@register("Reshape")
def _reshape(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    src = ctx.shape(node.input[0])
    if ctx.opset < 5:
        target = list(ctx.attr(node, "shape"))
    else:
        v = ctx.value(node.input[1])
        if v is None:
            raise NodeUnsupported("the target shape must be computable at import (constant or from Shape)")
        target = list(v.reshape(-1))
    allowzero = ctx.attr(node, "allowzero", 0)
    out: list[Dim] = []
    unknown = -1
    for i, d in enumerate(target):
        if isinstance(d, Mono):
            out.append(d)
        elif int(d) == 0 and not allowzero:
            out.append(src[i])
        elif int(d) == -1:
            unknown = i
            out.append(1)
        else:
            out.append(int(d))
    if unknown >= 0:
        out[unknown] = dim_div(dims_product(src), dims_product(out))
    elif dims_product(out) != dims_product(src):
        out = _batch_through(ctx, node, src, out)
    ctx.alias(node.output[0], node.input[0], out)


def _batch_through(ctx: LoweringContext, node: onnx.NodeProto, src: Sequence[Dim], target: list[Dim]) -> list[Dim]:
    """A constant target that holds the batch the model was exported at (``[1, 2048]`` for an input
    of ``[batch, 2048, 1, 1]``), which ONNX defines at that batch only: its leading axis becomes the
    batch when the input is proved sample-major (``batch_flow``) and the other axes keep the
    per-sample element count, so row ``i`` of the output is sample ``i``'s row reshaped, which is
    what running each sample alone gives. A count that agrees at one value of another symbol only
    pins that symbol (``PinSymbol``). Anything else is refused: it would drop or invent rows."""
    flow = ctx.batch_flow
    lead = src[0] if src else None
    if (target and isinstance(lead, Mono) and flow.leads(src) and target[0] == 1
            and dims_product(target[1:]) == dims_product(src[1:]) and flow.is_sample_major(node.input[0])):
        return [lead, *target[1:]]
    old, new = dims_product(src), dims_product(target)
    fixed = _fixed_symbol(old, new)
    if fixed is not None and fixed[0] != flow.symbol:  # the model holds at that one value only
        raise PinSymbol(*fixed, f"reshape of {shape_text(src)} to {shape_text(target)}")
    kind = "the constant shape" if not symbols_of(target) else "the shape"
    hint = "" if not flow.leads(src) else "; the batch is not proved to flow through axis 0 row for row (docs/onnx.md)"
    raise NodeUnsupported(f"reshape of {shape_text(src)} ({dim_expr(old)} elements) to {kind} {shape_text(target)} "
                          f"({dim_expr(new)} elements){_valid_only(old, new)}{hint}")


def _fixed_symbol(old: Dim, new: Dim) -> tuple[str, int] | None:
    """``(s, k)`` when the counts agree exactly at ``s = k`` (one symbol of ``old`` fixed), else None."""
    for sym in dict.fromkeys(old.syms if isinstance(old, Mono) else ()):
        try:
            k = dim_div(new, dim_div(old, Mono(1, (sym,))))
        except DimError:
            continue
        if isinstance(k, int) and k > 0:
            return sym, k
    return None


def _valid_only(old: Dim, new: Dim) -> str:
    """Where a single-symbol count mismatch still holds, said in the error (``: valid only at batch = 1``)."""
    if isinstance(old, Mono) and len(old.syms) == 1 and not isinstance(new, Mono) and new % old.coef == 0:
        return f": valid only at {old.syms[0]} = {new // old.coef}"
    return ""


@register("Flatten")
def _flatten(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = ctx.shape(node.input[0])
    axis = int(ctx.attr(node, "axis", 1))
    axis = axis + len(s) if axis < 0 else axis
    ctx.alias(node.output[0], node.input[0], [dims_product(s[:axis]), dims_product(s[axis:])])


@register("Squeeze")
def _squeeze(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    axes = axes_of(ctx, node)
    if axes is None:
        if any(isinstance(d, Mono) for d in s):
            raise NodeUnsupported("Squeeze without axes on a tensor with dynamic dimensions")
        out = [d for d in s if d != 1]
    else:
        drop = {a % len(s) for a in axes}
        wide = [(i, s[i]) for i in sorted(drop) if s[i] != 1]
        if wide:  # a symbolic batch squeezed as if it were the 1 the model was exported at
            raise NodeUnsupported(f"squeezing axis {wide[0][0]} of size {dim_expr(wide[0][1])} of {shape_text(s)}: "
                                  f"only axes of size 1 can be removed")
        out = [d for i, d in enumerate(s) if i not in drop]
    ctx.alias(node.output[0], node.input[0], out)


@register("Unsqueeze")
def _unsqueeze(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    axes = axes_of(ctx, node)
    rank = len(s) + len(axes)
    for a in sorted(a % rank for a in axes):
        s.insert(a, 1)
    ctx.alias(node.output[0], node.input[0], s)


@register("Transpose")
def _transpose(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = ctx.shape(node.input[0])
    perm = ctx.attr(node, "perm", list(range(len(s)))[::-1])
    st = _strides(s)
    out = [s[p] for p in perm]
    dtype = ctx.dtype(node.input[0])
    if ctx.gpu:
        ctx.emit(gpu_kernels.strided_copy_kernel("transpose", out, [st[p] for p in perm], 0, dtype), [node.input[0]],
                 [(node.output[0], dtype, out)])
        return
    spec = KernelSpec("transpose", strided_copy_source(out, [st[p] for p in perm], 0, dtype), ("copy",),
                      tuple(symbols_of(out)))
    ctx.emit(spec, [node.input[0]], [(node.output[0], dtype, out)])


def _slice_params(ctx: LoweringContext, node: onnx.NodeProto, shape):
    if ctx.opset < 10:
        starts, ends = ctx.attr(node, "starts"), ctx.attr(node, "ends")
        axes = ctx.attr(node, "axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts = [int(x) for x in ctx.require_const(node.input[1], "Slice starts").reshape(-1)]
        known = ctx.value(node.input[2])
        if known is not None and known.dtype == object:  # an end computed from a dimension (x[:, :seq])
            ends = [d if isinstance(d, Mono) else int(d) for d in known.reshape(-1)]
        else:
            ends = [int(x) for x in ctx.require_const(node.input[2], "Slice ends").reshape(-1)]
        axes = ([int(x) for x in ctx.require_const(node.input[3], "Slice axes").reshape(-1)]
                if len(node.input) > 3 and node.input[3] else list(range(len(starts))))
        steps = ([int(x) for x in ctx.require_const(node.input[4], "Slice steps").reshape(-1)]
                 if len(node.input) > 4 and node.input[4] else [1] * len(starts))
    return starts, ends, [a % len(shape) for a in axes], steps


@register("Slice")
def _slice(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    starts, ends, axes, steps = _slice_params(ctx, node, s)
    begin: list[Dim] = [0] * len(s)
    step: list[int] = [1] * len(s)
    out = list(s)
    guards: list[str] = []
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        dim = s[ax]
        if isinstance(en, Mono):
            # torch's position_ids[:, :seq]: the output takes the symbol; a run where it exceeds the
            # axis fails instead of reading past the input.
            if isinstance(dim, Mono) or st != 0 or sp != 1:
                raise NodeUnsupported(f"a Slice end computed from a dimension needs start 0, step 1 and a static "
                                      f"axis (axis {ax}: start {st}, step {sp}, size {dim})")
            out[ax] = en
            guards.append(f"{dim_c(en)} > {dim}")
            continue
        if isinstance(dim, Mono):
            if st == 0 and sp == 1 and en >= INT_MAX // 4:
                continue
            raise NodeUnsupported(f"slicing dynamic axis {ax} (only the full range is supported there)")
        if sp == 0:
            raise NodeUnsupported("step 0")
        rng = range(dim)[slice(st, en, sp)]
        out[ax] = len(rng)
        begin[ax] = rng.start if len(rng) else 0
        step[ax] = sp
    strides = _strides(s)
    base: Dim = 0
    for b, stv in zip(begin, strides):
        if b:
            base = base + stv * b
    dtype = ctx.dtype(node.input[0])
    in_strides = [stv * sp for stv, sp in zip(strides, step)]
    if ctx.gpu:  # a GPU kernel cannot fail: past a guarded bound it repeats the input's last element
        ctx.emit(gpu_kernels.strided_copy_kernel("slice", out, in_strides, base, dtype,
                                                 in_size=dims_product(s) if guards else None),
                 [node.input[0]], [(node.output[0], dtype, out)])
        return
    spec = KernelSpec("slice", strided_copy_source(out, in_strides, base, dtype, refuse_if=guards), ("copy",),
                      tuple(symbols_of([*out, *in_strides])))
    ctx.emit(spec, [node.input[0]], [(node.output[0], dtype, out)])


@register("Expand")
def _expand(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    v = ctx.value(node.input[1])
    if v is None:
        raise NodeUnsupported("the target shape must be computable at import")
    out = list(broadcast_shape([s, [x if isinstance(x, Mono) else int(x) for x in v.reshape(-1)]]))
    padded = [1] * (len(out) - len(s)) + s
    st = _strides(padded)
    in_strides = [0 if p == 1 and o != 1 else x for p, o, x in zip(padded, out, st)]
    dtype = ctx.dtype(node.input[0])
    if ctx.gpu:
        ctx.emit(gpu_kernels.strided_copy_kernel("expand", out, in_strides, 0, dtype), [node.input[0]],
                 [(node.output[0], dtype, out)])
        return
    spec = KernelSpec("expand", strided_copy_source(out, in_strides, 0, dtype), ("copy",),
                      tuple(symbols_of([*out, *in_strides])))
    ctx.emit(spec, [node.input[0]], [(node.output[0], dtype, out)])


@register("Concat")
def _concat(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    names = [n for n in node.input if n]
    shapes = [list(ctx.shape(n)) for n in names]
    rank = len(shapes[0])
    axis = ctx.attr(node, "axis") % rank
    for n, sh in zip(names, shapes):  # a batch-1 constant beside a symbolic batch would be overrun
        if len(sh) != rank or any(a != b for k, (a, b) in enumerate(zip(sh, shapes[0])) if k != axis):
            raise NodeUnsupported(f"input {n!r} of shape {shape_text(sh)} does not match {shape_text(shapes[0])} "
                                  f"off the concatenation axis {axis}")
    dtype = ctx.dtype(names[0])
    t = ctype(dtype)
    outer = dims_product(shapes[0][:axis])
    inners = [dims_product(sh[axis:]) for sh in shapes]
    row = dims_product(shapes[0][axis + 1:])
    total_axis: Dim = 0
    for sh in shapes:
        total_axis = total_axis + sh[axis]
    out = shapes[0][:axis] + [total_axis] + shapes[0][axis + 1:]
    # Inputs whose producers wrote them into the buffer already (concat_slices.py) are not copied.
    fill = ctx.concat_fill(node)
    written = fill.written if fill else frozenset()
    copied = [j for j in range(len(names)) if j not in written]
    if fill and not copied:
        ctx.alias(node.output[0], fill.buffer, out)
        return
    starts: list[Dim] = [0]
    for inner in inners:
        starts.append(starts[-1] + inner)
    if ctx.gpu:
        ctx.emit(gpu_kernels.concat_kernel(outer, inners, starts, dtype, out), names,
                 [(node.output[0], dtype, out)])
        return
    body = f"    {t} *restrict out = ({t} *)t[{len(copied) + bool(fill)}];\n"
    body += f"    const int64_t width = {dim_c(dims_product([total_axis, row]))};\n"
    body += f"    for (int64_t o = 0; o < {dim_c(outer)}; o++) {{\n"
    for k, j in enumerate(copied):
        body += (f"        memcpy(out + o * width + {dim_c(starts[j])}, (const {t} *)t[{k}] + o * {dim_c(inners[j])}, "
                 f"(size_t){dim_c(inners[j])} * sizeof({t}));\n")
    body += "    }\n"
    syms = tuple(symbols_of([*out, *inners]))
    spec = KernelSpec("concat", source_with_entries("", [("concat", body)], syms), ("concat",), syms)
    inputs = [names[j] for j in copied] + ([fill.buffer] if fill else [])
    ctx.emit(spec, inputs, [(node.output[0], dtype, out)], in_place={0: len(copied)} if fill else None)


@register("Split")
def _split(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    axis = ctx.attr(node, "axis", 0) % len(s)
    n_out = len(node.output)
    if len(node.input) > 1 and node.input[1]:
        sizes = [int(x) for x in ctx.require_const(node.input[1], "Split sizes").reshape(-1)]
    elif ctx.attr(node, "split") is not None:
        sizes = list(ctx.attr(node, "split"))
    else:
        dim = s[axis]
        if isinstance(dim, Mono):
            raise NodeUnsupported("splitting a dynamic axis")
        part = -(-dim // n_out)
        sizes = [min(part, dim - part * i) for i in range(n_out)]
    dtype = ctx.dtype(node.input[0])
    t = ctype(dtype)
    outer = dims_product(s[:axis])
    row = dims_product(s[axis + 1:])
    width = dims_product([s[axis], row])
    if ctx.gpu:
        outs_g = [(node.output[j], dtype, s[:axis] + [size] + s[axis + 1:]) for j, size in enumerate(sizes)]
        ctx.emit(gpu_kernels.split_kernel(s, outer, width, [dims_product([size, row]) for size in sizes], dtype),
                 [node.input[0]], outs_g)
        return
    body = f"    const {t} *restrict in = (const {t} *)t[0];\n"
    body += f"    for (int64_t o = 0; o < {dim_c(outer)}; o++) {{\n        int64_t at = o * {dim_c(width)};\n"
    outs = []
    for j, size in enumerate(sizes):
        inner = dims_product([size, row])
        body += (f"        memcpy((({t} *)t[{1 + j}]) + o * {dim_c(inner)}, in + at, (size_t){dim_c(inner)} * "
                 f"sizeof({t}));\n        at += {dim_c(inner)};\n")
        outs.append((node.output[j], dtype, s[:axis] + [size] + s[axis + 1:]))
    body += "    }\n"
    syms = tuple(symbols_of(s))
    ctx.emit(KernelSpec("split", source_with_entries("", [("split", body)], syms), ("split",), syms),
             [node.input[0]], outs)


@register("Gather")
def _gather(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    data = list(ctx.shape(node.input[0]))
    ind = list(ctx.shape(node.input[1]))
    axis = ctx.attr(node, "axis", 0) % len(data)
    dtype = ctx.dtype(node.input[0])
    it = ctype(ctx.dtype(node.input[1]))
    t = ctype(dtype)
    outer = dims_product(data[:axis])
    inner = dims_product(data[axis + 1:])
    n_idx = dims_product(ind)
    dim = data[axis]
    out = data[:axis] + ind + data[axis + 1:]
    if ctx.gpu:
        ctx.emit(gpu_kernels.gather_kernel(data, ind, out, outer, n_idx, inner, dim, dtype, ctx.dtype(node.input[1])),
                 [node.input[0], node.input[1]], [(node.output[0], dtype, out)])
        return
    body = (f"    const {t} *restrict in = (const {t} *)t[0]; const {it} *restrict idx = (const {it} *)t[1];\n"
            f"    {t} *restrict out = ({t} *)t[2];\n"
            f"    for (int64_t o = 0; o < {dim_c(outer)}; o++)\n"
            f"        for (int64_t j = 0; j < {dim_c(n_idx)}; j++) {{\n"
            f"            int64_t k = (int64_t)idx[j]; if (k < 0) k += {dim_c(dim)};\n"
            f"            if (k < 0 || k >= {dim_c(dim)}) return 1;\n"
            f"            memcpy(out + (o * {dim_c(n_idx)} + j) * {dim_c(inner)}, in + (o * {dim_c(dim)} + k) * "
            f"{dim_c(inner)}, (size_t){dim_c(inner)} * sizeof({t}));\n        }}\n")
    syms = tuple(symbols_of([*data, *ind]))
    ctx.emit(KernelSpec("gather", source_with_entries("", [("gather", body)], syms), ("gather",), syms),
             [node.input[0], node.input[1]], [(node.output[0], dtype, out)])


@register("ConstantOfShape")
def _constant_of_shape(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    v = ctx.value(node.input[0])
    if v is None:
        raise NodeUnsupported("the shape must be computable at import")
    out = [x if isinstance(x, Mono) else int(x) for x in v.reshape(-1)]
    value = ctx.attr(node, "value", None)
    arr = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    dtype = arr.dtype
    t = ctype(dtype)
    if ctx.gpu:
        ctx.emit(gpu_kernels.fill_kernel("fill", out, dtype, lit(arr[0].item(), dtype)), [],
                 [(node.output[0], dtype, out)])
        return
    body = (f"    {t} *restrict out = ({t} *)t[0];\n"
            f"    for (int64_t i = 0; i < {dim_c(dims_product(out))}; i++) out[i] = {lit(arr[0].item(), dtype)};\n")
    syms = tuple(symbols_of(out))
    ctx.emit(KernelSpec("fill", source_with_entries("", [("fill", body)], syms), ("fill",), syms), [],
             [(node.output[0], dtype, out)])


@register("Constant", "Shape", "Size")
def _folded_only(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    """These are always folded at import (``folding``); reaching here means the fold failed."""
    raise NodeUnsupported("cannot be evaluated at import (sparse or unsupported constant, or unknown shape)")


@register("Tile")
def _tile(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    s = list(ctx.shape(node.input[0]))
    reps = [int(r) for r in ctx.require_const(node.input[1], "the Tile repeats").reshape(-1)]
    if len(reps) != len(s) or any(r < 0 for r in reps):
        raise NodeUnsupported(f"repeats {reps} for a rank-{len(s)} input (expected one non-negative count per axis)")
    tables: list[np.ndarray | None] = []
    out: list[Dim] = []
    for k, (d, r) in enumerate(zip(s, reps)):
        if r == 1:
            tables.append(None)
            out.append(d)
        elif isinstance(d, Mono):
            raise NodeUnsupported(f"tiling dynamic axis {k}")
        else:
            tables.append(np.tile(np.arange(int(d), dtype=np.int64), r))
            out.append(int(d) * r)
    dtype = ctx.dtype(node.input[0])
    emit_axis_map(ctx, "tile", node.input[0], node.output[0], out, s, tables, dtype)


@register("Range")
def _range(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    """Folded at import when start, limit and delta are constants (``folding``). A limit that is a
    dynamic dimension (``arange(seq_len)`` in torch exports: ``Range(0, Shape(x)[1], 1)``) with a
    constant start of 0 and a positive integer step becomes a kernel of ``limit / delta`` elements
    (an exact division of the dimension; others are refused); anything else computed at run time is
    refused, as the output length would depend on data."""
    vals = [ctx.value(n) for n in node.input[:3]]
    if any(v is None or v.size != 1 for v in vals):
        raise NodeUnsupported("start, limit and delta must be known at import (the output length depends on them)")
    start, limit, delta = (v.reshape(-1)[0] for v in vals)
    if isinstance(start, Mono) or isinstance(delta, Mono) or int(start) != start or int(delta) != delta \
            or int(start) != 0 or int(delta) <= 0:
        raise NodeUnsupported(f"a Range over a dynamic limit needs start 0 and a positive integer delta, got "
                              f"start {start!r} and delta {delta!r}")
    length = dim_div(limit, int(delta))
    dtype = next((ctx.dtype(n) for n in node.input[:3] if ctx.const(n) is not None), np.dtype("int64"))
    t = ctype(dtype)
    if ctx.gpu:
        ctx.emit(gpu_kernels.fill_kernel("range", [length], dtype, f"i * {int(delta)}"), [],
                 [(node.output[0], dtype, [length])])
        return
    body = (f"    {t} *restrict out = ({t} *)t[0];\n"
            f"    for (int64_t i = 0; i < {dim_c(length)}; i++) out[i] = ({t})(i * {int(delta)});\n")
    syms = tuple(symbols_of([length]))
    ctx.emit(KernelSpec("range", source_with_entries("", [("range", body)], syms), ("range",), syms), [],
             [(node.output[0], dtype, [length])])
