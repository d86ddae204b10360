"""Dimensions that may be symbolic: an ``int`` or a ``Mono`` (an integer times a product of symbols).

Products of symbols cover what real models do with dynamic axes (``batch``, ``batch * seq`` after a
flatten, ``batch * seq // heads`` never arises with static head counts), and keep equality exact:
two monomials are equal when their coefficient and symbol multiset are. Sums of symbols (a Concat
along a dynamic axis) are refused with a clear reason instead of being approximated.
"""

from __future__ import annotations

from typing import Sequence, Union

import attrs

__all__ = ["Mono", "Dim", "dim_mul", "dim_div", "dim_expr", "dim_c", "dims_product", "is_static", "symbols_of",
           "merge_axes"]


class DimError(ValueError):
    """A dimension computation the monomial model cannot express (a sum, an inexact division)."""


@attrs.frozen(order=False)
class Mono:
    """``coef * prod(syms)`` with ``syms`` sorted (repeats allowed)."""

    coef: int
    syms: tuple[str, ...]

    def __mul__(self, other: "Dim") -> "Dim":
        return dim_mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other: "Dim") -> "Dim":
        return dim_div(self, other)

    def __rfloordiv__(self, other: "Dim") -> "Dim":
        return dim_div(other, self)

    def __add__(self, other: "Dim") -> "Dim":
        if other == 0:
            return self
        raise DimError(f"cannot add {dim_expr(self)} and {dim_expr(other)}: sums of symbols are not supported")

    __radd__ = __add__

    def __sub__(self, other: "Dim") -> "Dim":
        if other == 0:
            return self
        raise DimError(f"cannot subtract {dim_expr(other)} from {dim_expr(self)}")

    def __rsub__(self, other: "Dim") -> "Dim":
        raise DimError(f"cannot subtract {dim_expr(self)} from {dim_expr(other)}")

    def __truediv__(self, other: "Dim") -> "Dim":
        return dim_div(self, other)

    def __int__(self) -> int:
        raise DimError(f"dimension {dim_expr(self)} is dynamic")

    def __repr__(self) -> str:
        return dim_expr(self)


Dim = Union[int, Mono]


def _norm(coef: int, syms: tuple[str, ...]) -> Dim:
    return coef if not syms or coef == 0 else Mono(coef, tuple(sorted(syms)))


def _parts(d: Dim) -> tuple[int, tuple[str, ...]]:
    if isinstance(d, Mono):
        return d.coef, d.syms
    return int(d), ()


def dim_mul(a: Dim, b: Dim) -> Dim:
    ca, sa = _parts(a)
    cb, sb = _parts(b)
    return _norm(ca * cb, sa + sb)


def dim_div(a: Dim, b: Dim) -> Dim:
    """Exact division ``a / b`` (raises ``DimError`` when it is not exact)."""
    ca, sa = _parts(a)
    cb, sb = _parts(b)
    rest = list(sa)
    for s in sb:
        if s not in rest:
            raise DimError(f"{dim_expr(a)} is not divisible by {dim_expr(b)}")
        rest.remove(s)
    if cb == 0 or ca % cb:
        raise DimError(f"{dim_expr(a)} is not divisible by {dim_expr(b)}")
    return _norm(ca // cb, tuple(rest))


def dims_product(dims) -> Dim:
    out: Dim = 1
    for d in dims:
        out = dim_mul(out, d)
    return out


def is_static(d: Dim) -> bool:
    return not isinstance(d, Mono)


def symbols_of(dims) -> list[str]:
    out: list[str] = []
    for d in dims:
        if isinstance(d, Mono):
            for s in d.syms:
                if s not in out:
                    out.append(s)
    return out


def dim_expr(d: Dim) -> str | int:
    """The bundle's expression for ``d`` (one spelling everywhere: symbols sorted, coefficient last)."""
    if not isinstance(d, Mono):
        return int(d)
    text = " * ".join(d.syms)
    return text if d.coef == 1 else f"{text} * {d.coef}"


def dim_c(d: Dim) -> str:
    """``d`` as a C expression over the kernel's ``s_<symbol>`` locals (int64_t)."""
    if not isinstance(d, Mono):
        return f"{int(d)}LL"
    parts = [f"s_{s}" for s in d.syms] + ([f"{d.coef}LL"] if d.coef != 1 else [])
    return "(" + " * ".join(parts) + ")"


def merge_axes(out_shape: Sequence[Dim], in_strides: Sequence[Dim]) -> tuple[list[Dim], list[Dim]]:
    """A strided copy's loop nest: output axes of size 1 dropped, neighbours merged where the input
    strides make them one axis."""
    sizes: list[Dim] = []
    strides: list[Dim] = []
    for size, st in zip(out_shape, in_strides):
        if size == 1:
            continue
        if sizes and strides[-1] == st * size:
            sizes[-1] = sizes[-1] * size
            strides[-1] = st
        else:
            sizes.append(size)
            strides.append(st)
    return sizes, strides
