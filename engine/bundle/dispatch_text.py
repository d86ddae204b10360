"""The reference runtime's ``dispatch_table.txt`` format.

First line: the symbol names separated by spaces (empty for a static graph). Each further line:
``<symbol values...> <candidate index per task...>``, one column per compiled task. Parsing is
strict: a bad line (wrong field count, a field that is not a plain decimal, a candidate index out of
range, a key given twice) is reported with its number, because a wrong table silently picks wrong
kernels. Fields are separated by ASCII spaces and tabs (a CRLF line end is tolerated) and each is
1 to 19 ASCII digits below 2**63 (``parse_decimal``): ``int()`` would read ``1_0`` as 10 and
``+1``, ``１`` or a no-break space as if they were digits and blanks. The same parser reads the
per-bundle cache files (``engine.runtime.dispatch_cache``).
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from engine.bundle.jsonread import MAX_DECIMAL_DIGITS, clip, parse_decimal
from engine.errors import BundleError

__all__ = ["parse_dispatch_table", "format_dispatch_table", "MAX_ROWS"]

MAX_ROWS = 1_000_000
#: A field: a run of anything but the separators, ASCII space and tab.
_FIELD = re.compile(r"[^ \t]+")


def parse_dispatch_table(text: str, *, symbols: Sequence[str], candidates_per_task: Sequence[int],
                         member: str = "dispatch_table.txt") -> dict[tuple[int, ...], tuple[int, ...]]:
    """Rows keyed by symbol values; ``BundleError`` naming the line for anything malformed."""
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]  # CRLF too
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise BundleError("empty dispatch table: the first line must name the symbols", member=member)
    header = _FIELD.findall(lines[0])
    if header != list(symbols):
        names = "[" + ", ".join(clip(h) for h in header[:8]) + (", ...]" if len(header) > 8 else "]")
        raise BundleError(f"line 1 names symbols {names}, the graph's symbols are {list(symbols)}", member=member)
    if len(lines) - 1 > MAX_ROWS:
        raise BundleError(f"{len(lines) - 1} rows exceed the limit of {MAX_ROWS}", member=member)
    n_sym, n_task = len(symbols), len(candidates_per_task)
    rows: dict[tuple[int, ...], tuple[int, ...]] = {}
    seen: dict[tuple[int, ...], int] = {}
    for number, line in enumerate(lines[1:], start=2):
        fields = _FIELD.findall(line)
        if not fields:
            continue
        if len(fields) != n_sym + n_task:
            raise BundleError(f"line {number} has {len(fields)} fields, expected {n_sym} symbol values and "
                              f"{n_task} candidate indices", member=member)
        values = _row_values(fields, number, n_sym, member)
        key, choice = tuple(values[:n_sym]), tuple(values[n_sym:])
        for task, (c, count) in enumerate(zip(choice, candidates_per_task)):
            if not 0 <= c < max(count, 1):
                raise BundleError(f"line {number}: task {task} has {count} candidates, the row picks {c}",
                                  member=member)
        if key in seen:
            raise BundleError(f"line {number} repeats the key of line {seen[key]} ({' '.join(map(str, key))})",
                              member=member)
        seen[key] = number
        rows[key] = choice
    return rows


def _row_values(fields: list[str], number: int, n_sym: int, member: str) -> list[int]:
    """Each field's value through ``parse_decimal``; a ``BundleError`` naming line and field else."""
    values = []
    for column, field in enumerate(fields, start=1):
        value = parse_decimal(field)
        if value is None:
            raise BundleError(_field_problem(field, number, column, n_sym), member=member)
        values.append(value)
    return values


def _field_problem(field: str, number: int, column: int, n_sym: int) -> str:
    """Why ``field`` is not a table value, in one bounded line."""
    what = "symbol value" if column <= n_sym else "candidate index"
    if field.startswith("-") and parse_decimal(field[1:]) is not None:
        return f"line {number}: negative {what} {clip(field)} in field {column}"
    if field.isascii() and field.isdigit():
        return (f"line {number} field {column} ({what}) {clip(field)} is out of range: at most "
                f"{MAX_DECIMAL_DIGITS} digits and below 2**63")
    return (f"line {number} has a non-integer field: field {column} ({what}) is {clip(field)}; expected "
            f"1 to {MAX_DECIMAL_DIGITS} ASCII digits (0-9), no sign, underscore or other script's digits")


def format_dispatch_table(symbols: Sequence[str], rows: Mapping[tuple[int, ...], tuple[int, ...]]) -> str:
    out = [" ".join(symbols)]
    for key in sorted(rows):
        out.append(" ".join(str(v) for v in (*key, *rows[key])))
    return "\n".join(out) + "\n"
