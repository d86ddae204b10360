"""The mutation catalogue: what a case does to a seed, as JSON-able descriptions.

A case is ``{"seed": name, "form": "zip" | "memory" | "dir", "muts": [mutation, ...]}``; a mutation
is ``{"op": name, **params}``. ``generate_case`` draws one from a ``random.Random``; ``apply_case``
turns a description into a ``Draft`` (``craft``), so a case can be stored in the corpus, replayed
and shrunk. Operators run in phases: members (re-hashed by the listing that follows), listing,
manifest, manifest bytes, container (zip records or directory special files), raw archive bytes
(no re-hash: integrity errors must be clean).

Each operator states what the format spec (docs/bundle-format.md) says of its result:
``preserve`` (a valid bundle computing the same outputs), ``refuse`` (the spec requires a
``BundleError``) or ``any`` (a clean refusal or a correct run). ``native`` marks mutations of
what native code trusts (kernel binaries, entries, workspace sizes, kernel symbol order): a
crash, hang or wrong output after them is "native-trust", not a failure.
"""

from __future__ import annotations

import io
import json
import random
import re
import struct
from typing import Any, Callable

import attrs
import numpy as np

from fuzzing import jsonmut
from fuzzing.craft import Draft, ZipEntry, manifest_doc, write_zip
from fuzzing.seeds import Seed

__all__ = ["OPS", "NotApplicable", "apply_case", "generate_case", "expectation", "is_native", "shrink_mutation"]


class NotApplicable(Exception):
    """The mutation does not apply to this draft (its target was removed by an earlier one)."""


@attrs.frozen
class Op:
    phase: int
    apply: Callable[[Draft, dict[str, Any]], None]
    gen: Callable[[random.Random, "Context"], dict[str, Any] | None]
    expect: Callable[[dict[str, Any]], str]
    native: Callable[[dict[str, Any]], bool] = lambda m: False
    forms: tuple[str, ...] = ("zip", "memory", "dir")
    weight: float = 1.0


@attrs.frozen
class Context:
    seed: Seed
    form: str
    trees: dict[str, Any]  # parsed JSON members of the seed

    def json_members(self) -> list[str]:
        return sorted(self.trees)


OPS: dict[str, Op] = {}
PHASES = ("members", "listing", "manifest", "manifest_bytes", "container", "raw")
_READ_AT_LOAD = re.compile(r"(.*\.json|dispatch_table\.txt|graph_string\.txt|kernels/\d+/.*)\Z", re.S)
_REQUIRED = re.compile(r"(meta\.json|graph_execution\.json|kernels/\d+/.*|weights\.json)\Z", re.S)


def op(name: str, phase: str, *, expect: str | Callable[[dict[str, Any]], str], native=False,
       forms=("zip", "memory", "dir"), weight: float = 1.0):
    """Register an operator: the decorated function applies it; ``.gen`` is attached after."""
    def register(apply):
        exp = expect if callable(expect) else (lambda m, e=expect: e)
        nat = native if callable(native) else (lambda m, n=native: n)
        OPS[name] = Op(PHASES.index(phase), apply, lambda rng, ctx: None, exp, nat, tuple(forms), weight)
        return apply
    return register


def generator(name: str):
    def register(gen):
        OPS[name] = attrs.evolve(OPS[name], gen=gen)
        return gen
    return register


# ---- helpers ------------------------------------------------------------------------------------
def _member(draft: Draft, name: str) -> bytes:
    if name not in draft.members:
        raise NotApplicable(name)
    return draft.members[name]


