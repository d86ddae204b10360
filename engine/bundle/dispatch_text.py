"""The reference runtime's ``dispatch_table.txt`` format.

First line: the symbol names separated by spaces (empty for a static graph). Each further line:
``<symbol values...> <candidate index per task...>``, one column per compiled task. Parsing is
strict: a bad line (wrong field count, a non-integer, a negative symbol value, a candidate index
out of range, a key given twice) is reported with its number, because a wrong table silently picks
wrong kernels. The same parser reads the per-bundle cache files (``engine.runtime.dispatch_cache``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from engine.errors import BundleError

__all__ = ["parse_dispatch_table", "format_dispatch_table", "MAX_ROWS"]

MAX_ROWS = 1_000_000


def parse_dispatch_table(text: str, *, symbols: Sequence[str], candidates_per_task: Sequence[int],
                         member: str = "dispatch_table.txt") -> dict[tuple[int, ...], tuple[int, ...]]:
    """Rows keyed by symbol values; ``BundleError`` naming the line for anything malformed."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise BundleError("empty dispatch table: the first line must name the symbols", member=member)
    header = lines[0].split()
    if header != list(symbols):
        raise BundleError(f"line 1 names symbols {header}, the graph's symbols are {list(symbols)}", member=member)
    if len(lines) - 1 > MAX_ROWS:
        raise BundleError(f"{len(lines) - 1} rows exceed the limit of {MAX_ROWS}", member=member)
    n_sym, n_task = len(symbols), len(candidates_per_task)
    rows: dict[tuple[int, ...], tuple[int, ...]] = {}
    seen: dict[tuple[int, ...], int] = {}
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != n_sym + n_task:
            raise BundleError(f"line {number} has {len(fields)} fields, expected {n_sym} symbol values and "
                              f"{n_task} candidate indices", member=member)
        try:
            values = [int(f) for f in fields]
        except ValueError:
            raise BundleError(f"line {number} has a non-integer field: {line.strip()!r}", member=member) from None
        key, choice = tuple(values[:n_sym]), tuple(values[n_sym:])
        if any(v < 0 for v in key):
            raise BundleError(f"line {number}: negative symbol value", member=member)
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


def format_dispatch_table(symbols: Sequence[str], rows: Mapping[tuple[int, ...], tuple[int, ...]]) -> str:
    out = [" ".join(symbols)]
    for key in sorted(rows):
        out.append(" ".join(str(v) for v in (*key, *rows[key])))
    return "\n".join(out) + "\n"
