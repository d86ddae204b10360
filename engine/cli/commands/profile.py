"""``engine profile BUNDLE``: time every instruction of the plan at one key (``graph.profile``)."""

from __future__ import annotations

import argparse

from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import check_bundle_path, check_output_path, make_inputs, open_graph, read_outline
from engine.cli.progress import watch_tuning
from engine.cli.render import finish

EXAMPLES = """
  engine profile mlp.cgb --random --symbol batch=64              per-kernel median and min times
  engine profile mlp.cgb --input x=x.npy --repeat 100 --json     for scripts
  engine profile mlp.cgb --random --symbol batch=8 -o prof.json  the table, and the rows saved as JSON
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "profile", help="time each kernel of the plan at one key",
                    description="Run the graph --warmup times, then --repeat times timing each instruction: its "
                                "kernel, the candidate the dispatch table chose, input and output shapes, median "
                                "and min milliseconds, and its share of the total.",
                    examples=EXAMPLES,
                    parents=[common["debug"], common["json"], common["device"], common["inputs"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed runs first (default 1)")
    p.add_argument("--repeat", type=int, default=10, metavar="N", help="timed runs (default 10)")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the profile as JSON to FILE")
    p.set_defaults(func=run)


def rows_doc(profile) -> list[dict]:
    """The profile's rows as JSON (``ProfileRow.to_json``: samples included)."""
    return [dict(r.to_json()) for r in profile.rows]


def run(args: argparse.Namespace) -> int:
    from engine.cli.args import UsageError
    if args.warmup < 0 or args.repeat < 1:
        raise UsageError("--warmup must be at least 0 and --repeat at least 1")
    path = check_bundle_path(args.bundle)
    registry = registry_of(args)
    out_path = check_output_path(args.output, option="--output") if args.output else None
    graph = open_graph(path, args.device, read_outline(path).kinds, registry)
    watch_tuning(graph, args)
    with graph:
        inputs, key, _ = make_inputs(graph, args.input, args.symbol, random=args.random, seed=args.seed,
                                         registry=registry)
        profile = graph.profile(inputs, warmup=args.warmup, repeat=args.repeat)
        doc = {"bundle": str(path), "devices": [str(d) for d in graph.devices.values()], "symbols": key,
               "warmup": args.warmup, "repeat": args.repeat, "total_ms": float(profile.total_ms),
               "rows": rows_doc(profile)}
    return finish(doc, as_json=args.json, render=render, out_path=out_path, saved="profile")


def render(doc: dict) -> str:
    """The library's renderer (``print(graph.profile(...))`` shows the same table)."""
    from engine.runtime.profile import render_profile

    return render_profile(doc, subject=f"profile of {doc['bundle']}")
