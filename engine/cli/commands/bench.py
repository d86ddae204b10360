"""``engine bench BUNDLE --symbol batch=1,8,64``: latency and throughput per key and device.

Each key is run once untimed first (that run tunes the key if the dispatch table lacks it, and
prepares the fast path), then ``--warmup`` untimed runs, then ``--repeat`` timed runs, each one
``run_async`` plus a device synchronize, on the host clock. The figures are what a caller of
``run_async`` sees, input validation included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from engine.cli.args import UsageError, parse_symbols
from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import (check_bundle_path, check_input_memory, check_output_path, key_grid, largest_key,
                                load_graph, place_inputs, random_array, read_outline, resolve_device, synchronize)
from engine.cli.progress import Progress, watch_tuning
from engine.cli.render import finish, ms, rate, table

EXAMPLES = """
  engine bench mlp.cgb --symbol batch=1,8,64                  median/p90 latency and throughput per batch
  engine bench mlp.cgb --symbol batch=1..16:4 --repeat 200    more samples; keys 1, 5, 9, 13
  engine bench model.cgb --symbol batch=8 --device cuda:0 --device cuda:1
  engine bench mlp.cgb --symbol batch=1,64 --json             the figures for scripts
  engine bench mlp.cgb --symbol batch=1,64 -o bench.json      the table, and the figures saved as JSON
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "bench", help="measure latency (median, p90) and throughput per key and device",
                    description="Benchmark a bundle on random inputs at every key of the --symbol grid, on each "
                                "--device. Reports latency median, p90 and min (ms), runs per second and, for a "
                                "graph with a 'batch' symbol, items per second. The first run at each key (which "
                                "tunes it when needed) is not timed.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("-s", "--symbol", action="append", metavar="NAME=VALUES",
                   help="symbol values: 8, 1,8,64, 1..64 or 1..64:8 (every symbol needs one; repeat per symbol)")
    p.add_argument("--device", action="append", metavar="DEVICE",
                   help="device to run on, e.g. cuda:1 (repeat to compare devices; default: index 0 of each kind)")
    p.add_argument("--warmup", type=_count(0), default=5, metavar="N", help="untimed runs per key (default 5)")
    p.add_argument("--repeat", type=_count(1), default=50, metavar="N", help="timed runs per key (default 50)")
    p.add_argument("--capture", action="store_true",
                   help="time a captured replay (CUDA/HIP graph) instead of run_async, where the device supports it")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the results as JSON to FILE")
    p.set_defaults(func=run)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def summarize(samples_ms: list[float], symbols: dict[str, int]) -> dict:
    median = statistics.median(samples_ms)
    runs = 1000.0 / median if median > 0 else float("inf")
    return {
        "median_ms": median,
        "p90_ms": float(np.percentile(samples_ms, 90)),
        "min_ms": min(samples_ms),
        "mean_ms": statistics.fmean(samples_ms),
        "runs_per_s": runs,
        "items_per_s": runs * symbols["batch"] if "batch" in symbols else None,
        "samples": len(samples_ms),
    }


def _timed(fn, graph, registry, count: int, bar: Progress, note: str) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(count):
        start = clock()
        fn()
        synchronize(graph, registry)
        out.append((clock() - start) / 1e6)
        bar.advance(1, note)
    return out


def _capture_or_refuse(graph, inputs, device: str):
    from engine.errors import Unsupported

    capture = getattr(graph, "capture", None)
    if capture is None:
        raise UsageError(f"--capture: graph capture is not supported yet for this device ({device})")
    try:
        return capture(*inputs)
    except Unsupported as exc:
        raise UsageError(f"--capture: not supported yet for this device ({device}): {exc}") from None


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    registry = registry_of(args)
    out_path = check_output_path(args.output, option="--output") if args.output else None
    outline = read_outline(path)
    meta, kinds = outline.meta, outline.kinds
    values = parse_symbols(args.symbol, meta.symbols, required=True)
    keys = key_grid(values, meta.symbols)
    check_input_memory(meta, largest_key(values, meta.symbols))  # a typo'd value fails here, by name
    devices = [resolve_device(d, kinds, registry) for d in (args.device or [None])]
    if len(set(map(str, devices))) != len(devices):
        raise UsageError("--device: the same device is given twice")
    results = []
    per_key = 1 + args.warmup + args.repeat
    with Progress(len(devices) * len(keys) * per_key, "benchmarking") as bar:
        for device in devices:
            graph = load_graph(path, device, registry)
            watch_tuning(graph, args, bar=bar)
            with graph:
                where = ", ".join(str(d) for d in graph.devices.values())
                for key in keys:
                    note = f"{where} {', '.join(f'{k}={v}' for k, v in key.items())}"
                    rng = np.random.default_rng(args.seed)
                    inputs = place_inputs(graph, [random_array(s, key, rng) for s in meta.inputs], registry)
                    known = tuple(key[s] for s in meta.symbols) in graph.dispatch_table
                    graph.run_async(inputs)  # tunes (if needed) and prepares the key: never timed
                    synchronize(graph, registry)
                    bar.advance(1, note)
                    fn = lambda: graph.run_async(inputs)  # noqa: E731
                    replay = None
                    if args.capture:
                        replay = _capture_or_refuse(graph, inputs, where)
                        fn = replay.replay
                    try:
                        _timed(fn, graph, registry, args.warmup, bar, note)
                        samples = _timed(fn, graph, registry, args.repeat, bar, note)
                    finally:
                        if replay is not None:
                            replay.close()
                    results.append({"device": where, "symbols": dict(key), "tuned_here": not known
                                    and tuple(key[s] for s in meta.symbols) in graph.dispatch_table,
                                    **summarize(samples, key)})
    doc = {"bundle": str(path), "warmup": args.warmup, "repeat": args.repeat, "capture": bool(args.capture),
           "symbols": list(meta.symbols), "results": results}
    return finish(doc, as_json=args.json, render=render, out_path=out_path)


def render(doc: dict) -> str:
    symbols = doc["symbols"]
    with_items = any(r["items_per_s"] is not None for r in doc["results"])
    headers = ["device", *symbols, "median ms", "p90 ms", "min ms", "runs/s"] + (["items/s"] if with_items else [])
    rows = []
    for r in doc["results"]:
        row = [r["device"], *(r["symbols"][s] for s in symbols), ms(r["median_ms"]), ms(r["p90_ms"]),
               ms(r["min_ms"]), rate(r["runs_per_s"])]
        if with_items:
            row.append(rate(r["items_per_s"]))
        rows.append(row)
    right = tuple(range(1, len(headers)))
    mode = "captured replay" if doc["capture"] else "run_async"
    head = (f"{doc['bundle']}: {mode}, {doc['warmup']} warmup + {doc['repeat']} timed runs per key "
            f"(host clock, synchronized)")
    return head + "\n" + table(headers, rows, right=right)