def _is_valid_name(name: str) -> bool:
    """Spec §1.1 (plus: the name must be encodable as UTF-8)."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        return False
    if not name or "\x00" in name or "\\" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _conflicts(name: str, names) -> bool:
    """``a`` and ``a/b`` cannot both exist (spec §1.1)."""
    taken = set(names) | {"manifest.json"}
    parts = name.split("/")
    if any("/".join(parts[:i]) in taken for i in range(1, len(parts))):
        return True
    return any(other.startswith(name + "/") for other in taken)


def _native_member(name: str) -> bool:
    return name.startswith("kernels/") and not name.endswith("/meta.json")


_NAMES = ["x\ny", "evil\r\nINFO fake log line", "\x1b[2Jclear", "tab\tname", "\u202eRTL", "caf\u00e9.json",
          "../escape", "/abs", "a\\b", "C:drive", "a//b", "./meta.json", "kernels/0/../../x", "nul\x00byte",
          "meta.json/x", "kernels/0/meta.json/y", "dir/", "", "extra/unknown.bin", "zz_unknown",
          "\udcff-surrogate", "long:" + "n" * 5000, "deep/" * 200 + "x", "META.JSON", "weights.bin.old"]


def _name_pool(rng: random.Random, form: str) -> str:
    name = rng.choice(_NAMES)
    if form == "dir":  # file systems cap components at 255 bytes and have no NUL
        name = name.replace("\x00", "0")
        name = "/".join(p[:200] for p in name.split("/"))
    return name


# ---- JSON members -------------------------------------------------------------------------------
def _tree(draft: Draft, member: str) -> Any:
    try:
        return json.loads(_member(draft, member))
    except ValueError:
        raise NotApplicable(member) from None


def _node_exists(tree: Any, path: list) -> bool:
    try:
        jsonmut.get(tree, path)
    except (KeyError, IndexError, TypeError):
        return False
    return True


def _edit_json(draft: Draft, m: dict[str, Any]) -> None:
    """Apply one JSON mutation; the member is re-serialised and (later) re-hashed."""
    member, path, action = m["member"], list(m["path"]), m["action"]
    tree = draft.manifest if member == "manifest.json" else _tree(draft, member)
    if tree is None or not _node_exists(tree, path):
        raise NotApplicable(member)
    tree = _json_action(tree, path, action, m)
    text = jsonmut.dumps(tree, indent=m.get("indent", 1))
    if member == "manifest.json":
        draft.manifest = tree
    else:
        draft.members[member] = text.encode("utf-8", "surrogatepass")


def _json_action(tree: Any, path: list, action: str, m: dict[str, Any]) -> Any:
    node = jsonmut.get(tree, path)
    if action in ("replace", "expr"):
        return jsonmut.set_(tree, path, jsonmut.render_spec(m["spec"]))
    if action == "delete":
        if not path:
            raise NotApplicable("root")
        jsonmut.delete(tree, path)
        return tree
    if action == "add_key":
        if not isinstance(node, dict):
            raise NotApplicable("not an object")
        node[m["key"]] = jsonmut.render_spec(m["spec"])
        return tree
    if action == "dup_key":
        if not isinstance(node, dict) or not node:
            raise NotApplicable("not an object")
        first = next(iter(node))
        pairs = tuple(node.items()) + ((first, jsonmut.render_spec(m["spec"])),)
        return jsonmut.set_(tree, path, jsonmut.DupKeys(pairs))
    if action == "rename_key":
        if not isinstance(node, dict) or m["old"] not in node:
            raise NotApplicable("no such key")
        return jsonmut.set_(tree, path, {m["new"] if k == m["old"] else k: v for k, v in node.items()})
    if action == "reorder":
        if not isinstance(node, dict):
            raise NotApplicable("not an object")
        return jsonmut.set_(tree, path, dict(reversed(list(node.items()))))
    if action in ("swap", "dup_entry", "drop_entry"):
        return _list_action(tree, path, node, action, m)
    raise ValueError(f"unknown JSON action {action!r}")


def _list_action(tree: Any, path: list, node: Any, action: str, m: dict[str, Any]) -> Any:
    if not isinstance(node, list) or not node:
        raise NotApplicable("not a list")
    i, j = m["i"] % len(node), m.get("j", 0) % len(node)
    if action == "swap":
        node[i], node[j] = node[j], node[i]
    elif action == "dup_entry":
        node.insert(i, json.loads(json.dumps(node[i])))
    else:
        del node[i]
    return tree


_RAW_REFUSED = {"NaN", "Infinity", "-Infinity"}
#: Objects whose keys are data, not field names: a key added there is an entry, not an unknown key.
_MAPS = (["share_map"], ["files"])
#: Values an unknown key may hold in a valid bundle (JSON integers are bounded everywhere, §14).
_SAFE_VALUES = [{"t": "json", "v": v} for v in (None, True, 0, 1, "x", [], {}, [0], {"0": 0})]
_KERNEL_ABI = ("workspace", "candidates", "symbols", "share_map", "builtin")


def _json_expect(m: dict[str, Any]) -> str:
    action, spec = m["action"], m.get("spec") or {}
    if action == "dup_key" or spec.get("text") in _RAW_REFUSED:
        return "refuse"
    if action == "add_key" and m["key"].startswith("zz_") and spec in _SAFE_VALUES and m["path"][-1:] not in _MAPS:
        return "preserve"
    if action == "reorder" or m.get("equivalent"):
        return "preserve"
    return "any"


def _json_native(m: dict[str, Any]) -> bool:
    path = m["path"]
    return m["member"].startswith("kernels/") and bool(path) and path[0] in _KERNEL_ABI


def _gen_json(rng: random.Random, ctx: Context, member: str | None = None) -> dict[str, Any] | None:
    member = member or rng.choice(ctx.json_members())
    tree = ctx.trees[member]
    all_nodes = list(jsonmut.nodes(tree))
    path, value = rng.choice(all_nodes)
    action = rng.choices(["replace", "related", "delete", "add_key", "dup_key", "reorder", "swap", "dup_entry",
                          "drop_entry", "rename_key"], [6, 4, 2, 2, 1, 1, 1, 1, 1, 2])[0]
    m: dict[str, Any] = {"op": "json", "member": member, "path": path, "action": action}
    if action == "replace":
        m["spec"] = rng.choice(jsonmut.value_pool())
    elif action == "related":
        options = jsonmut.related_specs(rng, value)
        if not options:
            return None
        m["action"], m["spec"] = "replace", rng.choice(options)
    elif action in ("add_key", "dup_key"):
        if not isinstance(value, dict):
            return None
        m["key"] = rng.choice(["zz_unknown", "zz_" + "k" * 50, next(iter(value), "x")])
        m["spec"] = rng.choice(_SAFE_VALUES if rng.random() < 0.5 else jsonmut.value_pool())
    elif action in ("swap", "dup_entry", "drop_entry"):
        if not isinstance(value, list) or not value:
            return None
        m["i"], m["j"] = rng.randrange(len(value)), rng.randrange(len(value))
    elif action == "reorder" and not isinstance(value, dict):
        return None
    elif action == "rename_key":
        if not isinstance(value, dict) or not value:
            return None
        m["old"] = rng.choice(sorted(value))
        m["new"] = rng.choice([jsonmut.unicode_digits(m["old"]), "\u00b2", m["old"] + "_", " " + m["old"], "1_0",
                               "+0", "00", "-1", m["old"].upper(), "9" * 5000, m["old"] + "\n"])
    return m


@op("json", "members", expect=_json_expect, native=_json_native, weight=10)
def _op_json(draft: Draft, m: dict[str, Any]) -> None:
    _edit_json(draft, m)


@generator("json")
def _gen_json_any(rng, ctx):
    return _gen_json(rng, ctx)


@op("manifest_json", "manifest", expect=_json_expect, weight=2)
def _op_manifest_json(draft: Draft, m: dict[str, Any]) -> None:
    _edit_json(draft, {**m, "member": "manifest.json"})


@generator("manifest_json")
def _gen_manifest_json(rng, ctx):
    doc = manifest_doc(ctx.seed.members)
    m = _gen_json(rng, attrs.evolve(ctx, trees={"manifest.json": doc}), "manifest.json")
    if m is None:
        return None
    if rng.random() < 0.3:  # the version field, specially: "1.7" must load, "2" must get the upgrade message
        m = {"op": "json", "member": "manifest.json", "path": ["format_version"], "action": "replace",
             "spec": {"t": "json", "v": rng.choice(["1.7", "1", 2, "2.0", 0, "\u0661", "1.\u0661", "1_0", " 1",
                                                    "1.99999999999999999999999", "9" * 5000])}}
        if m["spec"]["v"] in ("1.7", "1"):
            m["equivalent"] = True
    return {**m, "op": "manifest_json"}


# ---- expressions --------------------------------------------------------------------------------
_EXPRS = ["(" * 1000 + "{s}" + ")" * 1000, "(" * 60 + "{s}" + ")" * 60, " + ".join(["{s}"] * 2000),
          "9" * 5000, "{s} * 1000000000000", "{s} * 9223372036854775807", "9223372036854775807 + 1",
          "-9223372036854775808 // -1", "{s} // 0", "{s} % 0", "ceil_div({s}, 0)", "min({s})", "max({s}, 1, 2)",
          "{s} ** 2", "__import__('os').system('true')", "{s}\u00b2", "{s} * \u00b2", "1_0", "\u0663",
          "{s}\n", "{s}\t*\t1", "-" * 3000 + "{s}", "zz_undeclared", "ceil_div", "min(", ")", "", "{s} * -1",
          "{s} - 1000000", "ceil_div({s}, -1)", "2 ** 63", "{s} * 4611686018427387904", "x" * 5000]


def _expression_nodes(ctx: Context) -> list[tuple[str, list, Any]]:
    """(member, path, value) of every shape entry, workspace and launch expression in the seed."""
    out = []
    for member, tree in ctx.trees.items():
        for path, value in jsonmut.nodes(tree):
            in_shape = len(path) >= 2 and path[-2] == "shape"
            if (in_shape or path[-1:] == ["workspace"]) and isinstance(value, (int, str)):
                out.append((member, path, value))
    return out


@op("expr", "members", expect=_json_expect, native=_json_native, weight=4)
def _op_expr(draft: Draft, m: dict[str, Any]) -> None:
    _edit_json(draft, m)


@generator("expr")
def _gen_expr(rng, ctx):
    nodes = _expression_nodes(ctx)
    workspaces = [n for n in nodes if n[1][-1:] == ["workspace"]]
    member, path, value = rng.choice(workspaces if workspaces and rng.random() < 0.3 else nodes)
    symbol = value if isinstance(value, str) and value.isidentifier() else "n" if ctx.seed.name != "mlp" else "batch"
    m = {"op": "expr", "member": member, "path": path, "action": "expr"}
    if member.startswith("kernels/") and rng.random() < 0.3 and isinstance(value, (int, str)):
        text = f"({value})" if isinstance(value, str) else f"2 * {value // 2}" if value % 2 == 0 else f"({value})"
        return {**m, "spec": {"t": "json", "v": text}, "equivalent": True}
    return {**m, "spec": {"t": "json", "v": rng.choice(_EXPRS).replace("{s}", symbol)}}


# ---- JSON text: formatting and encodings --------------------------------------------------------
@op("json_format", "members", expect="preserve", weight=1)
def _op_json_format(draft: Draft, m: dict[str, Any]) -> None:
    tree = _tree(draft, m["member"])
    style = m["style"]
    if style == "compact":
        text = json.dumps(tree, separators=(",", ":"))
    elif style == "ascii_escaped":
        text = json.dumps(tree, ensure_ascii=True).replace("a", "\\u0061")
    else:
        text = json.dumps(tree, indent="\t" if style == "tabs" else 8) + "\r\n"
    draft.members[m["member"]] = text.encode()


@generator("json_format")
def _gen_json_format(rng, ctx):
    return {"op": "json_format", "member": rng.choice(ctx.json_members()),
            "style": rng.choice(["compact", "ascii_escaped", "tabs", "wide"])}


_ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1+", "cesu-lone-surrogate"]


def _encode(text: str, enc: str) -> bytes:
    if enc == "latin-1+":
        return text.replace('"', '"\u00e9', 1).encode("latin-1", "replace")  # a byte that is not UTF-8
    if enc == "cesu-lone-surrogate":
        return text.encode() + b" \xed\xa0\x80"
    return text.encode(enc)


@op("encoding", "members", expect="refuse", weight=1)
def _op_encoding(draft: Draft, m: dict[str, Any]) -> None:
    draft.members[m["member"]] = _encode(_text(_member(draft, m["member"])), m["enc"])


def _text(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise NotApplicable("not UTF-8 any more") from None


@generator("encoding")
def _gen_encoding(rng, ctx):
    return {"op": "encoding", "member": rng.choice(ctx.json_members()), "enc": rng.choice(_ENCODINGS)}


@op("manifest_encoding", "manifest_bytes", expect="refuse", weight=1)
def _op_manifest_encoding(draft: Draft, m: dict[str, Any]) -> None:
    draft.manifest_bytes = _encode(_text(draft.manifest_bytes), m["enc"])


@generator("manifest_encoding")
def _gen_manifest_encoding(rng, ctx):
    return {"op": "manifest_encoding", "enc": rng.choice(_ENCODINGS)}


# ---- dispatch table text ------------------------------------------------------------------------
_TABLE_GAMES = ["underscore", "unicode_digit", "superscript", "plus", "negative", "extra_field", "missing_field",
                "huge_int", "bad_header", "crlf", "tabs", "bom", "blank_lines", "dup_row", "other_candidate",
                "empty", "not_utf8", "many_rows", "nul", "header_only", "float"]


def _table_text(rows: list[str], game: str, header: str, cols: int) -> str:
    row = rows[0] if rows else " ".join(["1"] * cols)
    fields = row.split()
    edits = {
        "underscore": lambda: [header, "1_0 " + " ".join(fields[1:])],
        "unicode_digit": lambda: [header, jsonmut.unicode_digits(row)],
        "superscript": lambda: [header, "\u00b2 " + " ".join(fields[1:])],
        "plus": lambda: [header, "+" + row],
        "negative": lambda: [header, "-1 " + " ".join(fields[1:])],
        "extra_field": lambda: [header, row + " 0"],
        "missing_field": lambda: [header, " ".join(fields[:-1])],
        "huge_int": lambda: [header, "9" * 5000 + " " + " ".join(fields[1:])],
        "bad_header": lambda: [header + " extra", row],
        "tabs": lambda: [header, "\t".join(fields)],
        "blank_lines": lambda: [header, "", row, "   ", ""],
        "dup_row": lambda: [header, row, row],
        "header_only": lambda: [header],
        "nul": lambda: [header, row + "\x00"],
        "float": lambda: [header, " ".join(fields[:-1] + ["0.0"])],
    }
    if game in edits:
        return "\n".join(edits[game]()) + "\n"
    raise ValueError(game)


# Spec §10: two rows for one key are refused.
_TABLE_EXPECT = {"crlf": "any", "tabs": "preserve", "blank_lines": "preserve", "dup_row": "refuse",
                 "other_candidate": "preserve", "header_only": "preserve", "bom": "any", "many_rows": "any"}


@op("table", "members", expect=lambda m: _TABLE_EXPECT.get(m["game"], "refuse"), weight=3)
def _op_table(draft: Draft, m: dict[str, Any]) -> None:
    text = _member(draft, "dispatch_table.txt").decode()
    lines = text.splitlines()
    header, rows = lines[0], lines[1:]
    cols = len(rows[0].split()) if rows else 0
    game = m["game"]
    if game == "crlf":
        data = text.replace("\n", "\r\n").encode()
    elif game == "bom":
        data = b"\xef\xbb\xbf" + text.encode()
    elif game == "empty":
        data = b""
    elif game == "not_utf8":
        data = text.encode() + b"\xff\xfe\n"
    elif game == "many_rows":
        n = m.get("n", 1_000_001)
        data = (header + "\n" + "".join(f"{i} " + " ".join(rows[0].split()[len(header.split()):]) + "\n"
                                        for i in range(n))).encode()
    elif game == "other_candidate":
        data = _other_candidate(draft, header, rows).encode()
    else:
        data = _table_text(rows, game, header, cols).encode()
    draft.members["dispatch_table.txt"] = data


def _other_candidate(draft: Draft, header: str, rows: list[str]) -> str:
    """Every row picking candidate 0 (the candidates compute the same thing)."""
    n_sym = len(header.split())
    out = [header]
    for row in rows:
        fields = row.split()
        out.append(" ".join(fields[:n_sym] + ["0"] * (len(fields) - n_sym)))
    return "\n".join(out) + "\n"


@generator("table")
def _gen_table(rng, ctx):
    if "dispatch_table.txt" not in ctx.seed.members:
        return None
    game = rng.choice(_TABLE_GAMES)
    m = {"op": "table", "game": game}
    if game == "many_rows":
        m["n"] = rng.choice([1_000_001, 2000])
        if m["n"] == 2000:
            m["game"] = "many_rows"
    return m


# ---- members ------------------------------------------------------------------------------------
@op("drop", "members", expect=lambda m: "refuse-alone" if _REQUIRED.match(m["name"]) else "any", weight=2)
def _op_drop(draft: Draft, m: dict[str, Any]) -> None:
    _member(draft, m["name"])
    del draft.members[m["name"]]


@generator("drop")
def _gen_drop(rng, ctx):
    return {"op": "drop", "name": rng.choice(sorted(ctx.seed.members))}


@op("empty", "members", expect="any", native=lambda m: _native_member(m["name"]), weight=1)
def _op_empty(draft: Draft, m: dict[str, Any]) -> None:
    _member(draft, m["name"])
    draft.members[m["name"]] = b""


@generator("empty")
def _gen_empty(rng, ctx):
    return {"op": "empty", "name": rng.choice(sorted(ctx.seed.members))}


def _rename_expect(m: dict[str, Any]) -> str:
    if not _is_valid_name(m["new"]) or m["new"] == "manifest.json":
        return "refuse"
    return "refuse-alone" if _REQUIRED.match(m["name"]) else "any"


@op("rename", "members", expect=_rename_expect, native=lambda m: _native_member(m["name"]), weight=2)
def _op_rename(draft: Draft, m: dict[str, Any]) -> None:
    data = _member(draft, m["name"])
    del draft.members[m["name"]]
    draft.members[m["new"]] = data


@generator("rename")
def _gen_rename(rng, ctx):
    new = _name_pool(rng, ctx.form) if rng.random() < 0.7 else rng.choice(sorted(ctx.seed.members))
    name = rng.choice(sorted(ctx.seed.members))
    if new == name:
        return None
    if ctx.form == "dir" and (_conflicts(new, set(ctx.seed.members) - {name}) or not _is_valid_name(new)):
        return None  # the directory form cannot hold an invalid name (the zip forms test those)
    return {"op": "rename", "name": name, "new": new}


def _plain(name: str) -> bool:
    """No control or format characters: names the spec is sure to accept (others may be refused)."""
    import unicodedata

    return all(unicodedata.category(c)[0] != "C" for c in name)


def _add_expect(m: dict[str, Any]) -> str:
    if m["name"].endswith("/") and _is_valid_name(m["name"][:-1]):  # a zip directory entry (ignored)
        return "any"
    if not _is_valid_name(m["name"]) or m["name"] == "manifest.json" or m.get("conflict") or m.get("unlisted"):
        return "refuse"
    return "preserve" if m.get("fresh") and _plain(m["name"]) else "any"


@op("add", "members", expect=_add_expect, weight=2)
def _op_add(draft: Draft, m: dict[str, Any]) -> None:
    draft.members[m["name"]] = m.get("data", "extra bytes").encode()
    if m.get("unlisted"):
        draft.unlisted.add(m["name"])


@generator("add")
def _gen_add(rng, ctx):
    name = _name_pool(rng, ctx.form)
    conflict = _conflicts(name, ctx.seed.members)
    if ctx.form == "dir" and (conflict or not _is_valid_name(name) or name.endswith("/")):
        return None
    return {"op": "add", "name": name, "fresh": name not in ctx.seed.members and not conflict,
            "conflict": conflict, "unlisted": rng.random() < 0.3}


@op("swap", "members", expect="any", native=lambda m: _native_member(m["a"]) or _native_member(m["b"]), weight=1)
def _op_swap(draft: Draft, m: dict[str, Any]) -> None:
    a, b = _member(draft, m["a"]), _member(draft, m["b"])
    draft.members[m["a"]], draft.members[m["b"]] = b, a


@generator("swap")
def _gen_swap(rng, ctx):
    a, b = rng.sample(sorted(ctx.seed.members), 2)
    return {"op": "swap", "a": a, "b": b}


_C_EDITS = {"garbage": b"this is not C }{", "loop": b"#include <stdint.h>\nint32_t %s(void *const *t, "
            b"const int64_t *s, void *w) { for (;;) {} return 0; }\n", "fail": b"#include <stdint.h>\nint32_t %s("
            b"void *const *t, const int64_t *s, void *w) { return 42; }\n", "empty_unit": b"\n"}


@op("binary", "members", expect="any", native=True, weight=2)
def _op_binary(draft: Draft, m: dict[str, Any]) -> None:
    """A kernel binary changed and re-hashed: native code the bundle vouches for (native-trust)."""
    data = bytearray(_member(draft, m["name"]))
    action = m["action"]
    if action == "flip" and data:
        data[m["offset"] % len(data)] ^= 1 << m["bit"]
    elif action == "truncate":
        data = data[: m["offset"] % (len(data) + 1)]
    elif action in _C_EDITS:
        data = bytearray(_C_EDITS[action].replace(b"%s", m.get("entry", "x").encode()) if b"%s" in
                         _C_EDITS[action] else _C_EDITS[action])
    draft.members[m["name"]] = bytes(data)


@generator("binary")
def _gen_binary(rng, ctx):
    names = [n for n in ctx.seed.members if _native_member(n)]
    if not names:
        return None
    name = rng.choice(sorted(names))
    c_edits = [e for e in _C_EDITS if e != "loop" or rng.random() < 0.05]  # a hang costs a whole timeout
    action = rng.choice(["flip", "flip", "truncate"] + (c_edits if name.endswith(".c") else []))
    entry = None
    if name.endswith(".c"):
        meta = ctx.trees[name.rsplit("/", 1)[0] + "/meta.json"]
        entry = meta["candidates"][0]["entry"]
    return {"op": "binary", "name": name, "action": action, "offset": rng.randrange(1 << 20), "bit": rng.randrange(8),
            "entry": entry}


@op("weights", "members", expect="any", weight=1)
def _op_weights(draft: Draft, m: dict[str, Any]) -> None:
    data = bytearray(_member(draft, "weights.bin"))
    if m["action"] == "truncate":
        data = data[: m["n"] % (len(data) + 1)]
    elif m["action"] == "append":
        data += bytes(m["n"] % 5000)
    else:
        data[m["n"] % len(data)] ^= 0x40
    draft.members["weights.bin"] = bytes(data)


@generator("weights")
def _gen_weights(rng, ctx):
    if "weights.bin" not in ctx.seed.members:
        return None
    return {"op": "weights", "action": rng.choice(["truncate", "append", "flip"]), "n": rng.randrange(1 << 20)}


# ---- weights.npz --------------------------------------------------------------------------------
def _seed_arrays(draft: Draft) -> list[np.ndarray]:
    from engine.dtypes import DTYPES

    entries = json.loads(_member(draft, "weights.json"))
    blob = _member(draft, "weights.bin")
    out = []
    for e in entries:
        dtype = np.dtype(DTYPES[e["dtype"]].numpy)
        out.append(np.frombuffer(blob, dtype, int(np.prod(e["shape"], dtype=np.int64)), e["offset"])
                   .reshape(e["shape"]))
    return out


def _npy_header(dtype: str, shape: tuple[int, ...], fortran: bool = False) -> bytes:
    header = repr({"descr": dtype, "fortran_order": fortran, "shape": shape}).encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def _npz(arrays: dict[str, bytes], method: int = 0) -> bytes:
    return write_zip([ZipEntry(name.encode(), data, method=method) for name, data in arrays.items()])


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


_BOMB_CACHE: dict[int, bytes] = {}


def _bomb(mib: int) -> bytes:
    """An npz whose one member inflates to ``mib`` MiB of zeros (about 1/1000 of that stored)."""
    if mib not in _BOMB_CACHE:
        import zlib

        header = _npy_header("<f4", (mib * 2**18,))
        c, crc = zlib.compressobj(9, zlib.DEFLATED, -15), zlib.crc32(header)
        parts = [c.compress(header)]
        zeros = bytes(2**20)
        for _ in range(mib):
            parts.append(c.compress(zeros))
            crc = zlib.crc32(zeros, crc)
        parts.append(c.flush())
        _BOMB_CACHE[mib] = _patched_zip(b"arr_0.npy", b"".join(parts), crc, len(header) + mib * 2**20)
    return _BOMB_CACHE[mib]


def _patched_zip(name: bytes, body: bytes, crc: int, usize: int) -> bytes:
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 33, crc, len(body), usize, len(name), 0) + name
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 33, crc, len(body), usize, len(name),
                          0, 0, 0, 0, 0, 0) + name
    start = len(local) + len(body)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), start, 0)
    return local + body + central + eocd


_NPZ_EXPECT = {"valid": "preserve", "valid_compressed": "preserve", "valid_no_json": "preserve",
               "fortran": "any", "extra_array": "any"}


@op("npz", "members", expect=lambda m: _NPZ_EXPECT.get(m["game"], "refuse"), weight=3)
def _op_npz(draft: Draft, m: dict[str, Any]) -> None:
    """weights.json + weights.bin converted to a reference ``weights.npz``, then games played on it."""
    arrays = _seed_arrays(draft)
    game = m["game"]
    npys = {f"arr_{i}.npy": _npy(a) for i, a in enumerate(arrays)}
    if game in ("valid", "valid_no_json", "extra_array"):
        if game == "extra_array":
            npys["arr_99.npy"] = _npy(np.zeros(3))
        data = _npz(npys)
    elif game == "valid_compressed":
        data = _npz(npys, method=8)
    elif game == "npy":
        data = _npy(arrays[0])
    elif game == "huge_shape":
        npys["arr_0.npy"] = _npy_header("<f4", (2**40,)) + bytes(64)
        data = _npz(npys)
    elif game == "huge_shape_2d":
        npys["arr_0.npy"] = _npy_header("<f4", (2**31, 2**31)) + bytes(64)
        data = _npz(npys)
    elif game == "bomb":
        data = _bomb(m.get("mib", 512))
    elif game == "pickle":
        npys["arr_0.npy"] = _npy(np.array([{"a": 1}], dtype=object))
        data = _npz(npys)
    elif game == "wrong_dtype":
        npys["arr_0.npy"] = _npy(arrays[0].astype(np.float64))
        data = _npz(npys)
    elif game == "wrong_shape":
        npys["arr_0.npy"] = _npy(arrays[0].reshape(-1)[:-1])
        data = _npz(npys)
    elif game == "missing":
        npys.pop(f"arr_{len(arrays) - 1}.npy")
        data = _npz(npys)
    elif game == "truncated_data":
        npys["arr_0.npy"] = npys["arr_0.npy"][:-4]
        data = _npz(npys)
    elif game == "fortran":
        a = arrays[0]
        npys["arr_0.npy"] = _npy_header(a.dtype.str, a.shape, True) + np.asfortranarray(a).tobytes(order="F")
        data = _npz(npys)
    elif game == "garbage":
        data = b"PK\x03\x04 not really a zip"
    elif game == "bad_header":
        npys["arr_0.npy"] = b"\x93NUMPY\x01\x00\x10\x00{'descr': __import__('os')}" + bytes(16)
        data = _npz(npys)
    elif game == "nested_npz":
        npys["arr_0.npy"] = _npz({"arr_0.npy": npys["arr_0.npy"]})
        data = _npz(npys)
    else:
        raise ValueError(game)
    draft.members["weights.npz"] = data
    del draft.members["weights.bin"]
    if game == "valid_no_json" or m.get("drop_json"):
        draft.members.pop("weights.json", None)


_NPZ_GAMES = ["valid", "valid_compressed", "valid_no_json", "npy", "huge_shape", "huge_shape_2d", "bomb", "pickle",
              "wrong_dtype", "wrong_shape", "missing", "truncated_data", "fortran", "garbage", "bad_header",
              "nested_npz", "extra_array"]


@generator("npz")
def _gen_npz(rng, ctx):
    if "weights.bin" not in ctx.seed.members:
        return None
    game = rng.choice(_NPZ_GAMES)
    m = {"op": "npz", "game": game, "drop_json": rng.random() < 0.3}
    if game == "bomb":
        m["mib"] = 512
    return m


# ---- listing (after re-hash) --------------------------------------------------------------------
@op("unlist", "listing", expect="refuse", weight=1)
def _op_unlist(draft: Draft, m: dict[str, Any]) -> None:
    if m["name"] not in draft.manifest["files"]:
        raise NotApplicable(m["name"])
    del draft.manifest["files"][m["name"]]


@generator("unlist")
def _gen_unlist(rng, ctx):
    return {"op": "unlist", "name": rng.choice(sorted(ctx.seed.members))}


@op("phantom", "listing", expect=lambda m: "refuse", weight=1)
def _op_phantom(draft: Draft, m: dict[str, Any]) -> None:
    draft.manifest["files"][m["name"]] = {"sha256": "0" * 64, "size": m["size"]}


@generator("phantom")
def _gen_phantom(rng, ctx):
    name = rng.choice(["kernels/9/meta.json", "weights.bin", "zz_missing", "kernels/0/zz.so"])
    if name in ctx.seed.members:
        return None
    return {"op": "phantom", "name": name, "size": rng.choice([0, 1, 2**40])}


@op("size_skew", "listing", expect="refuse", weight=1)
def _op_size_skew(draft: Draft, m: dict[str, Any]) -> None:
    entry = draft.manifest["files"].get(m["name"])
    if entry is None:
        raise NotApplicable(m["name"])
    entry["size"] = max(entry["size"] + m["delta"], 0) if m["delta"] != 0 else entry["size"] + 2**63
    if entry["size"] == len(draft.members[m["name"]]):
        raise NotApplicable("no change")


@generator("size_skew")
def _gen_size_skew(rng, ctx):
    return {"op": "size_skew", "name": rng.choice(sorted(ctx.seed.members)), "delta": rng.choice([-1, 1, 4096, 0])}


def _stale_expect(m: dict[str, Any]) -> str:
    return "refuse" if _READ_AT_LOAD.match(m["name"]) else "any"


@op("stale", "manifest", expect=_stale_expect, weight=2)
def _op_stale(draft: Draft, m: dict[str, Any]) -> None:
    """A member's bytes changed after the manifest was written (no re-hash)."""
    data = bytearray(_member(draft, m["name"]))
    if not data:
        raise NotApplicable("empty")
    data[m["offset"] % len(data)] ^= 1 << m["bit"]
    draft.members[m["name"]] = bytes(data)


