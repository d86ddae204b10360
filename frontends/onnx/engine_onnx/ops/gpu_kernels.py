"""GPU kernels for elementwise groups and data movement (``engine_onnx.gpu`` dialect).

One thread per output element: the thread splits its flat index into the coordinates of the merged
loop nest the CPU kernels use (``kernel_exprs.loop_nest``, ``shape.strided_copy_source``'s axis
merging) and reads each input at its own strides. These are the straightforward candidates; they
are memory-bound, so the index arithmetic is not what limits them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine_onnx.dims import Dim, dims_product, merge_axes, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, gpu_ctype, launch_1d, params
from engine_onnx.ops.kernel_exprs import coordinates, loop_nest, offset

__all__ = ["group_kernel", "strided_copy_kernel", "copy_kernel", "fill_kernel",
           "concat_kernel", "split_kernel", "gather_kernel"]


def _kernel(name: str, entry: str, ins: Sequence[str], outs: Sequence[str], symbols: Sequence[str],
            total: Dim, body: str) -> GpuKernelSpec:
    source = (f"KERNEL {entry}({params(ins, outs, symbols)}) {{\n"
              f"    const int64_t i = GLOBAL_ID;\n    if (i >= {gdim(total)}) return;\n{body}}}\n")
    return GpuKernelSpec(name, source, (entry,), (launch_1d(total),), tuple(symbols))


def group_kernel(name: str, steps, out_dtype: np.dtype, out_shape: Sequence[Dim], leaf_shapes: Sequence[Sequence[Dim]],
                 leaf_dtypes: Sequence[np.dtype], scalars: dict[int, str], held) -> GpuKernelSpec:
    """An elementwise group (``elementwise.Group``'s steps) as one thread per output element;
    ``scalars`` maps a leaf position to a literal used instead of reading a tensor, ``held(dtype,
    value)`` gives an intermediate's C type and initialiser."""
    sizes, strides = loop_nest(out_shape, leaf_shapes)
    tensor_leaves = [j for j in range(len(leaf_shapes)) if j not in scalars]
    symbols = symbols_of([*out_shape, *[d for s in leaf_shapes for d in s]])
    body = coordinates(sizes)
    values: list[str] = []
    slot = {j: k for k, j in enumerate(tensor_leaves)}
    for j in range(len(leaf_shapes)):
        if j in scalars:
            values.append(scalars[j])
        else:
            t = gpu_ctype(leaf_dtypes[j])
            body += f"    const {t} a{j} = in{slot[j]}[{offset(strides[j])}];\n"
            values.append(f"a{j}")
    out_t = gpu_ctype(out_dtype)
    step_values: list[str] = []
    for k, step in enumerate(steps):
        args = [values[i] if kind == "leaf" else step_values[i] for kind, i in step.operands]
        value = step.expr(args)
        if k == len(steps) - 1:
            body += f"    out0[i] = ({out_t})({value});\n"
        else:
            gpu_ctype(step.dtype)
            ht, init = held(step.dtype, value)
            body += f"    const {ht} v{k} = {init};\n"
            step_values.append(f"v{k}")
    ins = [gpu_ctype(leaf_dtypes[j]) for j in tensor_leaves]
    return _kernel(name, "elementwise", ins, [out_t], symbols, dims_product(out_shape), body)


def strided_copy_kernel(name: str, out_shape: Sequence[Dim], in_strides: Sequence[Dim], base: Dim,
                        dtype: np.dtype, in_size: Dim | None = None) -> GpuKernelSpec:
    """``out[c...] = in[base + sum(c_k * in_strides[k])]`` (Transpose, Slice, Expand). With
    ``in_size``, reads are clamped to the input's last element: for an output dimension that a run
    may make larger than the input allows (the CPU kernel fails there; a GPU kernel cannot)."""
    sizes, strides = merge_axes(out_shape, in_strides)
    t = gpu_ctype(dtype)
    at = f"{gdim(base)} + {offset(strides)}"
    if in_size is not None:
        at = f"min({at}, {gdim(in_size)} - 1)"
    body = coordinates(sizes) + f"    out0[i] = in0[{at}];\n"
    symbols = symbols_of([*out_shape, base, *in_strides, *([in_size] if in_size is not None else [])])
    return _kernel(name, "copy", [t], [t], symbols, dims_product(out_shape), body)


def copy_kernel(shape: Sequence[Dim], dtype: np.dtype) -> GpuKernelSpec:
    """A contiguous copy."""
    t = gpu_ctype(dtype)
    return _kernel("copy", "copy", [t], [t], symbols_of(shape), dims_product(shape), "    out0[i] = in0[i];\n")


def fill_kernel(name: str, shape: Sequence[Dim], dtype: np.dtype, value: str) -> GpuKernelSpec:
    """Every element set to the C expression ``value`` (may use the flat index ``i``)."""
    t = gpu_ctype(dtype)
    return _kernel(name, "fill", [], [t], symbols_of(shape), dims_product(shape), f"    out0[i] = ({t})({value});\n")


def concat_kernel(outer: Dim, inners: Sequence[Dim], starts: Sequence[Dim], dtype: np.dtype,
                  out_shape: Sequence[Dim]) -> GpuKernelSpec:
    """``out[o, starts[j] + r] = in_j[o, r]``: each output element finds its input by position
    (``inners[j]`` elements of input ``j`` per outer index ``o``)."""
    t = gpu_ctype(dtype)
    width = starts[-1]
    body = f"    const int64_t o = i / {gdim(width)}, r = i % {gdim(width)};\n"
    for j, inner in enumerate(inners):
        cond = f"if (r < {gdim(starts[j + 1])}) " if j < len(inners) - 1 else ""
        body += (f"    {'else ' if j else ''}{cond}out0[i] = in{j}[o * {gdim(inner)} + r - {gdim(starts[j])}];\n")
    symbols = symbols_of([*out_shape, *inners, outer])
    return _kernel("concat", "concat", [t] * len(inners), [t], symbols, dims_product(out_shape), body)


def split_kernel(in_shape: Sequence[Dim], outer: Dim, width: Dim, inners: Sequence[Dim],
                 dtype: np.dtype) -> GpuKernelSpec:
    """The inverse of ``concat_kernel``: one thread per input element writes it to its output."""
    t = gpu_ctype(dtype)
    body = f"    const int64_t o = i / {gdim(width)}, r = i % {gdim(width)};\n"
    start: Dim = 0
    for j, inner in enumerate(inners):
        body += (f"    if (r >= {gdim(start)} && r < {gdim(start + inner)}) "
                 f"out{j}[o * {gdim(inner)} + r - {gdim(start)}] = in0[i];\n")
        start = start + inner
    symbols = symbols_of([*in_shape, outer, width, *inners])
    return _kernel("split", "split", [t], [t] * len(inners), symbols, dims_product(in_shape), body)


def gather_kernel(data: Sequence[Dim], indices: Sequence[Dim], out_shape: Sequence[Dim], outer: Dim, n_idx: Dim,
                  inner: Dim, dim: Dim, dtype: np.dtype, index_dtype: np.dtype) -> GpuKernelSpec:
    """``out[o, j, r] = in[o, idx[j], r]`` with negative indices counted from the end. An index out
    of range gives 0 (a GPU kernel cannot fail; the CPU kernel reports it)."""
    t = gpu_ctype(dtype)
    it = gpu_ctype(index_dtype)
    body = (f"    const int64_t r = i % {gdim(inner)}, j = (i / {gdim(inner)}) % {gdim(n_idx)}, "
            f"o = i / ({gdim(inner)} * {gdim(n_idx)});\n"
            f"    int64_t k = (int64_t)in1[j];\n    if (k < 0) k += {gdim(dim)};\n"
            f"    out0[i] = (k < 0 || k >= {gdim(dim)}) ? ({t})0 : in0[(o * {gdim(dim)} + k) * {gdim(inner)} + r];\n")
    symbols = symbols_of([*data, *indices, *out_shape])
    return _kernel("gather", "gather", [t, it], [t], symbols, dims_product(out_shape), body)
