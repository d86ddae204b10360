"""Reading integers out of untrusted text, and quoting that text in messages.

Both the bundle reader (JSON, share maps, dispatch tables) and the expression language read
integers from text a bundle writer controls, and the expression layer sits below the bundle layer.
The helpers live here, under both, so expressions need nothing from ``engine.bundle``; the bundle
modules keep re-exporting them from ``engine.bundle.jsonread`` for the code that imports them there.
"""

from __future__ import annotations

__all__ = ["parse_decimal", "clip", "INT64_MIN", "INT64_MAX", "MAX_DECIMAL_DIGITS"]

#: Every integer read from bundle text lies in int64: the range of expression arithmetic (§11.2),
#: so any integer a writer can put anywhere is also a valid constant, and sizes and indices that
#: reach C structs never need more than 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Longest run of decimal digits accepted (enough for any int64 magnitude). Python's ``int()`` is
#: never handed more, so its own digit limit -- a bare ValueError -- cannot be reached.
MAX_DECIMAL_DIGITS = 19


def parse_decimal(text: str, *, maximum: int = INT64_MAX) -> int | None:
    """The value of a plain decimal -- ASCII digits only, at most 19 of them, at most ``maximum`` --
    else None.

    Every integer the engine reads from bundle text goes through here (JSON numbers, share_map keys,
    dispatch rows, expression literals), because ``int()`` accepts much more than the format
    allows: other scripts' digits (``'²'`` and ``'１'`` pass ``str.isdigit``), underscores
    (``'1_0'``), signs and surrounding whitespace, and it raises a bare ValueError past 4300 digits.
    """
    # Among ASCII characters exactly 0-9 are digits; isascii() first shuts out every other script.
    if not (0 < len(text) <= MAX_DECIMAL_DIGITS and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= maximum else None


def clip(text: str, limit: int = 40) -> str:
    """``repr(text)`` cut to about ``limit`` characters with the full length noted: untrusted text
    (a 5,000-digit number, a line of a table) goes into one-line messages of bounded size."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