@generator("stale")
def _gen_stale(rng, ctx):
    return {"op": "stale", "name": rng.choice(sorted(ctx.seed.members)), "offset": rng.randrange(1 << 20),
            "bit": rng.randrange(8)}


# ---- container: zip records and directory special files ----------------------------------------
def _entry(draft: Draft, name: str) -> int:
    for i, e in enumerate(draft.entries):
        if e.name == name.encode("utf-8", "surrogatepass"):
            return i
    raise NotApplicable(name)


_ZIP_EXPECT = {"dir_entry": "preserve", "comment": "preserve", "shuffle": "preserve", "utf8_flag": "any",
               "cp437_name": "any"}


@op("zip", "container", expect=lambda m: _ZIP_EXPECT.get(m["game"], "refuse"), forms=("zip", "memory"), weight=4)
def _op_zip(draft: Draft, m: dict[str, Any]) -> None:
    game, entries = m["game"], draft.entries
    i = _entry(draft, m["name"])
    e = entries[i]
    if game == "duplicate":
        entries.insert(i + 1, attrs.evolve(e))
    elif game == "dir_entry":
        entries.insert(0, ZipEntry(b"kernels/", b""))
    elif game == "deflate":
        e.method = 8
    elif game == "encrypted":
        e.flags |= 0x0001
    elif game == "descriptor":
        e.descriptor = True
    elif game == "local_name":
        e.local_name = e.name[:-1] + b"X"
    elif game == "alias":
        at = len(entries) - 1  # the entry at ``at`` and after move one place down
        entries.insert(at, ZipEntry(m["alias"].encode(), b"", alias_of=i if i < at else i + 1))
    elif game == "comment":
        draft.comment = b"a comment"
    elif game == "shuffle":
        random.Random(m["seed"]).shuffle(entries)
    elif game == "utf8_flag":
        e.flags |= 0x0800
    elif game == "cp437_name":
        e.name = e.name.replace(b"a", b"\x84", 1)
    elif game == "conflict":
        entries.insert(i, ZipEntry(e.name + b"/x", b""))
    else:
        raise ValueError(game)


