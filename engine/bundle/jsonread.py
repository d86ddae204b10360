"""Structuring untrusted JSON with errors that name the member and the JSON path.

The bundle reader is the one place outside data enters the engine; every failure here becomes a
``BundleError`` like ``kernels/0/meta.json @ $.candidates[1].binaries[0].format: expected a
string, got 3``. Inside the engine the resulting attrs objects are trusted.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from engine.errors import BundleError

__all__ = ["JsonReader", "loads_member"]

T = TypeVar("T")

_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "a boolean"}


def loads_member(data: bytes, member: str) -> Any:
    """Parse a JSON member, refusing duplicate keys and non-finite numbers."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise BundleError(f"duplicate key {key!r}", member=member)
            out[key] = value
        return out

    def no_constants(name: str) -> Any:
        raise BundleError(f"non-standard JSON constant {name}", member=member)

    try:
        text = data.decode("utf-8")
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except UnicodeDecodeError as exc:
        raise BundleError(f"not UTF-8 text: {exc}", member=member) from None
    except RecursionError:
        raise BundleError("JSON nested too deeply", member=member) from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", member=member) from None


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
                raise self.error(path, f"unknown keys {sorted(extra)}")
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
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__
    if len(text) > 40:
        text = text[:37] + "..."
    return {dict: "an object", list: "a list"}.get(type(value), text)
