"""Output for people and for scripts: aligned tables, sizes, times, JSON.

Every command builds one plain ``dict`` of results; the text view is rendered from that dict and
``--json`` prints the dict itself, so both always carry the same figures. Figures shown in tables
go through the formatters here (``ms``, ``rate``), which tests reuse to check that the two views
agree.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import textwrap
from typing import IO, Any, Sequence

from engine.runtime.report import format_bytes, format_ms

__all__ = ["table", "format_bytes", "ms", "rate", "emit_json", "to_jsonable", "one_line", "plural", "key_text",
           "compress_values", "group_rows", "terminal_width", "wrap", "fit", "MIN_WRAP"]

#: A wrapped column narrower than this reads worse than the text on lines of its own below its row.
MIN_WRAP = 32
#: The least room in which the last column's text starts in its row (otherwise all below it).
_MIN_HANG = 12


def terminal_width() -> int:
    """The width text output must fit: ``COLUMNS``, else stdout's terminal, else 80 (``shutil``'s rule)."""
    return max(shutil.get_terminal_size((80, 24)).columns, 20)


def wrap(text: str, width: int, *, indent: str = "", initial: str = "") -> list[str]:
    """``text`` on lines of at most ``width`` characters (the first starts with ``initial``, the
    others with ``indent``); words longer than a line (paths) are broken."""
    return textwrap.wrap(text, width, initial_indent=initial, subsequent_indent=indent,
                         break_on_hyphens=False) or [""]


def fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters, the cut marked with an ellipsis."""
    return line if len(line) <= width else line[:max(width - 1, 0)] + "\u2026"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = (),
          indent: str = "", width: int | None = None) -> str:
    """A plain-text table: a header, a rule, one line per row. ``right`` lists right-aligned columns.

    With ``width`` no line is wider: the last column's text is wrapped within its column or, when
    the other columns leave it fewer than ``MIN_WRAP`` characters, starts in its row and goes on
    on indented lines below it (a hanging indent: every row still starts with its own cells and
    the first words of its last one). Any line still too wide is cut (``fit``).
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return (indent + "  ".join(parts)).rstrip()

    total = len(indent) + sum(widths) + 2 * (len(widths) - 1)
    if width is None or total <= width or not widths:
        out = [line(list(headers)), line(["-" * w for w in widths])]
        out.extend(line(r) for r in cells)
        return "\n".join(out)
    last = len(widths) - 1
    room = width - (total - widths[last])
    out = []
    if room >= max(MIN_WRAP, len(headers[last])):
        widths[last] = room
        out += [line(list(headers)), line(["-" * w for w in widths])]
        blank = [""] * last
        for r in cells:
            pieces = wrap(r[last], room) if len(r) > last else [""]
            out.append(line([*r[:last], pieces[0]]))
            out.extend(line([*blank, p]) for p in pieces[1:])
    else:  # a hanging indent: the last column starts in its row and goes on below it
        prefix = width - room
        hang = indent + "    "
        widths[last] = max(min(room, widths[last]), len(headers[last]))
        if room >= _MIN_HANG and len(headers[last]) <= room:
            out += [line(list(headers)), line(["-" * w for w in widths])]
        else:
            out += [line([*headers[:last], ""]), hang + headers[last],
                    line(["-" * w for w in widths[:last]] + [""])]
        for r in cells:
            text = r[last] if len(r) > last else ""
            words = text.split()
            if not words:
                out.append(line(r[:last]))
            elif room >= _MIN_HANG and len(words[0]) <= room:  # never break the first word to start it here
                pieces = textwrap.wrap(text, width, initial_indent=" " * prefix, subsequent_indent=hang,
                                       break_on_hyphens=False)
                out.append(line([*r[:last], pieces[0][prefix:]]))
                out.extend(pieces[1:])
            else:  # too little room even to start: all of it below the row
                out.append(line(r[:last]))
                out.extend(wrap(text, width, indent=hang, initial=hang))
    return "\n".join(fit(x, width) for x in out)


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
