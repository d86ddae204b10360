"""GPU kernels of normalisations, softmax and reductions (``engine_onnx.gpu`` dialect).

Softmax, LayerNormalization and InstanceNormalization normalise rows: one block per row, its
threads striding over the row and combining their partial maximum, sum or squared deviation in a
shared-memory tree (``block_reduce``), so a row of 30000 elements and one of 10 both take one
block (short rows get a smaller block). Statistics are two-pass (mean, then squared deviations
from it), as on the CPU. BatchNormalization with parameters computed at run time is one thread
per element. Reductions (``ReduceSum``…) are one thread per output element looping over the
reduced elements, which keeps any axis set one simple kernel.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from engine_onnx.dims import Dim, Mono, dims_product, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, gpu_ctype, launch_1d, launch_groups, params
from engine_onnx.ops.kernel_exprs import coordinates, lit, offset

__all__ = ["block_reduce", "softmax_kernel", "layernorm_kernel", "instancenorm_kernel", "batchnorm_kernel",
           "reduce_kernel"]

F32 = np.dtype("float32")
#: Threads of a row's block (a power of two: the tree halves it), and the size of its shared array.
ROW_BLOCK = 256


def row_block(d: Dim) -> int:
    """Threads for a row of ``d`` elements: the next power of two from 32 up to ``ROW_BLOCK``."""
    if isinstance(d, Mono):
        return ROW_BLOCK
    block = 32
    while block < min(int(d), ROW_BLOCK):
        block *= 2
    return block


def block_reduce(var: str, combine: Callable[[str, str], str]) -> str:
    """Statements replacing each thread's ``var`` by the block's combination of all of them
    (through the shared ``red``; every thread of the block must reach them)."""
    return (f"    red[t] = {var};\n    BARRIER();\n"
            f"    for (int64_t h = nt / 2; h > 0; h /= 2) {{\n"
            f"        if (t < h) red[t] = {combine('red[t]', 'red[t + h]')};\n        BARRIER();\n    }}\n"
            f"    {var} = red[0];\n    BARRIER();\n")


def _sum(a: str, b: str) -> str:
    return f"{a} + {b}"


def _row_kernel(name: str, entry: str, ins: int, outs: int, symbols: Sequence[str], rows: Dim, d: Dim,
                body: str) -> GpuKernelSpec:
    """A float32 kernel with one block per row (``r``), ``t``/``nt`` its thread and block size."""
    source = (f"KERNEL {entry}({params(['float'] * ins, ['float'] * outs, symbols)}) {{\n"
              f"    SHARED float red[{ROW_BLOCK}];\n"
              f"    const int64_t r = GROUP_ID(0), t = LOCAL_ID(0), nt = LOCAL_SIZE(0);\n{body}}}\n")
    return GpuKernelSpec(name, source, (entry,), (launch_groups(rows, row_block(d)),), tuple(symbols))


def _moments(x: str, d: Dim) -> str:
    """Statements defining ``mean`` and ``var`` (population) of row ``x[0…d)``."""
    D = gdim(d)
    return (f"    float s = 0.0f;\n    for (int64_t j = t; j < {D}; j += nt) s += {x}[j];\n"
            + block_reduce("s", _sum) + f"    const float mean = s / (float){D};\n"
            f"    float q = 0.0f;\n    for (int64_t j = t; j < {D}; j += nt) {{ const float e = {x}[j] - mean; "
            f"q += e * e; }}\n" + block_reduce("q", _sum) + f"    const float var = q / (float){D};\n")


def softmax_kernel(name: str, shape: Sequence[Dim], outer: Dim, dim: Dim, inner: Dim, log: bool) -> GpuKernelSpec:
    """Softmax (or LogSoftmax) over rows of ``dim`` elements ``inner`` apart, ``outer * inner``
    of them: the maximum subtracted, the exponentials summed, then each element written."""
    D, I = gdim(dim), gdim(inner)
    write = "(x[j * I] - m) - ls" if log else "exp(x[j * I] - m) * inv"
    body = f"""    const int64_t D = {D}, I = {I};
    const int64_t base = (r / I) * D * I + r % I;
    const GLOBAL float *x = in0 + base;
    GLOBAL float *y = out0 + base;
    float m = -INFINITY;
    for (int64_t j = t; j < D; j += nt) m = fmax(m, x[j * I]);
{block_reduce("m", lambda a, b: f"fmax({a}, {b})")}    float s = 0.0f;
    for (int64_t j = t; j < D; j += nt) s += exp(x[j * I] - m);
{block_reduce("s", _sum)}    const float {"ls = log(s)" if log else "inv = 1.0f / s"};
    for (int64_t j = t; j < D; j += nt) y[j * I] = {write};
"""
    return _row_kernel(name, "softmax", 1, 1, symbols_of(shape), outer * inner, dim, body)


def layernorm_kernel(shape: Sequence[Dim], outer: Dim, d: Dim, eps: float, has_bias: bool,
                     ep: Callable[[str], str], mean_out: bool, inv_out: bool) -> GpuKernelSpec:
    """LayerNormalization of ``outer`` rows of ``d`` elements: inputs X, scale (and bias) of ``d``
    elements; outputs Y then, when asked, the rows' Mean and InvStdDev."""
    D = gdim(d)
    value = "(x[j] - mean) * inv * in1[j]" + (" + in2[j]" if has_bias else "")
    kept = (["mean"] if mean_out else []) + (["inv"] if inv_out else [])
    stats = "".join(f"    if (t == 0) out{q + 1}[r] = {v};\n" for q, v in enumerate(kept))
    body = (f"    const GLOBAL float *x = in0 + r * {D};\n    GLOBAL float *y = out0 + r * {D};\n"
            + _moments("x", d)
            + f"    const float inv = 1.0f / sqrt(var + {lit(eps, F32)});\n"
            f"    for (int64_t j = t; j < {D}; j += nt) {{ const float v = {value}; y[j] = {ep('v')}; }}\n" + stats)
    return _row_kernel("layernorm", "layernorm", 2 + has_bias, 1 + len(kept), symbols_of(shape), outer, d, body)


