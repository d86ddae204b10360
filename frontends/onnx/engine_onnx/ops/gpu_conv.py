"""GPU kernels for Conv, pooling and LRN (``engine_onnx.gpu`` dialect).

The geometry (channels, spatial sizes, kernel, strides, pads, dilations) is fixed per shape and
written into the source as literals, as the CPU kernels do; only the batch may be a symbol. Every
kernel guards its tail and checks each tap against the input's bounds, so padding reads nothing.

Conv candidates, all reading the weight as the ``[OC, CG*KH*KW]`` matrix the CPU kernels read:

* ``direct``: one thread per output element, looping over the group's input channels and the
  taps;
* ``oc_block`` (where a group has an even number of output channels): each thread computes
  several output channels of one pixel, so every input value it loads serves all of them;
* ``ow_block`` (where an output row has more than one pixel): each thread computes a few
  neighbouring pixels of one output row, so every weight it loads serves all of them (the
  depthwise case, where ``oc_block`` is not offered).

Neighbouring threads take neighbouring pixels of the same output channel in every candidate, so
their weight reads are the same address and their input reads are close together.
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine_onnx.dims import Dim, dims_product, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, launch_1d, launch_groups, params

__all__ = ["conv_kernel", "pool_kernel", "global_pool_kernel", "lrn_kernel"]

#: Output channels per thread of ``oc_block`` (the largest that divides a group's), pixels per
#: thread of ``ow_block``.
OC_BLOCKS = (8, 4, 2)
OW_BLOCK = 4


def _taps(cg: int, kernel: Sequence[int], geo: dict, ows: Sequence[str], body: Callable[[str, str], str]) -> str:
    """The loops over input channels and taps; ``body(k, xs)`` is the update of one tap, ``k`` the
    weight's offset within an output channel's row, ``xs[j]`` the input value at output column
    ``ows[j]`` (``0.0f`` outside the input)."""
    kh_, kw_ = kernel
    lines = [f"    for (int ic = 0; ic < {cg}; ic++) {{",
             f"        GLOBAL const float *xc = x + (int64_t)ic * {geo['H'] * geo['W']};",
             f"        for (int kh = 0; kh < {kh_}; kh++) {{",
             f"            const int ih = ih0 + kh * {geo['DH']};",
             f"            if (ih < 0 || ih >= {geo['H']}) continue;",
             f"            GLOBAL const float *xr = xc + (int64_t)ih * {geo['W']};",
             f"            for (int kw = 0; kw < {kw_}; kw++) {{",
             f"                const int k = (ic * {kh_} + kh) * {kw_} + kw;"]
    xs = []
    for j, ow in enumerate(ows):
        lines.append(f"                const int iw{j} = ({ow}) * {geo['SW']} - {geo['PL']} + kw * {geo['DW']};")
        lines.append(f"                const float x{j} = (iw{j} >= 0 && iw{j} < {geo['W']}) ? xr[iw{j}] : 0.0f;")
        xs.append(f"x{j}")
    lines.append(body("k", xs))
    lines += ["            }", "        }", "    }"]
    return "\n".join(lines) + "\n"


def conv_kernel(n: Dim, c: int, oc: int, group: int, spatial: Sequence[int], kernel: Sequence[int],
                strides: Sequence[int], dil: Sequence[int], pads_begin: Sequence[int], out_sp: Sequence[int],
                residual: bool, ep: Callable[[str], str]) -> GpuKernelSpec:
    """A 2-D Conv (a 1-D one as height 1) of ``n`` images: inputs ``x``, the weight matrix, the bias
    (``[OC]``) and the residual when ``residual`` (same shape as the output); ``ep`` builds the
    fused activations' expression of the biased (and residual-added) sum."""
    H, W = spatial
    KH, KW = kernel
    OH, OW = out_sp
    cg, ocg = c // group, oc // group
    kc = cg * KH * KW
    geo = dict(H=H, W=W, DH=dil[0], DW=dil[1], SW=strides[1], PL=pads_begin[1])
    syms = tuple(symbols_of([n]))
    ins = ["float"] * (4 if residual else 3)
    sig = params(ins, ["float"], syms)
    plane = OH * OW

    def store(idx: str, och: str, value: str) -> str:
        res = f" + in3[{idx}]" if residual else ""
        return f"{{ const float v = {value} + in2[{och}]{res}; out0[{idx}] = {ep('v')}; }}"

    def head(total: Dim, split: str) -> str:
        return (f"    const int64_t i = GLOBAL_ID;\n    if (i >= {gdim(total)}) return;\n{split}"
                f"    GLOBAL const float *x = in0 + (nn * {c} + (int64_t)(oc0 / {ocg}) * {cg}) * {H * W};\n"
                f"    const int ih0 = oh * {strides[0]} - {pads_begin[0]};\n")

    # direct: output element i = ((nn * OC + oc) * OH + oh) * OW + ow
    total = n * (oc * plane)
    split = (f"    const int ow = (int)(i % {OW}), oh = (int)((i / {OW}) % {OH}), oc0 = (int)((i / {plane}) % {oc});\n"
             f"    const int64_t nn = i / {oc * plane};\n")
    body = (head(total, split) + f"    GLOBAL const float *wt = in1 + (int64_t)oc0 * {kc};\n    float acc = 0.0f;\n"
            + _taps(cg, kernel, geo, ["ow"], lambda k, xs: f"                acc += {xs[0]} * wt[{k}];")
            + f"    {store('i', 'oc0', 'acc')}\n")
    sources = [f"KERNEL direct({sig}) {{\n{body}}}\n"]
    entries, launches = ["direct"], [launch_1d(total)]

    ocb = next((b for b in OC_BLOCKS if ocg % b == 0), None)
    if ocb is not None:  # thread i: pixel i % (OH*OW) of channels oc0..oc0+ocb-1
        nb = oc // ocb
        total = n * (nb * plane)
        split = (f"    const int p = (int)(i % {plane}), oh = p / {OW}, ow = p % {OW};\n"
                 f"    const int oc0 = (int)((i / {plane}) % {nb}) * {ocb};\n"
                 f"    const int64_t nn = i / {nb * plane};\n")
        update = lambda k, xs: "\n".join(  # noqa: E731
            f"                acc{j} += {xs[0]} * wt[{j * kc} + {k}];" for j in range(ocb))
        body = (head(total, split) + f"    GLOBAL const float *wt = in1 + (int64_t)oc0 * {kc};\n"
                + "".join(f"    float acc{j} = 0.0f;\n" for j in range(ocb))
                + _taps(cg, kernel, geo, ["ow"], update)
                + f"    const int64_t o = (nn * {oc} + oc0) * {plane} + p;\n"
                + "".join(f"    {store(f'o + {j * plane}', f'oc0 + {j}', f'acc{j}')}\n" for j in range(ocb)))
        sources.append(f"KERNEL oc_block({sig}) {{\n{body}}}\n")
        entries.append("oc_block")
        launches.append(launch_1d(total))

    if OW > 1:  # thread i: pixels ow0..ow0+OW_BLOCK-1 of row (nn, oc, oh), the tail's stores skipped
        nw = -(-OW // OW_BLOCK)
        total = n * (oc * OH * nw)
        split = (f"    const int ow0 = (int)(i % {nw}) * {OW_BLOCK}, oh = (int)((i / {nw}) % {OH}), "
                 f"oc0 = (int)((i / {nw * OH}) % {oc});\n    const int64_t nn = i / {nw * OH * oc};\n")
        update = lambda k, xs: ("                { const float wv = wt[" + k + "]; "  # noqa: E731
                                + " ".join(f"acc{j} += {x} * wv;" for j, x in enumerate(xs)) + " }")
        body = (head(total, split) + f"    GLOBAL const float *wt = in1 + (int64_t)oc0 * {kc};\n"
                + "".join(f"    float acc{j} = 0.0f;\n" for j in range(OW_BLOCK))
                + _taps(cg, kernel, geo, [f"ow0 + {j}" for j in range(OW_BLOCK)], update)
                + f"    const int64_t o = ((nn * {oc} + oc0) * {OH} + oh) * {OW} + ow0;\n"
                + "".join(f"    if (ow0 + {j} < {OW}) {store(f'o + {j}', 'oc0', f'acc{j}')}\n"
                          for j in range(OW_BLOCK)))
        sources.append(f"KERNEL ow_block({sig}) {{\n{body}}}\n")
        entries.append("ow_block")
        launches.append(launch_1d(total))
    return GpuKernelSpec("conv", "\n".join(sources), tuple(entries), tuple(launches), syms)


def pool_kernel(is_max: bool, planes: Dim, g: dict, ep: Callable[[str], str], symbols: Sequence[str]) -> GpuKernelSpec:
    """MaxPool or AveragePool, one thread per output element; ``g`` is the pooling handler's
    geometry (``H, W, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, HE, WE, INCLUDE_PAD``), the window
    and its count taken as its CPU kernel takes them. A maximum skips NaNs (``v > m ? v : m``), as
    the CPU kernel's does; a window with no element gives -inf (max) or 0 (average)."""
    H, W, OH, OW = g["H"], g["W"], g["OH"], g["OW"]
    head = (f"    const int ow = (int)(i % {OW}), oh = (int)((i / {OW}) % {OH});\n"
            f"    GLOBAL const float *x = in0 + (i / {OH * OW}) * {H * W};\n"
            f"    const int h0 = oh * {g['SH']} - {g['PT']}, w0 = ow * {g['SW']} - {g['PL']};\n")
    if is_max:
        body = f"""    float m = -INFINITY;
    for (int kh = 0; kh < {g['KH']}; kh++) {{
        const int ih = h0 + kh * {g['DH']};
        if (ih < 0 || ih >= {H}) continue;
        for (int kw = 0; kw < {g['KW']}; kw++) {{
            const int iw = w0 + kw * {g['DW']};
            if (iw < 0 || iw >= {W}) continue;
            const float v = x[ih * {W} + iw];
            m = v > m ? v : m;
        }}
    }}
    out0[i] = {ep("m")};
"""
    else:
        count = "(h1 - h0) * (w1 - w0)" if g["INCLUDE_PAD"] else "(he - hs) * (we - ws)"
        body = f"""    const int h1 = h0 + {g['KH']} < {g['HE']} ? h0 + {g['KH']} : {g['HE']};
    const int w1 = w0 + {g['KW']} < {g['WE']} ? w0 + {g['KW']} : {g['WE']};
    const int hs = h0 < 0 ? 0 : h0, ws = w0 < 0 ? 0 : w0;
    const int he = h1 > {H} ? {H} : h1, we = w1 > {W} ? {W} : w1;
    float s = 0.0f;
    for (int ih = hs; ih < he; ih++)
        for (int iw = ws; iw < we; iw++) s += x[ih * {W} + iw];
    const int cnt = {count};
    out0[i] = {ep("(cnt > 0 ? s / (float)cnt : 0.0f)")};
"""
    total = planes * (OH * OW)
    source = (f"KERNEL pool({params(['float'], ['float'], symbols)}) {{\n"
              f"    const int64_t i = GLOBAL_ID;\n    if (i >= {gdim(total)}) return;\n{head}{body}}}\n")
    return GpuKernelSpec("maxpool" if is_max else "averagepool", source, ("pool",), (launch_1d(total),),
                         tuple(symbols))


def global_pool_kernel(is_max: bool, planes: Dim, size: int, ep: Callable[[str], str],
                       symbols: Sequence[str]) -> GpuKernelSpec:
    """GlobalMaxPool or GlobalAveragePool over ``planes`` planes of ``size`` elements. Candidates:
    ``plane_block``, one block per plane reducing through shared memory (a large plane), and
    ``plane_thread``, one thread per plane (many small planes)."""
    combine = (lambda a, b: f"({b} > {a} ? {b} : {a})") if is_max else (lambda a, b: f"({a} + {b})")
    init = "-INFINITY" if is_max else "0.0f"
    result = ep("m") if is_max else ep(f"(m / (float){size})")
    sig = params(["float"], ["float"], symbols)
    block = 32
    while block < min(size, 256):
        block *= 2
    tree = ""
    s = block // 2
    while s:
        tree += f"    if (t < {s}) part[t] = {combine('part[t]', f'part[t + {s}]')};\n    BARRIER();\n"
        s //= 2
    source = f"""KERNEL plane_block({sig}) {{
    SHARED float part[{block}];
    const int64_t p = GROUP_ID(0);
    const int t = (int)LOCAL_ID(0);
    GLOBAL const float *x = in0 + p * {size};
    float m = {init};
    for (int k = t; k < {size}; k += {block}) m = {combine('m', 'x[k]')};
    part[t] = m;
    BARRIER();
{tree}    if (t == 0) {{
        m = part[0];
        out0[p] = {result};
    }}
}}

KERNEL plane_thread({sig}) {{
    const int64_t p = GLOBAL_ID;
    if (p >= {gdim(planes)}) return;
    GLOBAL const float *x = in0 + p * {size};
    float m = {init};
    for (int k = 0; k < {size}; k++) m = {combine('m', 'x[k]')};
    out0[p] = {result};
}}
"""
    name = "globalmaxpool" if is_max else "globalaveragepool"
    return GpuKernelSpec(name, source, ("plane_block", "plane_thread"),
                         (launch_groups(planes, block), launch_1d(planes)), tuple(symbols))


def lrn_kernel(shape: Sequence[Dim], size: int, alpha: float, beta: float, bias: float) -> GpuKernelSpec:
    """LRN across channels, one thread per element: ``x / pow(bias + alpha / size * sum(x^2), beta)``
    over the channels ``c - (size-1)/2 … c + size-1-(size-1)/2`` clipped to the tensor, as the CPU
    kernel computes it."""
    c = int(shape[1])
    plane = int(dims_product(shape[2:]))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    symbols = tuple(symbols_of(shape))
    total = dims_product(shape)
    source = f"""KERNEL lrn({params(['float'], ['float'], symbols)}) {{
    const int64_t i = GLOBAL_ID;
    if (i >= {gdim(total)}) return;
    const int64_t r = i % {plane}, n = i / {c * plane};
    const int ch = (int)((i / {plane}) % {c});
    const int c0 = ch - {lo} < 0 ? 0 : ch - {lo}, c1 = ch + {hi} > {c - 1} ? {c - 1} : ch + {hi};
    float s = 0.0f;
    for (int cc = c0; cc <= c1; cc++) {{
        const float v = in0[(n * {c} + cc) * {plane} + r];
        s += v * v;
    }}
    out0[i] = in0[i] / pow({bias!r}f + {alpha / size!r}f * s, {beta!r}f);
}}
"""
    return GpuKernelSpec("lrn", source, ("lrn",), (launch_1d(total),), symbols)
