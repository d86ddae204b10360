"""Output for people and for scripts: aligned tables, sizes, times, JSON.

Every command builds one plain ``dict`` of results; the text view is rendered from that dict and
``--json`` prints the dict itself, so both always carry the same figures. Figures shown in tables
go through the formatters here (``ms``, ``rate``), which tests reuse to check that the two views
agree.
"""

from __future__ import annotations

import json
import math
import sys
from typing import IO, Any, Sequence

from engine.runtime.report import format_bytes, format_ms

__all__ = ["table", "format_bytes", "ms", "rate", "emit_json", "to_jsonable", "one_line", "plural", "key_text",
           "compress_values", "group_rows"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = (),
          indent: str = "") -> str:
    """A plain-text table: a header, a rule, one line per row. ``right`` lists right-aligned columns."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def ms(value: float) -> str:
    """Milliseconds with four significant decimals below 10 ms (``0.0123``), fewer above."""
    return format_ms(value)


def rate(value: float | None) -> str:
    """A per-second rate, grouped: ``81,234``; ``-`` when not applicable."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def key_text(symbols: dict[str, int]) -> str:
    """``batch=8, seq=128``; ``(static)`` for a graph without symbols."""
    return ", ".join(f"{k}={v}" for k, v in symbols.items()) or "(static)"


def compress_values(values: Sequence[int]) -> str:
    """``[1, 2, 3, 4, 8, 16]`` -> ``1..4, 8, 16`` (runs of three or more consecutive integers)."""
    ordered = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}..{ordered[j]}")
        else:
            parts.extend(str(v) for v in ordered[i:j + 1])
        i = j + 1
    return ", ".join(parts)


def group_rows(items: Sequence[tuple[dict[str, int], tuple]]) -> list[tuple[str, int, tuple]]:
    """Consecutive keys with equal values merged into one row: ``[(key, value)]`` -> ``[(label, count, value)]``.

    Keys merge only when every symbol but the last is equal, and the label lists exactly the merged
    values of the last one: ``batch=1, 8`` for two keys (never ``batch=1 .. batch=8``, which reads as
    a range), ``batch=1..64`` only when every value in it was there, ``seq=128, batch=1..4``.
    """
    out: list[tuple[str, int, tuple]] = []
    i = 0
    while i < len(items):
        key, value = items[i]
        names = list(key)
        head = [(n, key[n]) for n in names[:-1]]
        j = i + 1
        while (j < len(items) and items[j][1] == value and list(items[j][0]) == names
               and [(n, items[j][0][n]) for n in names[:-1]] == head):
            j += 1
        if not names:
            label = key_text(key)
        else:
            last = compress_values([items[k][0][names[-1]] for k in range(i, j)])
            label = ", ".join([f"{n}={v}" for n, v in head] + [f"{names[-1]}={last}"])
        out.append((label, j - i, value))
        i = j
    return out


def to_jsonable(value: Any) -> Any:
    """Numpy scalars, tuples and paths made JSON-ready; NaN/inf become null (JSON has none)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return to_jsonable(value.item())
    return str(value)


def emit_json(doc: Any, stream: IO[str] | None = None) -> None:
    out = stream if stream is not None else sys.stdout
    json.dump(to_jsonable(doc), out, indent=2)
    out.write("\n")


def finish(doc: dict, *, as_json: bool, render: Any, out_path: Any = None, saved: str = "results") -> int:
    """The end of a reporting command: the JSON document to ``out_path`` (if any), then either the
    JSON on stdout (``--json``) or the rendered text and where the document was saved."""
    if out_path is not None:
        out_path.write_text(json.dumps(to_jsonable(doc), indent=2) + "\n")
    if as_json:
        emit_json(doc)
        return 0
    print(render(doc))
    if out_path is not None:
        print(f"\n{saved} saved to {out_path}")
    return 0


def one_line(text: object) -> str:
    """Collapse a (possibly multi-line) message onto one line."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts) if parts else type(text).__name__