_ZIP_GAMES = ["duplicate", "dir_entry", "deflate", "encrypted", "descriptor", "local_name", "alias", "comment",
              "shuffle", "utf8_flag", "cp437_name", "conflict"]


@generator("zip")
def _gen_zip(rng, ctx):
    name = rng.choice(sorted(ctx.seed.members) + ["manifest.json"])
    return {"op": "zip", "game": rng.choice(_ZIP_GAMES), "name": name, "alias": rng.choice(["zz_alias", name]),
            "seed": rng.randrange(1000)}


@op("special", "container", expect=lambda m: "refuse", forms=("dir",), weight=3)
def _op_special(draft: Draft, m: dict[str, Any]) -> None:
    kind, name = m["kind"], m["name"]
    if name not in draft.members and name != "manifest.json":
        raise NotApplicable(name)
    specials = {"fifo": ("fifo",), "symlink_out": ("symlink", "/etc/hostname"),
                "symlink_up": ("symlink", "../" * 3 + "etc/hostname"), "dangling": ("symlink", "no/such/file"),
                "dir": ("dir",), "symlink_dir": ("symlink", "/"), "symlink_self": ("symlink", name.rsplit("/", 1)[-1])}
    draft.specials[name] = specials[kind]


@generator("special")
def _gen_special(rng, ctx):
    return {"op": "special", "name": rng.choice(sorted(ctx.seed.members) + ["manifest.json"]),
            "kind": rng.choice(["fifo", "symlink_out", "symlink_up", "dangling", "dir", "symlink_dir",
                                "symlink_self"])}


