"""Separately compiled units of a C source: the lines between ``// engine-cpu: unit begin`` and
``// engine-cpu: unit end``.

Generated kernels embed the same routine library in every source (the ONNX importer's GEMM), and
compiling that library at ``-O3`` is most of each compile. The compiler builds a unit once into
an object file, cached under its own text, the compiler and the flags, and links that object into
every kernel holding the unit: the kernel's shared object stays whole (nothing is loaded beside
it), and only the kernel's own part is compiled per source.

The markers are comments, so the source is still one C file meaning the same when compiled whole
(a bundle's ``c-source`` read by another tool, or by an older plugin). What that asks of the
source:

* a unit's translation unit is the text before it (earlier units left out) followed by the unit:
  the text before a unit defines no external function or object, and opens no ``#if`` the unit
  does not close;
* what the rest of the source calls in a unit is external (not ``static``) and declared before the
  unit, preferably with hidden visibility, which keeps it out of the kernel's exported symbols;
* a unit repeated verbatim (a preamble pasted twice) is compiled and linked once.

Removed lines are left blank in the kernel's own part, so the compiler's line numbers are the
source's.
"""

from __future__ import annotations

import re

import attrs

from engine.errors import KernelError

__all__ = ["UNIT_BEGIN", "UNIT_END", "SplitSource", "UnitMarkerError", "split_units"]

UNIT_BEGIN = "// engine-cpu: unit begin"
UNIT_END = "// engine-cpu: unit end"

_MARKER = re.compile(r"^\s*//\s*engine-cpu:\s*unit\s+(begin|end)\s*$")


class UnitMarkerError(KernelError, ValueError):
    """The unit markers of a C source do not pair up; ``line`` is the 1-based line of the fault."""

    def __init__(self, message: str, *, line: int):
        super().__init__(message)
        self.line = line


@attrs.frozen
class SplitSource:
    """A source cut at its unit markers: ``own`` (the source with every unit's lines blank) and
    ``units`` (each distinct unit's translation unit: the text before it, then the unit)."""

    own: str
    units: tuple[str, ...]


def split_units(source: str) -> SplitSource:
    """``source`` cut into its own part and its units (no units: ``own`` is ``source``)."""
    lines = source.splitlines(keepends=True)
    if not any(_MARKER.match(line) for line in lines):
        return SplitSource(source, ())
    outside: list[str] = []  # the source so far with units blank: every unit's prefix
    units: list[str] = []
    seen: set[str] = set()
    begin: int | None = None
    for number, line in enumerate(lines, start=1):
        marker = _MARKER.match(line)
        if marker and marker.group(1) == "begin":
            if begin is not None:
                raise UnitMarkerError(f"C source line {number}: '{UNIT_BEGIN}' inside the unit begun at line "
                                      f"{begin}; end that unit first ('{UNIT_END}')", line=number)
            begin = number
        elif marker:
            if begin is None:
                raise UnitMarkerError(f"C source line {number}: '{UNIT_END}' without a '{UNIT_BEGIN}' before it",
                                      line=number)
            body = "".join(lines[begin:number - 1])
            if body not in seen:
                seen.add(body)
                units.append("".join(outside) + "\n" + body)  # the blank line stands for the begin marker
            outside.extend(["\n"] * (number - begin + 1))  # the unit and its markers, blank
            begin = None
        elif begin is None:
            outside.append(line)
    if begin is not None:
        raise UnitMarkerError(f"C source line {begin}: '{UNIT_BEGIN}' has no '{UNIT_END}' after it", line=begin)
    return SplitSource("".join(outside), tuple(units))
