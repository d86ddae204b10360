"""``engine tune BUNDLE --symbol batch=1..64``: tune ahead of time, then keep the dispatch table.

Tuning is ``graph.tune(...)`` (each new key runs once on zero-filled inputs, timing every candidate
of each multi-candidate task). The rows are kept in the dispatch cache by the runtime; ``--save``
also writes them into the bundle (``save_dispatch_table=True``), ``-o`` into a new bundle.
"""

from __future__ import annotations

import argparse
import time

from engine.cli.args import UsageError, parse_symbols
from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import (check_bundle_path, check_input_memory, check_output_path, key_grid, largest_key,
                                open_graph, read_outline)
from engine.cli.progress import Progress, watch_tuning
from engine.cli.render import emit_json, fit, group_rows, key_text, plural, table, terminal_width, wrap

EXAMPLES = """
  engine tune mlp.cgb --symbol batch=1..64 --save          tune 64 keys, write the table into mlp.cgb
  engine tune mlp.cgb --symbol batch=1,8,64 -o tuned.cgb   write a tuned copy, leave mlp.cgb as it is
  engine tune mlp.cgb --symbol batch=1..4096 --policy nearest --save
                                                          time only 1, 2, 4, ... 4096; serve the keys in
                                                          between with ENGINE_DISPATCH_POLICY=nearest
  engine tune model.cgb --symbol batch=1,8 --symbol seq=128,512 --device cuda:1 --json
"""