# ---- raw archive bytes (no re-hash) -------------------------------------------------------------
_RAW_EXPECT = {"truncate": "refuse", "prepend": "refuse", "concat": "refuse"}


@op("raw", "raw", expect=lambda m: _RAW_EXPECT.get(m["game"], "any"), forms=("zip", "memory"), weight=5)
def _op_raw(draft: Draft, m: dict[str, Any]) -> None:
    data = bytearray(draft.raw if draft.raw is not None else write_zip(draft.entries, comment=draft.comment))
    game, pos = m["game"], m["pos"] % max(len(data), 1)
    n = m.get("n", 1)
    if game == "flip":
        data[pos] ^= 1 << m["bit"]
    elif game == "truncate":
        data = data[:pos]
    elif game == "prepend":
        data = bytearray(b"\x00" * n) + data
    elif game == "append":
        data += b"J" * n
    elif game == "concat":
        data = data + data
    elif game == "overwrite":
        data[pos:pos + n] = random.Random(m["bit"]).randbytes(len(data[pos:pos + n]))
    elif game == "insert":
        data[pos:pos] = b"\x00" * n
    elif game == "delete":
        del data[pos:pos + n]
    draft.raw = bytes(data)


@generator("raw")
def _gen_raw(rng, ctx):
    game = rng.choice(["flip", "flip", "flip", "truncate", "prepend", "append", "concat", "overwrite", "insert",
                       "delete"])
    # Half the positions near the end: the central directory and the manifest live there.
    pos = rng.randrange(1 << 20) if rng.random() < 0.5 else -rng.randrange(1, 2048)
    return {"op": "raw", "game": game, "pos": pos, "bit": rng.randrange(8), "n": rng.choice([1, 4, 22, 100, 4096])}


