"""The CPU kernel of a Conv over three spatial axes (NCDHW; written for any rank): one direct kernel.

The 2-D Conv's candidates (``conv.py``) are tuned for image models; a volumetric Conv gets the
direct form of ``conv_direct`` instead, generalised to more axes: output planes (image x output
channel) shared out to the threads (``parallel_rows``, AVX2 where the machine has it), each plane
accumulated tap by tap, the innermost loop along the output row clipped to the columns whose input
lies inside the row, so it has no branch and vectorises; the outer axes skip the padding per row.
The weight is the ``[OC, CG*taps]`` matrix the 2-D candidates read (BatchNorm and channel scales
already folded in), bias, residual and activation applied per plane once it is summed.
"""

from __future__ import annotations

from typing import Callable

from engine_onnx.codegen import PARALLEL_WORK, KernelSpec, parallel_rows, source_with_entries
from engine_onnx.dims import Dim, dim_c, dims_product, symbols_of
from engine_onnx.ops.window_nd import Window

__all__ = ["conv_nd_spec"]


def _plane_updates(w: Window) -> str:
    """The taps of one (output plane, input channel) pair: ``x`` the input plane, ``wt`` its
    weights, ``y`` the output plane being summed."""
    last = w.rank - 1
    sl, dl, pl, il, ol = w.strides[last], w.dilations[last], w.begin[last], w.spatial[last], w.out[last]
    lines, pad = [], "            "
    for a in range(w.rank):
        lines.append(f"{pad}for (int64_t k{a} = 0; k{a} < {w.kernel[a]}; k{a}++)")
        pad += "    "
    tap = "k0"
    for a in range(1, w.rank):
        tap = f"({tap}) * {w.kernel[a]} + k{a}"
    lines += [f"{pad[:-4]}{{",
              f"{pad}const float wv = wt[{tap}];",
              f"{pad}const int64_t off = k{last} * {dl} - {pl};",
              f"{pad}const int64_t lo = off >= 0 ? 0 : (-off + {sl - 1}) / {sl};",
              f"{pad}int64_t hi = {il} - off <= 0 ? 0 : ({il} - off + {sl - 1}) / {sl};",
              f"{pad}if (hi > {ol}) hi = {ol};"]
    inner = pad
    for a in range(last):
        lines.append(f"{inner}for (int64_t o{a} = 0; o{a} < {w.out[a]}; o{a}++) {{")
        inner += "    "
        lines.append(f"{inner}const int64_t i{a} = o{a} * {w.strides[a]} - {w.begin[a]} + k{a} * {w.dilations[a]};")
        lines.append(f"{inner}if (i{a} < 0 || i{a} >= {w.spatial[a]}) continue;")
    row_in, row_out = "i0", "o0"
    for a in range(1, last):
        row_in, row_out = f"({row_in}) * {w.spatial[a]} + i{a}", f"({row_out}) * {w.out[a]} + o{a}"
    if not last:  # one spatial axis: the plane is one row
        row_in = row_out = "0"
    lines += [f"{inner}const float *xr = x + ({row_in}) * {il};",
              f"{inner}float *yr = y + ({row_out}) * {ol};",
              f"{inner}for (int64_t ow = lo; ow < hi; ow++) yr[ow] += wv * xr[ow * {sl} + off];"]
    lines += [pad[:-4] + "    " * (a + 1) + "}" for a in reversed(range(last))]
    lines.append(f"{pad[:-4]}}}")
    return "\n".join(lines) + "\n"


def conv_nd_spec(n: Dim, c: int, oc: int, group: int, w: Window, residual: bool,
                 ep: Callable[[str], str]) -> KernelSpec:
    """The Conv of ``n`` images of ``c`` channels into ``oc`` in ``group`` groups over window ``w``:
    inputs ``x``, the weight matrix, the bias (``[OC]``) and, with ``residual``, a tensor shaped as the
    output added before ``ep`` (the fused activations' expression builder)."""
    cg, ocg = c // group, oc // group
    plane = w.out_plane
    decls = ("    const float *X = (const float *)t[0], *Wt = (const float *)t[1], *Bv = (const float *)t[2];\n"
             f"    const float *R = (const float *){'t[3]' if residual else 'X'}; (void)R;\n"
             f"    float *Y = (float *)t[{3 + residual}];\n")
    res = " + res[i]" if residual else ""
    row = f"""        const int64_t nn = r / {oc}, oc = r % {oc}, g = oc / {ocg};
        float *y = Y + r * {plane};
        const float *res = R + r * {plane}; (void)res;
        const float bias = Bv[oc];
        for (int64_t i = 0; i < {plane}; i++) y[i] = 0.0f;
        for (int64_t ic = 0; ic < {cg}; ic++) {{
            const float *x = X + (nn * {c} + g * {cg} + ic) * {w.in_plane};
            const float *wt = Wt + (oc * {cg} + ic) * {w.taps};
{_plane_updates(w)}        }}
        for (int64_t i = 0; i < {plane}; i++) y[i] = {ep(f"(y[i] + bias{res})")};
"""
    syms = tuple(symbols_of([n]))
    work = dims_product([n, oc * plane * cg * w.taps])
    fn, body = parallel_rows("conv_nd", syms, decls, f"{dim_c(n)} * {oc}", row, work, PARALLEL_WORK)
    return KernelSpec("conv", source_with_entries(fn, [("conv_nd", body)], syms), ("conv_nd",), syms)
