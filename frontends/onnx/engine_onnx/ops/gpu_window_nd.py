"""GPU kernels of a Conv, MaxPool or AveragePool over three spatial axes (``engine_onnx.gpu`` dialect).

One thread per output element, as the 2-D ``gpu_conv`` kernels' ``direct``: the thread splits its
index into image, channel and output coordinates and runs ``window_nd``'s loops, the ones the CPU
kernels run, so the window, the padding skipped and an average's count are the same on every kind.
Neighbouring threads take neighbouring output columns of one channel, so their weight reads are
the same address and their input reads close together. Only the batch may be a symbol.
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine_onnx.dims import Dim, dims_product, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, launch_1d, params
from engine_onnx.ops.window_nd import Window, average_window, max_window, split_index, tap_loops, window_starts

__all__ = ["conv_nd_kernel", "pool_nd_kernel"]


def _head(total: Dim, w: Window, lead: Sequence[int], names: Sequence[str], rest: str) -> str:
    """The thread's guard, its output coordinates ``o<a>`` (after the ``lead`` axes ``names``; the
    outermost index left in ``rest``) and its window's starts."""
    outs = [f"o{a}" for a in range(w.rank)]
    return (f"    const int64_t i = GLOBAL_ID;\n    if (i >= {gdim(total)}) return;\n"
            + split_index("i", [*lead, *w.out], [*names, *outs], rest)
            + window_starts(w, dict(enumerate(outs))))


def conv_nd_kernel(n: Dim, c: int, oc: int, group: int, w: Window, residual: bool,
                   ep: Callable[[str], str]) -> GpuKernelSpec:
    """The Conv of ``n`` images as ``conv_nd.conv_nd_spec`` takes it (inputs ``x``, the weight
    matrix, the bias, the residual when ``residual``), one candidate: ``direct``."""
    cg, ocg = c // group, oc // group
    total = n * (oc * w.out_plane)
    syms = tuple(symbols_of([n]))
    res = " + in3[i]" if residual else ""
    body = (_head(total, w, [oc], ["oc"], "nn")
            + f"    GLOBAL const float *x = in0 + (nn * {c} + (oc / {ocg}) * {cg}) * {w.in_plane};\n"
            + f"    GLOBAL const float *wt = in1 + oc * {cg * w.taps};\n    float acc = 0.0f;\n"
            + f"    for (int64_t ic = 0; ic < {cg}; ic++) {{\n"
            + f"        GLOBAL const float *xc = x + ic * {w.in_plane};\n"
            + f"        GLOBAL const float *wc = wt + ic * {w.taps};\n"
            + tap_loops(w, lambda k, xi: f"acc += xc[{xi}] * wc[{k}];", "        ")
            + f"    }}\n    {{ const float v = acc + in2[oc]{res}; out0[i] = {ep('v')}; }}\n")
    sig = params(["float"] * (4 if residual else 3), ["float"], syms)
    return GpuKernelSpec("conv", f"KERNEL direct({sig}) {{\n{body}}}\n", ("direct",), (launch_1d(total),), syms)


def pool_nd_kernel(is_max: bool, planes: Dim, w: Window, include_pad: bool, ep: Callable[[str], str],
                   symbols: Sequence[str]) -> GpuKernelSpec:
    """MaxPool (``is_max``) or AveragePool of ``planes`` planes, one thread per output element."""
    total = dims_product([planes, w.out_plane])
    value = (max_window(w, "x") + f"    out0[i] = {ep('m')};\n" if is_max
             else average_window(w, include_pad, "x") + f"    out0[i] = {ep('a')};\n")
    body = (_head(total, w, [], [], "p") + f"    GLOBAL const float *x = in0 + p * {w.in_plane};\n" + value)
    source = f"KERNEL pool({params(['float'], ['float'], symbols)}) {{\n{body}}}\n"
    return GpuKernelSpec("maxpool" if is_max else "averagepool", source, ("pool",), (launch_1d(total),),
                         tuple(symbols))
