"""Parsing what people type: ``--symbol batch=1,8,64``, ranges ``1..64``, ``--input x=a.npy``.

Everything here raises :class:`UsageError` (exit code 2) with a message that quotes what was typed
and shows the expected spelling, so a mistyped flag never surfaces as a traceback or as a run that
silently used another value.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import attrs

__all__ = [
    "UsageError",
    "CheckFailed",
    "InputSpec",
    "parse_values",
    "parse_symbols",
    "parse_input",
    "MAX_GRID",
]

#: The most keys one command accepts (a typo like ``1..10000000`` should not run for hours).
MAX_GRID = 100_000

_NAME_RE = re.compile(r"[A-Za-z_]\w*\Z")
# ASCII digits only (``\d`` would take other scripts' digits), at most 18: int() never sees a huge value.
_RANGE_RE = re.compile(r"(-?[0-9]{1,18})\.\.(-?[0-9]{1,18})(?::([0-9]{1,18}))?\Z")
_INT_RE = re.compile(r"-?[0-9]{1,18}\Z")


class UsageError(Exception):
    """The command line asks for something impossible (exit code 2)."""

    exit_code = 2


class CheckFailed(Exception):
    """A check the command performs failed, e.g. a hash mismatch (exit code 1)."""

    exit_code = 1


def parse_values(text: str, *, what: str) -> list[int]:
    """``"1,8,64"``, ``"1..64"`` (inclusive), ``"1..64:8"`` (step) or a mix: ``"1,2,4..8"``.

    Values keep the order given, duplicates dropped; every value must be a positive integer.
    """
    values: list[int] = []
    if not text.strip():
        raise UsageError(f"{what}: no values given; expected e.g. 1,8,64 or 1..64")
    for part in text.split(","):
        part = part.strip()
        match = _RANGE_RE.match(part)
        if match:
            lo, hi, step = int(match.group(1)), int(match.group(2)), int(match.group(3) or 1)
            if step < 1:
                raise UsageError(f"{what}: step in {part!r} must be at least 1")
            if hi < lo:
                raise UsageError(f"{what}: empty range {part!r} (the end is below the start)")
            if (hi - lo) // step + 1 > MAX_GRID:
                raise UsageError(f"{what}: range {part!r} has more than {MAX_GRID:,} values")
            chunk: Iterable[int] = range(lo, hi + 1, step)
        elif _INT_RE.match(part):
            chunk = (int(part),)
        else:
            raise UsageError(f"{what}: cannot read {part!r}; expected integers like 1,8,64 or a range like 1..64 "
                             f"(or 1..64:8 for a step)")
        for value in chunk:
            if value < 1:
                raise UsageError(f"{what}: symbol values must be positive integers, got {value}")
            if value not in values:
                values.append(value)
    return values


def parse_symbols(specs: Sequence[str] | None, graph_symbols: Sequence[str], *, required: bool,
                  single: bool = False) -> dict[str, list[int]]:
    """``--symbol`` options against the graph's symbols: ``{name: [values]}`` in the graph's order.

    Unknown names are refused. With ``required`` every graph symbol needs a value; with ``single``
    each symbol takes exactly one value (a run has one key).
    """
    given: dict[str, list[int]] = {}
    for spec in specs or ():
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or not _NAME_RE.match(name):
            raise UsageError(f"--symbol {spec!r}: expected NAME=VALUES, e.g. --symbol batch=8 or batch=1,8,64")
        if name not in graph_symbols:
            known = ", ".join(graph_symbols) if graph_symbols else "none (the graph is static)"
            raise UsageError(f"--symbol {spec!r}: the graph has no symbol {name!r}; its symbols: {known}")
        if name in given:
            raise UsageError(f"--symbol {name!r} is given twice; list several values as {name}=1,8,64")
        values = parse_values(rest, what=f"--symbol {name}")
        if single and len(values) != 1:
            raise UsageError(f"--symbol {spec!r}: this command runs one key; give one value per symbol")
        given[name] = values
    if required:
        missing = [s for s in graph_symbols if s not in given]
        if missing:
            example = " ".join(f"--symbol {s}=8" for s in missing)
            raise UsageError(f"missing a value for symbol{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(repr(s) for s in missing)}: add {example}")
    size = 1
    for values in given.values():
        size *= len(values)
    if size > MAX_GRID:
        raise UsageError(f"the --symbol values make {size:,} keys, more than the limit of {MAX_GRID:,}")
    return {s: given[s] for s in graph_symbols if s in given}


@attrs.frozen
class InputSpec:
    """One ``--input NAME=FILE`` (``name`` is ``None`` for the bare ``--input FILE`` form)."""

    name: str | None
    path: str
    text: str


def parse_input(text: str) -> InputSpec:
    """``NAME=PATH`` (or just ``PATH`` for a single-input graph); checked against the graph later."""
    name, sep, path = text.partition("=")
    if not sep:
        if not text.strip():
            raise UsageError("--input: empty value; expected NAME=FILE.npy")
        return InputSpec(None, text, text)
    name = name.strip()
    if not name or not path:
        raise UsageError(f"--input {text!r}: expected NAME=FILE.npy (e.g. --input x=x.npy)")
    return InputSpec(name, path, text)
