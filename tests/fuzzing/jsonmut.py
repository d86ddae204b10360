"""JSON trees with raw tokens: values Python's ``json`` cannot write (5,000-digit integers, NaN,
nesting deeper than the recursion limit, duplicate keys) and the paths to every node.

A value is described by a small JSON-able *spec* (``{"t": "bigint", "digits": 5000}``) so that a
case can be stored, replayed and shrunk (``shrink_spec`` halves sizes) without pickling anything.
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

import attrs

__all__ = ["Raw", "DupKeys", "dumps", "nodes", "get", "set_", "delete", "value_pool", "render_spec", "shrink_spec"]


@attrs.frozen
class Raw:
    """JSON text inserted verbatim."""

    text: str


@attrs.frozen
class DupKeys:
    """An object written with its key/value pairs as given (duplicates kept)."""

    pairs: tuple[tuple[str, Any], ...]


def dumps(value: Any, indent: int | None = 1) -> str:
    """Serialise ``value`` (dicts, lists, scalars, Raw, DupKeys) like ``json.dumps``."""
    parts: list[str] = []
    _dump(value, parts, indent, 0)
    return "".join(parts)


def _dump(value: Any, out: list[str], indent: int | None, level: int) -> None:
    if isinstance(value, Raw):
        out.append(value.text)
        return
    pairs = value.pairs if isinstance(value, DupKeys) else value.items() if isinstance(value, dict) else None
    if pairs is not None or isinstance(value, list):
        items = list(pairs) if pairs is not None else list(value)
        open_, close = ("{", "}") if pairs is not None else ("[", "]")
        if not items:
            out.append(open_ + close)
            return
        sep = "," if indent is None else ",\n" + " " * (indent * (level + 1))
        out.append(open_ + ("" if indent is None else "\n" + " " * (indent * (level + 1))))
        for i, item in enumerate(items):
            if i:
                out.append(sep)
            if pairs is not None:
                out.append(json.dumps(item[0]) + ": ")
                item = item[1]
            _dump(item, out, indent, level + 1)
        out.append(("" if indent is None else "\n" + " " * (indent * level)) + close)
        return
    out.append(json.dumps(value))


Path_ = list  # a JSON path: keys (str) and indices (int)


def nodes(value: Any, path: Path_ | None = None) -> Iterator[tuple[Path_, Any]]:
    """Every node of a parsed JSON tree with its path, in document order."""
    path = path or []
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, path + [k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, path + [i])


def get(tree: Any, path: Path_) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def set_(tree: Any, path: Path_, value: Any) -> Any:
    """``tree`` with the node at ``path`` replaced (the root itself when ``path`` is empty)."""
    if not path:
        return value
    get(tree, path[:-1])[path[-1]] = value
    return tree


def delete(tree: Any, path: Path_) -> None:
    parent = get(tree, path[:-1])
    del parent[path[-1]]


def path_text(path: Path_) -> str:
    """``$.a[0]['b c']``, as the engine writes JSON paths."""
    out = "$"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if p.isidentifier() else f"[{p!r}]"
    return out


_SCALARS: list[dict[str, Any]] = [
    {"t": "json", "v": None}, {"t": "json", "v": True}, {"t": "json", "v": False},
    {"t": "json", "v": 0}, {"t": "json", "v": -1}, {"t": "json", "v": 1}, {"t": "json", "v": 3},
    {"t": "json", "v": 64}, {"t": "json", "v": 4096}, {"t": "json", "v": 2**31}, {"t": "json", "v": 2**62},
    {"t": "json", "v": 2**63 - 1}, {"t": "json", "v": 2**63}, {"t": "json", "v": 2**64}, {"t": "json", "v": -2**63 - 1},
    {"t": "json", "v": 1.5}, {"t": "json", "v": -0.0}, {"t": "raw", "text": "1e400"}, {"t": "raw", "text": "1E2"},
    {"t": "bigint", "digits": 5000}, {"t": "bigint", "digits": 5000, "neg": True}, {"t": "bigint", "digits": 30},
    {"t": "raw", "text": "NaN"}, {"t": "raw", "text": "Infinity"}, {"t": "raw", "text": "-Infinity"},
    {"t": "json", "v": ""}, {"t": "json", "v": "x"}, {"t": "json", "v": "0"}, {"t": "json", "v": "2"},
    {"t": "json", "v": "\u00b2"}, {"t": "json", "v": "\uff11"}, {"t": "json", "v": "\u0663"}, {"t": "json", "v": "1_0"},
    {"t": "json", "v": "batch"}, {"t": "json", "v": "n"}, {"t": "json", "v": "cpu"}, {"t": "json", "v": "hostdev"},
    {"t": "json", "v": "float32"}, {"t": "json", "v": "int64"}, {"t": "json", "v": "copy"}, {"t": "json", "v": "a\nb"},
    {"t": "json", "v": "\u0000"}, {"t": "json", "v": "\x1b[31mred"}, {"t": "raw", "text": "\"\\ud800\""},
    {"t": "json", "v": "../../etc/passwd"}, {"t": "json", "v": "/etc/passwd"}, {"t": "json", "v": "meta.json"},
    {"t": "longstr", "n": 100_000}, {"t": "json", "v": []}, {"t": "json", "v": {}}, {"t": "json", "v": [0]},
    {"t": "json", "v": {"0": 0}}, {"t": "deep", "depth": 100_000, "open": "["},
    {"t": "deep", "depth": 100_000, "open": "{"},
    {"t": "deep", "depth": 900, "open": "["}, {"t": "longlist", "n": 2_000_000},
]


def value_pool() -> list[dict[str, Any]]:
    return list(_SCALARS)


def related_specs(rng: random.Random, value: Any) -> list[dict[str, Any]]:
    """Replacements derived from the current value (off by one, as a string, Unicode digits...)."""
    out: list[dict[str, Any]] = []
    if isinstance(value, bool):
        return [{"t": "json", "v": int(value)}, {"t": "json", "v": str(value).lower()}]
    if isinstance(value, int):
        out += [{"t": "json", "v": value + 1}, {"t": "json", "v": value - 1}, {"t": "json", "v": -value - 1},
                {"t": "json", "v": str(value)}, {"t": "json", "v": float(value)}, {"t": "json", "v": [value]},
                {"t": "json", "v": value * 2**32}, {"t": "json", "v": unicode_digits(str(value))}]
    elif isinstance(value, str):
        out += [{"t": "json", "v": value + value}, {"t": "json", "v": value[:-1]}, {"t": "json", "v": value.upper()},
                {"t": "json", "v": unicode_digits(value)}, {"t": "json", "v": value + "\n"},
                {"t": "json", "v": [value]}, {"t": "json", "v": value + "\u0301"}]
    elif isinstance(value, list) and value:
        out += [{"t": "json", "v": value[:-1]}, {"t": "json", "v": value + value[-1:]}, {"t": "json", "v": value[::-1]},
                {"t": "json", "v": value * 40}]
    return out


def unicode_digits(text: str) -> str:
    """ASCII digits replaced by Arabic-Indic ones (``str.isdigit`` and ``int`` accept both)."""
    return "".join(chr(0x660 + int(c)) if c.isascii() and c.isdigit() else c for c in text)


def render_spec(spec: dict[str, Any]) -> Any:
    """The value (or Raw token) a spec describes."""
    t = spec["t"]
    if t == "json":
        return spec["v"]
    if t == "raw":
        return Raw(spec["text"])
    if t == "bigint":
        return Raw(("-" if spec.get("neg") else "") + "9" * spec["digits"])
    if t == "longstr":
        return "a" * spec["n"]
    if t == "deep":
        close = "]" if spec["open"] == "[" else "}"
        inner = spec["open"] if spec["open"] == "[" else '{"k":'
        tail = "0" if spec["open"] == "{" else ""
        return Raw(inner * spec["depth"] + tail + close * spec["depth"])
    if t == "longlist":
        return Raw("[" + ",".join(["0"] * spec["n"]) + "]")
    raise ValueError(f"unknown value spec {spec!r}")


_SIZE_KEYS = ("digits", "n", "depth")


def shrink_spec(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Smaller variants of a spec (half the digits, length or depth), best first."""
    out = []
    for key in _SIZE_KEYS:
        if key in spec and spec[key] > 1:
            for size in (spec[key] // 2, spec[key] // 10):
                if size >= 1:
                    out.append({**spec, key: size})
    if spec.get("t") == "json" and isinstance(spec.get("v"), str) and len(spec["v"]) > 8:
        out.append({**spec, "v": spec["v"][: len(spec["v"]) // 2]})
    return out