# ---- cases --------------------------------------------------------------------------------------
_SEED_WEIGHTS = {"mlp": 4, "inplace": 4, "twokind": 2}
_FORM_WEIGHTS = {"zip": 45, "memory": 30, "dir": 25}


def _context(seed: Seed, form: str, cache: dict[str, dict[str, Any]]) -> Context:
    if seed.name not in cache:
        cache[seed.name] = {n: json.loads(d) for n, d in seed.members.items() if n.endswith(".json")}
    return Context(seed, form, cache[seed.name])


def generate_case(rng: random.Random, seeds: dict[str, Seed], trees: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One case: a seed, a form and one to three mutations allowed in that form."""
    names = [n for n in _SEED_WEIGHTS if n in seeds]
    seed = seeds[rng.choices(names, [_SEED_WEIGHTS[n] for n in names])[0]]
    form = rng.choices(list(_FORM_WEIGHTS), list(_FORM_WEIGHTS.values()))[0]
    ctx = _context(seed, form, trees)
    ops = [(name, o) for name, o in OPS.items() if form in o.forms]
    muts: list[dict[str, Any]] = []
    count = rng.choices([1, 2, 3], [70, 20, 10])[0]
    while len(muts) < count:
        name, o = rng.choices(ops, [o.weight for _, o in ops])[0]
        m = o.gen(rng, ctx)
        if m is not None and not _targets(m) & set().union(*map(_targets, muts)):
            muts.append(m)
    return {"seed": seed.name, "form": form, "muts": muts}


_OP_TARGETS = {"table": "dispatch_table.txt", "npz": "weights.bin", "weights": "weights.bin", "raw": "<raw>",
               "manifest_json": "manifest.json", "manifest_encoding": "manifest.json", "zip": "<container>",
               "special": "<container>"}


def _targets(m: dict[str, Any]) -> set[str]:
    """What a mutation edits: one mutation per target, so a later one cannot undo an earlier one."""
    out = {m[k] for k in ("member", "name", "a", "b", "new") if isinstance(m.get(k), str)}
    if m["op"] in _OP_TARGETS:
        out.add(_OP_TARGETS[m["op"]])
    if m["op"] == "npz":
        out.add("weights.json")
    return out


def apply_case(case: dict[str, Any], seeds: dict[str, Seed]) -> tuple[Draft, list[dict[str, Any]]]:
    """The draft a case describes, and the mutations that applied (in phase order)."""
    seed = seeds[case["seed"]]
    draft = Draft(case["form"], dict(seed.members))
    if case.get("file"):  # a corpus entry's stored bytes: the mutations only say what to expect
        from pathlib import Path

        draft.raw = Path(case["file"]).read_bytes()
        return draft, list(case["muts"])
    applied = []
    ordered = sorted(case["muts"], key=lambda m: OPS[m["op"]].phase)
    for phase in range(len(PHASES)):
        _enter_phase(draft, phase)
        for m in (m for m in ordered if OPS[m["op"]].phase == phase):
            try:
                OPS[m["op"]].apply(draft, m)
            except NotApplicable:
                continue
            applied.append(m)
    return draft, applied


def _enter_phase(draft: Draft, phase: int) -> None:
    name = PHASES[phase]
    if name == "listing":
        draft.manifest = manifest_doc(draft.members)
        for unlisted in draft.unlisted:
            draft.manifest["files"].pop(unlisted, None)
    elif name == "manifest_bytes":
        draft.manifest_bytes = jsonmut.dumps(draft.manifest).encode("utf-8", "surrogatepass")
    elif name == "container" and draft.form != "dir":
        draft.entries = draft.zip_entries()


def expectation(applied: list[dict[str, Any]]) -> str:
    """What the spec says of a case: refuse if any mutation must be refused, preserve if all preserve.

    ``refuse-alone`` (a required member dropped or renamed) counts only in a case of one mutation:
    another one may make the bundle stop needing the member (a candidate's binary deleted too).
    """
    expects = [OPS[m["op"]].expect(m) for m in applied]
    expects = [("refuse" if len(applied) == 1 else "any") if e == "refuse-alone" else e for e in expects]
    if "refuse" in expects:
        return "refuse"
    return "preserve" if all(e == "preserve" for e in expects) else "any"


def describe(applied: list[dict[str, Any]], expect: str | None = None) -> str:
    """``op:game`` of each mutation (of those expecting ``expect``): what tells two
    accepted-but-invalid cases apart."""
    chosen = [m for m in applied if expect is None or OPS[m["op"]].expect(m).startswith(expect)]
    return "+".join(f"{m['op']}:{m.get('game') or m.get('action') or m.get('enc') or m.get('kind') or ''}"
                    for m in chosen)


def is_native(applied: list[dict[str, Any]]) -> bool:
    return any(OPS[m["op"]].native(m) for m in applied)


def shrink_mutation(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Smaller variants of one mutation (the changed value, a size, a count), best first."""
    out = []
    if "spec" in m:
        out += [{**m, "spec": s} for s in jsonmut.shrink_spec(m["spec"])]
    for key in ("n", "mib"):
        if isinstance(m.get(key), int) and m[key] > 1:
            out.append({**m, key: m[key] // 4 or 1})
    return out
