"""``engine cache info|clear|prune``: what the cache directory holds, and keeping it small.

The cache (``ENGINE_CACHE_DIR``, default ``~/.cache/engine``) only ever holds things the engine can
rebuild: removing entries is always safe, also while other processes use them (``engine.cache``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engine.cli.args import UsageError
from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.render import emit_json, format_bytes, plural, table

EXAMPLES = """
  engine cache info                       where the cache is, its size by kind of entry, its cap
  engine cache prune                      evict least recently used entries down to the cap
  engine cache prune --older-than 7d      remove entries unused for a week (also 12h, 30m, 2w)
  engine cache prune --max-bytes 500M     evict down to 500 MiB (this once; the cap is ENGINE_CACHE_MAX_BYTES)
  engine cache clear                      remove every entry
  ENGINE_CACHE_DIR=/srv/cache engine cache info --json
"""

_DURATION = re.compile(r"\s*([0-9]{1,9}(?:\.[0-9]{1,6})?)\s*([smhdw])\s*\Z")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
             common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "cache", help="show, prune or clear the cache directory",
                    description="The cache directory holds kernels compiled from source, OpenCL program binaries, "
                                "tuned dispatch rows and (when asked for) tuning traces; everything in it is "
                                "rebuilt when missing. 'info' shows where it is and its size per kind of entry; "
                                "'prune' evicts the least recently used entries down to the size cap "
                                "(ENGINE_CACHE_MAX_BYTES, which writers also keep) or removes entries unused for "
                                "--older-than; 'clear' removes every entry. Safe while other processes run.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("action", choices=("info", "clear", "prune"), help="what to do")
    p.add_argument("--older-than", metavar="AGE",
                   help="prune: remove entries not used for AGE (a number and s, m, h, d or w: 7d, 12h)")
    p.add_argument("--max-bytes", metavar="SIZE",
                   help="prune: evict down to SIZE (500M, 2G, bytes) instead of the configured cap")
    p.set_defaults(func=run)


def parse_age(text: str) -> float:
    """``"7d"`` -> seconds; ``UsageError`` otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise UsageError(f"--older-than {text!r}: expected a number and a unit s, m, h, d or w, e.g. 7d or 12h")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def _info_doc(root: Path, cap: int) -> dict:
    from engine.cache import cache_info

    info = cache_info(root, max_bytes=cap)
    return {"root": str(info.root), "exists": info.exists, "writable": info.writable, "entries": info.entries,
            "bytes": info.bytes, "max_bytes": info.max_bytes,
            "kinds": [{"kind": k.kind, "entries": k.entries, "bytes": k.bytes} for k in info.kinds]}


def _render_info(doc: dict) -> str:
    state = "writable" if doc["writable"] else "read-only"
    if not doc["exists"]:
        state = f"does not exist yet, {state}"
    cap = format_bytes(doc["max_bytes"]) if doc["max_bytes"] else "none"
    lines = [f"cache: {doc['root']} ({state})",
             f"size:  {format_bytes(doc['bytes'])} in {plural(doc['entries'], 'entry', 'entries')}; "
             f"cap {cap} (ENGINE_CACHE_MAX_BYTES)"]
    if doc["kinds"]:
        lines += ["", table(["kind", "entries", "size"],
                            [[k["kind"], k["entries"], format_bytes(k["bytes"])] for k in doc["kinds"]],
                            right=(1, 2))]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from engine.cache import PruneResult, clear_cache, prune_cache
    from engine.settings import parse_size

    settings = registry_of(args).settings
    root, cap = Path(settings.cache_dir), settings.cache_max_bytes
    if args.action != "prune" and (args.older_than is not None or args.max_bytes is not None):
        raise UsageError(f"--older-than and --max-bytes apply to 'engine cache prune', not {args.action!r}")
    if args.action == "info":
        doc = _info_doc(root, cap)
        if args.json:
            emit_json(doc)
        else:
            print(_render_info(doc))
        return 0
    result: PruneResult | None
    if args.action == "clear":
        result = clear_cache(root)
    else:
        age = parse_age(args.older_than) if args.older_than is not None else None
        limit = cap
        if args.max_bytes is not None:
            try:
                limit = parse_size(args.max_bytes, what="--max-bytes")
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        result = prune_cache(root, older_than_s=age, max_bytes=limit)
        assert result is not None  # prune_cache waits for another pruner
    doc = {"root": str(root), "removed_entries": result.removed_entries, "removed_bytes": result.removed_bytes,
           "remaining_entries": result.remaining_entries, "remaining_bytes": result.remaining_bytes}
    if args.json:
        emit_json(doc)
    else:
        print(f"{root}: removed {plural(result.removed_entries, 'entry', 'entries')} "
              f"({format_bytes(result.removed_bytes)}); {plural(result.remaining_entries, 'entry', 'entries')} "
              f"({format_bytes(result.remaining_bytes)}) left")
    return 0
