"""Resize (opsets 10 to 19+) and Upsample: nearest (every rounding mode), linear and cubic (with
``antialias``, ``exclude_outside``, ``cubic_coeff_a``), every ``coordinate_transformation_mode``
including ``tf_crop_and_resize`` with its ``extrapolation_value``, ``axes`` and
``keep_aspect_ratio_policy``; scales, sizes and roi known at import.

Resize is separable: along each resized axis, output position ``o`` reads a few input positions
with fixed weights. Those taps are computed here at import, in float64, by the same rules as ONNX's
reference evaluator (coordinate transform, then the mode's coefficients over the nearest inputs,
clamped to the edge), so the kernel holds only tables. Nearest resizing has one tap of weight 1
and becomes an ``axis_map`` copy (any dtype); linear and cubic sum the products of the axes' taps
(float types, accumulated in float). Axes that are not resized (a dynamic batch) are copied.
On GPU kinds the same tables reach one thread per output element as weight inputs
(``gpu_indexing``). Opset 10's Resize and Upsample have no transformation attribute: they are
``asymmetric`` with ``floor`` rounding for nearest, as their specifications' examples compute.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from engine_onnx.codegen import KernelSpec, ctype, source_with_entries
from engine_onnx.dims import Mono, dim_c, dims_product, symbols_of
from engine_onnx.errors import NodeUnsupported
from engine_onnx.ops.axis_map import emit_axis_map
from engine_onnx.ops.context import LoweringContext
from engine_onnx.ops.gpu_indexing import taps_kernel
from engine_onnx.ops.kernel_exprs import lit
from engine_onnx.ops.registry import register

_CTMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
         "tf_crop_and_resize")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _coeffs(mode: str, ratio: float, scale: float, *, nearest_mode: str, a: float, antialias: bool) -> np.ndarray:
    """The interpolation weights of one output position (ONNX's definitions)."""
    if mode == "nearest":
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        up = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False,
              "ceil": True}[nearest_mode]
        return np.array([0.0, 1.0]) if up else np.array([1.0, 0.0])
    if mode == "linear":
        if not antialias:
            return np.array([1 - ratio, ratio])
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        args = (np.arange(start, start + 2 - 2 * start) - ratio) * s
        c = np.clip(1 - np.abs(args), 0, 1)
        return c / c.sum()
    if not antialias:
        r = ratio
        return np.array([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                         ((a + 2) * r - (a + 3)) * r * r + 1,
                         ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                         ((a * ((1 - r) + 1) - 5 * a) * ((1 - r) + 1) + 8 * a) * ((1 - r) + 1) - 4 * a])
    s = min(scale, 1.0)

    def k(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
        return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a if x < 2 else 0.0
    start = int(np.floor(-2 / s) + 1)
    c = np.array([k(s * (i - ratio)) for i in range(start, 2 - start)])
    return c / c.sum()


def axis_taps(n_in: int, scale: float, n_out: int, *, mode: str, ctm: str, nearest_mode: str, a: float,
              antialias: bool, exclude_outside: bool, roi: tuple[float, float] | None):
    """(indices [n_out, T], weights [n_out, T], extrapolated [n_out]) of one resized axis."""
    width = scale * n_in
    y = np.arange(n_out, dtype=np.float64)
    extrap = np.zeros(n_out, dtype=bool)
    if ctm == "align_corners":
        x = np.zeros(n_out) if width == 1 else y * (n_in - 1) / (width - 1)
    elif ctm == "asymmetric":
        x = y / scale
    elif ctm == "tf_crop_and_resize":
        lo, hi = roi if roi is not None else (0.0, 1.0)
        x = np.full(n_out, (hi - lo) * (n_in - 1) / 2) if width == 1 else y * (hi - lo) * (n_in - 1) / (width - 1)
        x = x + lo * (n_in - 1)
        extrap = (x < 0) | (x > n_in - 1)
    elif ctm == "pytorch_half_pixel":
        x = np.full(n_out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    else:  # half_pixel_symmetric
        x = n_in / 2 * (1 - n_out / width) + (y + 0.5) / scale - 0.5
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)
    coeffs = np.array([_coeffs(mode, float(r), scale, nearest_mode=nearest_mode, a=a, antialias=antialias)
                       for r in ratios]).reshape(n_out, -1)
    taps = coeffs.shape[1]
    pad = int(math.ceil(taps / 2))
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if taps % 2 == 0:
        off = np.where(frac == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        off = np.where(frac <= 0.5, -((taps - 1) // 2), -((taps - 1) // 2) + 1)
    idx = (p + off)[:, None] + np.arange(taps)[None, :] - pad
    if exclude_outside:
        coeffs = np.where((idx < 0) | (idx >= n_in), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, n_in - 1), coeffs, extrap


def _params(ctx: LoweringContext, node: onnx.NodeProto, rank: int):
    """(scales or None, sizes or None, roi or None, axes) from the inputs or attributes of ``node``."""
    def opt(i: int, what: str):
        if len(node.input) > i and node.input[i]:
            v = ctx.require_const(node.input[i], what).reshape(-1)
            return v if v.size else None
        return None
    if node.op_type == "Upsample" or ctx.opset < 11:
        scales = ctx.attr(node, "scales") if ctx.opset < 9 else opt(1, f"the {node.op_type} scales")
        if scales is None:
            raise NodeUnsupported(f"{node.op_type} without scales")
        return np.asarray(scales, np.float64), None, None, list(range(rank))
    roi, scales = opt(1, "the Resize roi"), opt(2, "the Resize scales")
    sizes = opt(3, "the Resize sizes")
    axes = [int(a) % rank for a in ctx.attr(node, "axes", range(rank))]
    return (None if scales is None else scales.astype(np.float64)), sizes, roi, axes


@register("Resize", "Upsample")
def _resize(ctx: LoweringContext, node: onnx.NodeProto) -> None:
    x = node.input[0]
    xs = list(ctx.shape(x))
    rank = len(xs)
    dt = ctx.dtype(x)
    old = node.op_type == "Upsample" or ctx.opset < 11
    mode = ctx.attr(node, "mode", "nearest")
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(mode, mode)
    if mode not in ("nearest", "linear", "cubic") or (old and mode == "cubic"):
        raise NodeUnsupported(f"mode={mode!r}")
    ctm = "asymmetric" if old else ctx.attr(node, "coordinate_transformation_mode", "half_pixel")
    nearest_mode = "floor" if old else ctx.attr(node, "nearest_mode", "round_prefer_floor")
    if ctm not in _CTMS:
        raise NodeUnsupported(f"coordinate_transformation_mode={ctm!r} (expected one of {', '.join(_CTMS)})")
    if nearest_mode not in _NEAREST:
        raise NodeUnsupported(f"nearest_mode={nearest_mode!r} (expected one of {', '.join(_NEAREST)})")
    antialias = bool(ctx.attr(node, "antialias", 0))
    if antialias and mode == "nearest":
        raise NodeUnsupported("antialias with mode='nearest' (ONNX defines it for linear and cubic only)")
    if mode != "nearest" and dt.kind != "f":
        raise NodeUnsupported(f"{mode} Resize on {dt.name} (float types only; nearest takes any type)")
    scales, sizes, roi, axes = _params(ctx, node, rank)
    if (scales is None) == (sizes is None):
        raise NodeUnsupported("exactly one of scales and sizes must be given")
    given = scales if scales is not None else sizes
    if len(given) != len(axes):
        raise NodeUnsupported(f"{len(given)} scales or sizes for {len(axes)} axes")
    full_scale = [1.0] * rank
    full_roi = [0.0] * rank + [1.0] * rank
    if roi is not None:
        if len(roi) != 2 * len(axes):
            raise NodeUnsupported(f"roi of {len(roi)} values for {len(axes)} axes (expected starts then ends)")
        for i, d in enumerate(axes):
            full_roi[d], full_roi[rank + d] = float(roi[i]), float(roi[len(axes) + i])
    static = {d: xs[d] for d in axes if not isinstance(xs[d], Mono)}
    if sizes is not None:
        out: list = list(xs)
        for i, d in enumerate(axes):
            if d not in static:
                raise NodeUnsupported(f"resizing dynamic axis {d}")
            full_scale[d] = int(sizes[i]) / static[d]
            out[d] = int(sizes[i])
        policy = ctx.attr(node, "keep_aspect_ratio_policy", "stretch")
        if policy not in ("stretch", "not_larger", "not_smaller"):
            raise NodeUnsupported(f"keep_aspect_ratio_policy={policy!r}")
        if policy != "stretch":
            s = (min if policy == "not_larger" else max)(full_scale[d] for d in axes)
            for d in axes:
                full_scale[d] = s
                out[d] = int(s * static[d] + 0.5)
    else:
        out = list(xs)
        for i, d in enumerate(axes):
            full_scale[d] = float(scales[i])
            if d not in static:
                if full_scale[d] == 1.0:
                    continue
                raise NodeUnsupported(f"resizing dynamic axis {d}")
            out[d] = int(np.float64(scales[i]) * static[d])
    tables = []
    for d in range(rank):
        if isinstance(xs[d], Mono) or (math.isclose(full_scale[d], 1.0) and out[d] == xs[d] and
                                       math.isclose(full_roi[d], 0.0) and math.isclose(full_roi[rank + d], 1.0)):
            tables.append(None)
            continue
        if out[d] <= 0:
            raise NodeUnsupported(f"empty output along axis {d}")
        tables.append(axis_taps(int(xs[d]), full_scale[d], int(out[d]), mode=mode, ctm=ctm,
                                nearest_mode=nearest_mode, a=float(ctx.attr(node, "cubic_coeff_a", -0.75)),
                                antialias=antialias, exclude_outside=bool(ctx.attr(node, "exclude_outside", 0)),
                                roi=(full_roi[d], full_roi[rank + d])))
    ev = float(ctx.attr(node, "extrapolation_value", 0.0))
    if all(tab is None for tab in tables):  # no axis changes: the input's bytes, whatever the mode
        ctx.alias(node.output[0], x, out)
        return
    if mode == "nearest":
        maps = []
        for tab in tables:
            if tab is None:
                maps.append(None)
                continue
            idx, w, extrap = tab
            pick = idx[np.arange(len(idx)), np.argmax(w, axis=1)]
            maps.append(np.where(extrap, -1, pick))
        fill = ev if dt.kind == "f" else int(ev)
        emit_axis_map(ctx, "resize", x, node.output[0], out, xs, maps, dt, fill)
        return
    if ctx.gpu:
        spec, idx, weights = taps_kernel(out, xs, tables, dt, lit(ev, dt))
        ctx.emit(spec, [x, ctx.add_weight(idx, f"{node.output[0]}.resize_indices"),
                        ctx.add_weight(weights, f"{node.output[0]}.resize_weights")], [(node.output[0], dt, out)])
        return
    ctx.emit(_weighted_spec(out, xs, tables, dt, ev), [x], [(node.output[0], dt, out)])


def _weighted_spec(out, xs, tables, dt, ev: float) -> KernelSpec:
    """``out[o] = sum over the taps of every resized axis of prod(weights) * in[indices]``."""
    t = ctype(dt)
    rank = len(out)
    pre = []
    strides = [dims_product(xs[k + 1:]) for k in range(rank)]
    for k, tab in enumerate(tables):
        if tab is None:
            continue
        idx, w, extrap = tab
        idx = np.where(extrap[:, None], -1, idx)
        pre.append(f"#define T{k} {idx.shape[1]}")
        pre.append(f"static const int64_t I{k}[{idx.size}] = {{{', '.join(str(int(v)) for v in idx.reshape(-1))}}};")
        weights = ", ".join(float(np.float32(v)).hex() for v in w.reshape(-1))
        pre.append(f"static const float W{k}[{w.size}] = {{{weights}}};")
    body = [f"    const {t} *restrict X = (const {t} *)t[0]; {t} *restrict P = ({t} *)t[1];"]
    ind = "    "
    for k in range(rank):
        if k == 0:  # blocks of the outermost axis are independent: threads share them out
            body.append(f"{ind}#pragma omp parallel for schedule(static) if ({dim_c(dims_product(out))} >= 65536)")
        body.append(f"{ind}for (int64_t o{k} = 0; o{k} < {dim_c(out[k])}; o{k}++) {{")
        ind += "    "
        if k == 0:
            body.append(f"{ind}{t} *restrict p = P + o0 * {dim_c(dims_product(out[1:]))};")
        if tables[k] is not None:
            body.append(f"{ind}if (I{k}[o{k} * T{k}] < 0) {{ for (int64_t j = 0; j < "
                        f"{dim_c(dims_product(out[k + 1:]))}; j++) *p++ = ({t}){lit(ev, np.float32)}; continue; }}")
    base = " + ".join(f"o{k} * {dim_c(strides[k])}" for k in range(rank) if tables[k] is None) or "0"
    body.append(f"{ind}const int64_t base = {base};")
    body.append(f"{ind}float acc = 0.0f;")
    resized = [k for k in range(rank) if tables[k] is not None]
    inner = ind
    for k in resized:
        prev = f"w{resized[resized.index(k) - 1]}" if resized.index(k) else "1.0f"
        prev_off = f"f{resized[resized.index(k) - 1]}" if resized.index(k) else "base"
        body.append(f"{inner}for (int64_t t{k} = 0; t{k} < T{k}; t{k}++) {{")
        inner += "    "
        body.append(f"{inner}const float w{k} = {prev} * W{k}[o{k} * T{k} + t{k}];")
        body.append(f"{inner}const int64_t f{k} = {prev_off} + I{k}[o{k} * T{k} + t{k}] * {dim_c(strides[k])};")
    last = resized[-1]
    body.append(f"{inner}acc += w{last} * (float)X[f{last}];")
    for _ in resized:
        inner = inner[:-4]
        body.append(f"{inner}}}")
    body.append(f"{ind}*p++ = ({t})acc;")
    for _ in range(rank):
        ind = ind[:-4]
        body.append(f"{ind}}}")
    syms = tuple(symbols_of([*out, *xs]))
    source = source_with_entries("\n".join(pre) + "\n", [("resize", "\n".join(body) + "\n")], syms)
    return KernelSpec("resize", source, ("resize",), syms)
