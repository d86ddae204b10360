"""Structuring untrusted JSON with errors that name the member and the JSON path.

The bundle reader is the one place outside data enters the engine; every failure here becomes a
``BundleError`` like ``kernels/0/meta.json @ $.candidates[1].binaries[0].format: expected a
string, got 3``. Inside the engine the resulting attrs objects are trusted.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, TypeVar

from engine.errors import BundleError
# Re-exported: bundle modules (and tests) import the number helpers from here; they live below expressions.
from engine.numbers import INT64_MAX, INT64_MIN, MAX_DECIMAL_DIGITS, clip, parse_decimal

__all__ = ["JsonReader", "loads_member", "parse_decimal", "clip", "INT64_MIN", "INT64_MAX", "MAX_DECIMAL_DIGITS"]

T = TypeVar("T")

_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "a boolean"}

_INT_RANGE = "JSON integers must lie in [-2**63, 2**63-1]"


class _Refused:
    """A number the parser refused, left in the document so the walk afterwards can name its path."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def loads_member(data: bytes, member: str) -> Any:
    """Parse a JSON member, refusing duplicate keys, non-finite numbers and integers outside int64.

    Numbers are bounded inside the parser (``parse_int``/``parse_float``), before anything builds a
    huge ``int``; an out-of-range one is reported with its JSON path wherever it appears, so no
    later reader (or unknown key kept for forward compatibility) ever sees it.
    """
    refused: list[_Refused] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise BundleError(f"duplicate key {clip(key)}", member=member)
            out[key] = value
        return out

    def no_constants(name: str) -> Any:
        raise BundleError(f"non-standard JSON constant {name}", member=member)

    def bounded_int(text: str) -> int | _Refused:
        if len(text) < MAX_DECIMAL_DIGITS and text.isascii():  # the scanner's tokens: -?[0-9]+
            return int(text)
        value: int | _Refused | None = _json_int(text)
        if value is None:
            value = _Refused(f"integer {clip(text)} is out of range: {_INT_RANGE}")
            refused.append(value)
        return value

    def finite_float(text: str) -> float | _Refused:
        value = float(text)
        if math.isfinite(value):
            return value
        refused.append(_Refused(f"number {clip(text)} is out of the range of a double"))
        return refused[-1]

    try:
        text = data.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants,
                         parse_int=bounded_int, parse_float=finite_float)
    except UnicodeDecodeError as exc:
        raise BundleError(f"not UTF-8 text: {exc}", member=member) from None
    except RecursionError:
        raise BundleError("JSON nested too deeply", member=member) from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", member=member) from None
    if refused:
        raise BundleError(refused[0].message, member=member, path=_path_of(doc, refused[0]))
    return doc


def _json_int(text: str) -> int | None:
    """A JSON integer token in int64, else None (ASCII digits checked again by ``parse_decimal``)."""
    if text.startswith("-"):
        value = parse_decimal(text[1:], maximum=-INT64_MIN)
        return None if value is None else -value
    return parse_decimal(text)


def _path_of(doc: Any, target: object) -> str:
    """The JSON path of ``target`` inside ``doc`` (by identity), walked without recursion."""
    stack: list[tuple[Any, str]] = [(doc, "$")]
    while stack:
        value, path = stack.pop()
        if value is target:
            return path
        if isinstance(value, dict):
            stack.extend((v, key_path(path, k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return "$"


class JsonReader:
    """Typed accessors over parsed JSON that raise path-precise ``BundleError``s."""

    __slots__ = ("member",)

    def __init__(self, member: str):
        self.member = member

    def error(self, path: str, message: str) -> BundleError:
        return BundleError(message, member=self.member, path=path)

    def expect(self, value: Any, kind: type, path: str) -> Any:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise self.error(path, f"expected {_TYPE_NAMES.get(kind, kind.__name__)}, got {_describe(value)}")
        return value

    def obj(self, value: Any, path: str, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = (),
            allow_extra: bool = True) -> dict[str, Any]:
        self.expect(value, dict, path)
        for key in required:
            if key not in value:
                raise self.error(path, f"missing required key {key!r}")
        if not allow_extra:
            extra = set(value) - set(required) - set(optional)
            if extra:
                names = ", ".join(clip(k) for k in sorted(extra)[:8])
                raise self.error(path, f"{len(extra)} unknown keys: {names}")
        return value

    def str_(self, value: Any, path: str) -> str:
        return self.expect(value, str, path)

    def int_(self, value: Any, path: str, *, minimum: int | None = 0, maximum: int | None = None) -> int:
        self.expect(value, int, path)
        if minimum is not None and value < minimum:
            raise self.error(path, f"expected an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(path, f"expected an integer <= {maximum}, got {value}")
        return value

    def list_(self, value: Any, path: str, item: Callable[[Any, str], T], *,
              max_len: int | None = None) -> tuple[T, ...]:
        self.expect(value, list, path)
        if max_len is not None and len(value) > max_len:
            raise self.error(path, f"list of {len(value)} items exceeds the limit of {max_len}")
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))

    def int_list(self, value: Any, path: str, **kw: Any) -> tuple[int, ...]:
        return self.list_(value, path, lambda v, p: self.int_(v, p), **kw)

    def str_list(self, value: Any, path: str, **kw: Any) -> tuple[str, ...]:
        return self.list_(value, path, self.str_, **kw)


def key_path(path: str, key: str) -> str:
    """``$.name`` for an ASCII identifier key, else ``$['key']`` quoted (and clipped) so that any
    key prints on one line."""
    if key.isidentifier() and key.isascii() and len(key) <= 40:
        return f"{path}.{key}"
    return f"{path}[{clip(key)}]"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str) and len(value) > 40:
        value = value[:40]  # a 60 MB string is cut before it is escaped, not after
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__
    if len(text) > 40:
        text = text[:37] + "..."
    kinds: dict[type, str] = {dict: "an object", list: "a list"}
    return kinds.get(type(value), text)
