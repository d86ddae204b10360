"""``engine trace BUNDLE -o trace.json``: one run recorded as a Chrome trace (``graph.trace``)."""

from __future__ import annotations

import argparse
from collections import defaultdict

from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import check_bundle_path, check_output_path, make_inputs, open_graph, read_outline
from engine.cli.progress import watch_tuning
from engine.cli.render import emit_json, key_text, plural, table

EXAMPLES = """
  engine trace mlp.cgb --random --symbol batch=8 -o trace.json   then open it in https://ui.perfetto.dev
  engine trace mlp.cgb --input x=x.npy -o trace.json --json      a summary of the events for scripts
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "trace", help="record one run as a Chrome trace (chrome://tracing, Perfetto)",
                    description="Run the graph once, recording every instruction (and, at a new key, the timing "
                                "of its candidates) as a Chrome trace-event JSON file, and print a summary of "
                                "where the time went.",
                    examples=EXAMPLES,
                    parents=[common["debug"], common["json"], common["device"], common["inputs"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("-o", "--output", metavar="FILE", default="trace.json",
                   help="where to write the trace (default trace.json)")
    p.set_defaults(func=run)


def summarize(trace: dict) -> dict:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in spans:
        by_name[str(e.get("name", "?"))].append(float(e.get("dur", 0.0)))
    start = min((float(e.get("ts", 0.0)) for e in spans), default=0.0)
    end = max((float(e.get("ts", 0.0)) + float(e.get("dur", 0.0)) for e in spans), default=0.0)
    top = sorted(((name, sum(d), len(d)) for name, d in by_name.items()), key=lambda t: -t[1])[:10]
    return {"events": len(events), "spans": len(spans), "span_us": end - start,
            "top": [{"name": n, "total_us": t, "count": c} for n, t, c in top]}


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    registry = registry_of(args)
    out_path = check_output_path(args.output, option="-o/--output")
    graph = open_graph(path, args.device, read_outline(path).kinds, registry)
    watch_tuning(graph, args)
    with graph:
        inputs, key, _ = make_inputs(graph, args.input, args.symbol, random=args.random, seed=args.seed,
                                         registry=registry)
        trace = graph.trace(inputs, path=str(out_path))
        doc = {"bundle": str(path), "devices": [str(d) for d in graph.devices.values()], "symbols": key,
               "path": str(out_path), **summarize(trace)}
    if args.json:
        emit_json(doc)
        return 0
    print(f"wrote {doc['path']}: {plural(doc['events'], 'event')}, {plural(doc['spans'], 'span')} over "
          f"{doc['span_us'] / 1000:.3f} ms ({key_text(key)} on {', '.join(doc['devices'])}); open it in "
          f"https://ui.perfetto.dev or chrome://tracing")
    if doc["top"]:
        print(table(["span", "count", "total us"], [[t["name"], t["count"], f"{t['total_us']:.1f}"]
                                                    for t in doc["top"]], right=(1, 2)))
    return 0