POLICIES = ("tune", "nearest")


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "tune", help="tune the dispatch table ahead of time and save it",
                    description="Time every candidate of every multi-candidate kernel at each key of the --symbol "
                                "grid and record the fastest (keys already in the table are kept). The rows go to "
                                "the dispatch cache; --save writes them into BUNDLE, -o into a new bundle. "
                                "--policy nearest times only the powers of two (and the ends) of each symbol's "
                                "values, for serving the keys in between with the 'nearest' dispatch policy.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"], common["device"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("-s", "--symbol", action="append", metavar="NAME=VALUES",
                   help="symbol values: 8, 1,8,64, 1..64 or 1..64:8 (every symbol needs one; repeat per symbol)")
    p.add_argument("--policy", choices=POLICIES, default="tune",
                   help="tune: time every key of the grid (default); nearest: time the powers of two and the "
                        "ends only, the rest is left to the 'nearest' dispatch policy at run time")
    p.add_argument("--save", action="store_true", help="write the dispatch table into BUNDLE")
    p.add_argument("-o", "--output", metavar="BUNDLE", help="write a tuned copy of the bundle to this path")
    p.add_argument("--warmup", type=int, metavar="N", help="untimed calls per candidate (default: the runtime's)")
    p.add_argument("--repeat", type=int, metavar="N", help="timed samples per candidate (default: the runtime's)")
    p.set_defaults(func=run)


def anchors(values: list[int]) -> list[int]:
    """The powers of two among ``values``' span, plus its ends (what ``--policy nearest`` times)."""
    lo, hi = min(values), max(values)
    picked = {lo, hi}
    p = 1
    while p <= hi:
        if p >= lo and p in values:
            picked.add(p)
        p *= 2
    return sorted(picked)


def _set_tuning(graph, warmup: int | None, repeat: int | None) -> None:
    """``--warmup``/``--repeat`` onto ``graph.tuning``; the runtime's own validation decides what is allowed."""
    changes = {k: v for k, v in (("warmup", warmup), ("repeat", repeat)) if v is not None}
    if not changes:
        return
    import attrs

    try:
        graph.tuning = attrs.evolve(graph.tuning, **changes)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--warmup/--repeat: {exc}") from None


def _cache_path(graph) -> str | None:
    """Where the runtime keeps this bundle's tuned rows (None when it keeps none)."""
    cache = getattr(graph, "dispatch_cache", None)
    path = getattr(cache, "path", None)
    return None if path is None else str(path)


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    registry = registry_of(args)
    target = None
    if args.save and args.output:
        raise UsageError("--save writes the table into BUNDLE itself and -o into a new bundle; give one of them "
                         "(-o keeps BUNDLE as it is)")
    if args.output:
        target = check_output_path(args.output, option="-o/--output")
    elif args.save:
        target = path
    outline = read_outline(path)
    meta, kinds = outline.meta, outline.kinds
    values = parse_symbols(args.symbol, meta.symbols, required=True)
    grid_values = values if args.policy == "tune" else {s: anchors(v) for s, v in values.items()}
    check_input_memory(meta, largest_key(grid_values, meta.symbols))  # tuning runs on zero-filled inputs
    graph = open_graph(path, args.device, kinds, registry)
    with graph:
        _set_tuning(graph, args.warmup, args.repeat)
        keys = key_grid(grid_values, meta.symbols)
        before = set(graph.dispatch_table)
        start = time.perf_counter()
        with Progress(len(keys), "tuning") as bar:
            watch_tuning(graph, args, bar=bar)
            rows = graph.tune(progress=lambda done, total, sym: bar.update(done, key_text(sym)), **grid_values)
        elapsed = time.perf_counter() - start
        names = [t.name for t in graph.compiled_tasks]
        multi = [i for i, t in enumerate(graph.compiled_tasks) if len(t.candidates) > 1]
        out_rows = []
        for key in keys:
            kt = tuple(key[s] for s in meta.symbols)
            choice = rows.get(kt) or graph.dispatch_table.get(kt) or graph.dispatch_table.trivial_choice()
            out_rows.append({
                "symbols": key,
                "choice": list(choice),
                "entries": {names[i]: graph.compiled_tasks[i].meta.candidates[choice[i]].entry for i in multi},
                "new": kt not in before,
            })
        if target is not None:
            graph.save(target, save_dispatch_table=True)
        all_keys = key_grid(values, meta.symbols)
        doc = {
            "bundle": str(path),
            "devices": [str(d) for d in graph.devices.values()],
            "policy": args.policy,
            "seconds": elapsed,
            "keys": out_rows,
            "tuned": sum(1 for r in out_rows if r["new"]),
            "kept": sum(1 for r in out_rows if not r["new"]),
            "untuned_keys_for_nearest": len(all_keys) - len(keys),
            "table_size": len(graph.dispatch_table),
            "saved_to": None if target is None else str(target),
            "cache": _cache_path(graph),
            "multi_candidate_tasks": [names[i] for i in multi],
        }
    if args.json:
        emit_json(doc)
        return 0
    print(render(doc))
    return 0


def render(doc: dict, width: int | None = None) -> str:
    """The text view, no line wider than ``width`` (default: the terminal's, 80 off a terminal).

    The table has a column per multi-candidate kernel; when that is wider than ``width`` (many
    kernels) it is transposed, a row per kernel and a column per group of keys, in as many blocks
    of columns as needed (``transposed``).
    """
    width = terminal_width() if width is None else width
    lines = wrap(f"tuned {doc['bundle']} on {', '.join(doc['devices'])}: {plural(doc['tuned'], 'new key')}, "
                 f"{plural(doc['kept'], 'key')} already in the table, in {doc['seconds']:.2f} s", width, indent="  ")
    if not doc["multi_candidate_tasks"]:
        lines += wrap("every kernel has a single candidate: there is nothing to choose, no timing was needed", width)
    else:
        tasks = doc["multi_candidate_tasks"]
        items = [(r["symbols"], (*(r["entries"][t] for t in tasks), "new" if r["new"] else "kept"))
                 for r in doc["keys"]]
        groups = group_rows(items)
        rows = [[label, count, *values] for label, count, values in groups]
        text = table(["keys", "count", *tasks, "row"], rows, right=(1,))
        if max(len(x) for x in text.splitlines()) > width:
            text = transposed(tasks, groups, width)
        lines.append(text)
    if doc["untuned_keys_for_nearest"]:
        lines += wrap(f"policy nearest: {plural(doc['untuned_keys_for_nearest'], 'other key')} of the grid take the "
                      f"choice of the nearest tuned key when served with ENGINE_DISPATCH_POLICY=nearest", width)
    if doc["saved_to"]:
        lines += wrap(f"dispatch table ({plural(doc['table_size'], 'key')}) saved into {doc['saved_to']}", width,
                      indent="  ")
    else:
        lines += wrap(f"dispatch table: {plural(doc['table_size'], 'key')}; not written into a bundle "
                      f"(--save writes it into the bundle, -o into a copy)", width)
    if doc["cache"]:
        lines += wrap(f"tuned rows are also kept in the dispatch cache: {short_path(doc['cache'])}", width,
                      indent="  ")
    return "\n".join(lines)


def transposed(tasks: list[str], groups: list[tuple[str, int, tuple]], width: int) -> str:
    """The choices with a row per kernel and a column per group of keys, in blocks that fit ``width``.

    Cells wider than half the width are cut (``fit``): the kernel and entry names are in ``--json``.
    """
    cap = max((width - 2) // 2, 8)
    names = [fit(n, cap) for n in ["kernel", "count", *tasks, "row"]]
    first = max(len(n) for n in names)
    columns = [[fit(label, cap), str(count), *(fit(str(v), cap) for v in values)] for label, count, values in groups]
    blocks: list[list[list[str]]] = [[]]
    used = first
    for column in columns:
        need = 2 + max(len(c) for c in column)
        if blocks[-1] and used + need > width:
            blocks.append([])
            used = first
        blocks[-1].append(column)
        used += need
    out = []
    for block in blocks:
        headers = [names[0], *(c[0] for c in block)]
        rows = [[names[r], *(c[r] for c in block)] for r in range(1, len(names))]
        out.append(table(headers, rows, width=width))
    return "\n\n".join(out)


def short_path(path: str) -> str:
    """A cache file's path for the text view: the home directory as ``~``, the bundle identity in its
    name cut to 8 hex digits (``13e1d590….<device tag>.txt``); ``--json`` has it in full."""
    import os
    import re

    home = os.path.expanduser("~")
    if home not in ("", "/") and (path == home or path.startswith(home + os.sep)):
        path = "~" + path[len(home):]
    head, sep, name = path.rpartition(os.sep)
    name = re.sub(r"\A([0-9a-f]{8})[0-9a-f]{56}", "\\1\u2026", name)
    return head + sep + name