def instancenorm_kernel(shape: Sequence[Dim], eps: float, ep: Callable[[str], str]) -> GpuKernelSpec:
    """InstanceNormalization of ``[N, C, spatial…]``: one block per (n, c) plane; scale and bias
    per channel."""
    c, plane = shape[1], dims_product(shape[2:])
    P = gdim(plane)
    body = (f"    const GLOBAL float *x = in0 + r * {P};\n    GLOBAL float *y = out0 + r * {P};\n"
            + _moments("x", plane)
            + f"    const float k = in1[r % {gdim(c)}] / sqrt(var + {lit(eps, F32)}), sh = in2[r % {gdim(c)}];\n"
            f"    for (int64_t j = t; j < {P}; j += nt) {{\n"
            f"        const float v = (x[j] - mean) * k + sh;\n        y[j] = {ep('v')};\n    }}\n")
    return _row_kernel("instancenorm", "instancenorm", 3, 1, symbols_of(shape), shape[0] * c, plane, body)


def batchnorm_kernel(shape: Sequence[Dim], eps: float) -> GpuKernelSpec:
    """Inference BatchNormalization with its scale, bias, mean and variance read at run time
    (inputs 1…4, one value per channel): one thread per element."""
    c, plane = shape[1], dims_product(shape[2:])
    total = dims_product(shape)
    symbols = symbols_of(shape)
    source = f"""KERNEL batchnorm({params(['float'] * 5, ['float'], symbols)}) {{
    const int64_t i = GLOBAL_ID;
    if (i >= {gdim(total)}) return;
    const int64_t ch = (i / {gdim(plane)}) % {gdim(c)};
    const float k = in1[ch] / sqrt(in4[ch] + {lit(eps, F32)}), sh = in2[ch] - in3[ch] * k;
    out0[i] = in0[i] * k + sh;
}}
"""
    return GpuKernelSpec("batchnorm", source, ("batchnorm",), (launch_1d(total),), tuple(symbols))


def _literal(value, dtype: np.dtype) -> str:
    """``value`` as a literal of ``dtype``'s GPU type (the most negative int64 has no literal)."""
    t = gpu_ctype(dtype)
    if dtype.kind == "f":
        return f"(({t}){'INFINITY' if value == np.inf else '(-INFINITY)' if value == -np.inf else repr(float(value))})"
    if int(value) == np.iinfo(np.int64).min:
        return f"(({t})(-9223372036854775807LL - 1))"
    return f"(({t}){int(value)}{'ULL' if dtype.kind == 'u' else 'LL'})"


def reduce_kernel(name: str, shape: Sequence[Dim], reduced: set[int], dtype: np.dtype, init, acc: str,
                  op: str) -> GpuKernelSpec:
    """``op`` (``ReduceSum``…) of ``shape`` over the axes ``reduced``: one thread per output element
    starts from ``init`` and folds every reduced element ``v`` into ``o`` by ``acc``; ReduceMean and
    ReduceL2 then divide by the count or take the root."""
    t = gpu_ctype(dtype)
    strides: list[Dim] = []
    run: Dim = 1
    for d in reversed(shape):
        strides.insert(0, run)
        run = run * d
    # neighbouring axes both kept or both reduced merge (the input is contiguous); size-1 axes vanish
    groups: list[tuple[bool, Dim, Dim]] = []
    for axis, (size, st) in enumerate(zip(shape, strides)):
        if size == 1:
            continue
        red = axis in reduced
        if groups and groups[-1][0] == red:
            groups[-1] = (red, groups[-1][1] * size, st)
        else:
            groups.append((red, size, st))
    kept = [(s, st) for red, s, st in groups if not red]
    loops = [(s, st) for red, s, st in groups if red]
    n_out = dims_product([s for s, _ in kept])
    count = dims_product([s for s, _ in loops])
    body = coordinates([s for s, _ in kept]) + f"    const int64_t base = {offset([st for _, st in kept])};\n"
    body += f"    {t} o = {_literal(init, dtype)};\n"
    for q, (size, _) in enumerate(loops):
        body += "    " * (q + 1) + f"for (int64_t r{q} = 0; r{q} < {gdim(size)}; r{q}++)\n"
    at = " + ".join(f"r{q} * {gdim(st)}" for q, (_, st) in enumerate(loops))
    body += "    " * (len(loops) + 1) + f"{{ const {t} v = in0[base{' + ' + at if at else ''}]; o = {acc}; }}\n"
    if op == "ReduceMean":
        body += f"    o /= ({t}){gdim(count)};\n"
    elif op == "ReduceL2":
        body += f"    o = ({t})sqrt({'o' if dtype.kind == 'f' else '(double)o'});\n"
    body += "    out0[i] = o;\n"
    symbols = symbols_of(shape)
    source = (f"KERNEL reduce({params([t], [t], symbols)}) {{\n    const int64_t i = GLOBAL_ID;\n"
              f"    if (i >= {gdim(n_out)}) return;\n{body}}}\n")
    return GpuKernelSpec(name, source, ("reduce",), (launch_1d(n_out),), tuple(symbols))
