"""Strict decoding of a bundle's text members (every JSON member, ``dispatch_table.txt``,
``graph_string.txt``).

The format says UTF-8 (docs/bundle-format.md §3). Python is more forgiving than that in two places
a hostile or careless writer reaches: ``json.loads`` given *bytes* guesses UTF-16 and UTF-32 and
skips a UTF-8 byte-order mark, and ``errors="replace"`` turns any byte soup into text. Both would let
two readers disagree about what a member says, so text is decoded here, once, strictly.
"""

from __future__ import annotations

import codecs

from engine.errors import BundleError

__all__ = ["decode_utf8", "utf8_problem"]

_WIDE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def utf8_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not BOM-free UTF-8 text without NUL bytes, or None if it is.

    NUL is refused because no text member can contain it legitimately, and because UTF-16 or
    UTF-32 text without a byte-order mark is valid UTF-8 full of NULs: the message then says so
    instead of a confusing syntax error further on.
    """
    problem = _framing_problem(raw)
    if problem is None:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = _invalid(raw, exc)
    return problem


def decode_utf8(data: bytes | bytearray | memoryview, member: str) -> str:
    """``data`` as text; a :class:`BundleError` naming ``member`` unless it passes ``utf8_problem``."""
    raw = bytes(data)
    problem = _framing_problem(raw)
    if problem is None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = _invalid(raw, exc)
    raise BundleError(problem, member=member)


def _framing_problem(raw: bytes) -> str | None:
    if raw.startswith(codecs.BOM_UTF8):
        return "starts with a byte-order mark (EF BB BF); text members must be UTF-8 without one"
    if raw.startswith(_WIDE_BOMS):
        return "starts with a UTF-16 or UTF-32 byte-order mark; text members must be UTF-8"
    nul = raw.find(b"\x00")
    if nul >= 0:
        return f"has a NUL byte at {_position(raw, nul)} (UTF-16 or UTF-32 text?); text members must be UTF-8"
    return None


def _invalid(raw: bytes, exc: UnicodeDecodeError) -> str:
    return f"is not UTF-8: {exc.reason} 0x{raw[exc.start]:02x} at {_position(raw, exc.start)}"


def _position(raw: bytes, offset: int) -> str:
    """``line 3, byte 1 (offset 6)``: where a bad byte is, in the terms of a line-oriented member."""
    line = raw.count(b"\n", 0, offset) + 1
    column = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
    return f"line {line}, byte {column} (offset {offset})"
