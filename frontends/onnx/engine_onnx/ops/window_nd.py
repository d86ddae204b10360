"""C loops over the windows of a Conv or pooling with any number of spatial axes (NCDHW: three).

The 3-D Conv and pooling kernels (``conv_nd.py``, ``pool_nd.py``, ``gpu_window_nd.py``) are direct
loops: the 2-D ops keep their tuned candidates, and a 3-D model is rare enough that one plain kernel
per shape serves it. The loops are generated here once, for any rank, so that the CPU and the GPU
kernels take the same window, skip the same padding and divide an average by the same count. The
statements are plain C99 over ``int64_t``, valid both in the CPU kernels and in the GPU dialect
(``engine_onnx.gpu``); the geometry is written in as literals, as the 2-D kernels do.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import attrs

from engine_onnx.errors import NodeUnsupported

__all__ = ["Window", "window_of", "split_index", "window_starts", "tap_loops", "max_window", "average_window"]


@attrs.frozen
class Window:
    """The geometry of a windowed op over ``len(spatial)`` axes, per axis: the input size, the
    kernel, stride, dilation, padding before and after, and the output size (``conv_geometry``'s)."""

    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]
    out: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if any(o <= 0 for o in self.out):
            raise NodeUnsupported(f"empty output (spatial output {list(self.out)})")

    @property
    def rank(self) -> int:
        return len(self.spatial)

    @property
    def in_plane(self) -> int:
        """Elements of one input plane (one image and channel)."""
        return math.prod(self.spatial)

    @property
    def out_plane(self) -> int:
        return math.prod(self.out)

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)


def window_of(spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dil: Sequence[int],
              begin: Sequence[int], end: Sequence[int], out: Sequence[int]) -> Window:
    """A ``Window`` from ``conv_geometry``'s lists."""
    return Window(*(tuple(int(v) for v in seq) for seq in (spatial, kernel, strides, dil, begin, end, out)))


def split_index(flat: str, sizes: Sequence[int], names: Sequence[str], rest: str, indent: str = "    ") -> str:
    """Statements defining ``names[a]`` (``int64_t``) as the coordinates of the row-major index
    ``flat`` over the trailing ``sizes``, and ``rest`` as what is left (the leading index)."""
    lines = [f"{indent}int64_t {rest} = {flat};"]
    for size, name in reversed(list(zip(sizes, names))):
        lines.append(f"{indent}const int64_t {name} = {rest} % {size}; {rest} /= {size};")
    return "\n".join(lines) + "\n"


def _flat(names: Sequence[str], sizes: Sequence[int]) -> str:
    """The row-major flat index of coordinates ``names`` over ``sizes``."""
    expr = names[0]
    for name, size in zip(names[1:], sizes[1:]):
        expr = f"({expr}) * {size} + {name}"
    return expr


def window_starts(w: Window, coords: Mapping[int, str], indent: str = "    ") -> str:
    """Statements defining ``s<a>``, the first (padded) input coordinate along axis ``a`` of the
    window at output coordinate ``coords[a]``, for each axis ``coords`` names."""
    return "".join(f"{indent}const int64_t s{a} = {c} * {w.strides[a]} - {w.begin[a]};\n" for a, c in coords.items())


def tap_loops(w: Window, body: Callable[[str, str], str], indent: str = "    ") -> str:
    """Nested loops over the window's taps that fall inside the input (``window_starts``' ``s<a>``
    in scope), the padding skipped; ``body(k, xi)`` is the statement of one tap, ``k`` the tap's flat
    index in the kernel, ``xi`` the input element's offset in its plane."""
    lines = []
    for a in range(w.rank):
        pad = indent + "    " * a
        lines.append(f"{pad}for (int64_t k{a} = 0; k{a} < {w.kernel[a]}; k{a}++) {{")
        lines.append(f"{pad}    const int64_t i{a} = s{a} + k{a} * {w.dilations[a]};")
        lines.append(f"{pad}    if (i{a} < 0 || i{a} >= {w.spatial[a]}) continue;")
    ks, xs = [f"k{a}" for a in range(w.rank)], [f"i{a}" for a in range(w.rank)]
    lines.append(indent + "    " * w.rank + body(_flat(ks, w.kernel), _flat(xs, w.spatial)))
    lines += [indent + "    " * a + "}" for a in reversed(range(w.rank))]
    return "\n".join(lines) + "\n"


def max_window(w: Window, x: str, indent: str = "    ") -> str:
    """Statements leaving the window's maximum of plane ``x`` in ``float m``: -inf for a window all in
    the padding; a NaN skipped (``v > m ? v : m``), as the 2-D kernels do."""
    return (f"{indent}float m = -INFINITY;\n"
            + tap_loops(w, lambda k, xi: f"{{ const float v = {x}[{xi}]; m = v > m ? v : m; }}", indent))


def average_window(w: Window, include_pad: bool, x: str, indent: str = "    ") -> str:
    """Statements leaving the window's average of plane ``x`` in ``float a``. The window is clipped
    to the padded extent (a ``ceil_mode`` window may run past it); the count is the product of the
    per-axis counts, of the padded extent with ``include_pad``, else of the input; a window with no
    element gives 0. No dilation: the importer refuses AveragePool's."""
    lines = []
    for a in range(w.rank):
        lines.append(f"{indent}const int64_t e{a} = s{a} + {w.kernel[a]} < {w.spatial[a] + w.end[a]} ? "
                     f"s{a} + {w.kernel[a]} : {w.spatial[a] + w.end[a]};")
        lines.append(f"{indent}const int64_t lo{a} = s{a} > 0 ? s{a} : 0, "
                     f"hi{a} = e{a} < {w.spatial[a]} ? e{a} : {w.spatial[a]};")
    counts = [f"(e{a} - s{a})" if include_pad else f"(hi{a} > lo{a} ? hi{a} - lo{a} : 0)" for a in range(w.rank)]
    lines.append(f"{indent}float sum = 0.0f;")
    for a in range(w.rank):
        lines.append(f"{indent}{'    ' * a}for (int64_t i{a} = lo{a}; i{a} < hi{a}; i{a}++)")
    xs = [f"i{a}" for a in range(w.rank)]
    lines.append(f"{indent}{'    ' * w.rank}sum += {x}[{_flat(xs, w.spatial)}];")
    lines.append(f"{indent}const int64_t cnt = {' * '.join(counts)};")
    lines.append(f"{indent}const float a = cnt > 0 ? sum / (float)cnt : 0.0f;")
    return "\n".join(lines) + "\n"
