"""``engine run BUNDLE``: run the graph once on given or random inputs; save or print the outputs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.args import UsageError
from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import (check_bundle_path, check_output_path, input_names, make_inputs, open_graph,
                                output_names, read_outline, synchronize)
from engine.cli.progress import watch_tuning
from engine.cli.render import emit_json, key_text, ms, table

EXAMPLES = """
  engine run mlp.cgb --random --symbol batch=8                 random inputs, outputs printed
  engine run mlp.cgb --input x=x.npy --output out.npz          inputs from .npy files, outputs saved
  engine run model.cgb --input x=x.npy --device cuda:1         on the second CUDA device
  engine run mlp.cgb --random --symbol batch=4 --json          output summary for scripts
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "run", help="run a bundle once and save or print its outputs",
                    description="Load a bundle and run it once. Inputs come from .npy files (--input NAME=FILE, "
                                "names from the bundle, else input_0, input_1, ...) or are random (--random, with "
                                "--symbol for the shapes). Outputs are printed, or saved with --output (.npz keyed "
                                "by output name, or .npy for a single output).",
                    examples=EXAMPLES, parents=[common["debug"], common["json"], common["device"], common["inputs"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("-o", "--output", metavar="FILE", help="save the outputs to FILE (.npz, or .npy for one output)")
    p.set_defaults(func=run)


def output_summary(name: str, array: np.ndarray) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "dtype": str(array.dtype), "shape": list(array.shape)}
    if array.size:
        try:
            values = array.astype(np.float64)
        except (TypeError, ValueError):
            return doc
        finite = np.isfinite(values)
        any_finite = bool(finite.any())
        doc.update(min=float(values[finite].min()) if any_finite else None,
                   max=float(values[finite].max()) if any_finite else None,
                   mean=float(values[finite].mean()) if any_finite else None,
                   nonfinite=int(values.size - finite.sum()))
    return doc


def _fig(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def save_outputs(path: Path, arrays: dict[str, np.ndarray]) -> None:
    if path.suffix == ".npy":
        (only,) = arrays.values()
        np.save(path, only)
    else:
        with open(path, "wb") as f:  # np.savez would append .npz to any other suffix
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    registry = registry_of(args)
    out_path = None
    if args.output is not None:
        out_path = check_output_path(args.output, option="--output")
    outline = read_outline(path)
    n_out = len(outline.meta.outputs)
    if out_path is not None and out_path.suffix not in (".npz", ".npy"):
        raise UsageError(f"--output {args.output}: expected a file name ending in .npz (the outputs as a numpy "
                         f"archive) or .npy (a graph with one output)")
    if out_path is not None and out_path.suffix == ".npy" and n_out != 1:
        raise UsageError(f"--output {args.output}: the graph has {n_out} outputs; use a .npz file")
    graph = open_graph(path, args.device, outline.kinds, registry)
    watch_tuning(graph, args)
    with graph:
        inputs, key, made = make_inputs(graph, args.input, args.symbol, random=args.random, seed=args.seed,
                                         registry=registry)
        tuned_before = key_tuple(graph, key) in graph.dispatch_table
        start = time.perf_counter()
        outputs = graph.run_async(inputs)
        synchronize(graph, registry)
        elapsed = (time.perf_counter() - start) * 1e3
        arrays = {name: np.asarray(t.numpy()) for name, t in zip(output_names(graph.meta), outputs)}
        doc: dict[str, Any] = {
            "bundle": str(path),
            "devices": [str(d) for d in graph.devices.values()],
            "symbols": key,
            "inputs": [{"name": n, "source": m} for n, m in zip(input_names(graph.meta), made)],
            "elapsed_ms": elapsed,
            "tuned": not tuned_before and key_tuple(graph, key) in graph.dispatch_table,
            "outputs": [output_summary(n, a) for n, a in arrays.items()],
            "saved_to": None,
        }
        if out_path is not None:
            save_outputs(out_path, arrays)
            doc["saved_to"] = str(out_path)
    if args.json:
        emit_json(doc)
        return 0
    note = " (first run at this key: candidates were timed)" if doc["tuned"] else ""
    print(f"ran {path} on {', '.join(doc['devices'])} at {key_text(key)} in {ms(elapsed)} ms{note}")
    print(table(["output", "dtype", "shape", "min", "max", "mean"],
                [[o["name"], o["dtype"], str(o["shape"]), _fig(o.get("min")), _fig(o.get("max")),
                  _fig(o.get("mean"))] for o in doc["outputs"]]))
    if out_path is not None:
        print(f"saved {', '.join(arrays)} to {out_path}")
    else:
        with np.printoptions(threshold=60, edgeitems=3, precision=5, suppress=True, linewidth=100):
            for name, array in arrays.items():
                print(f"\n{name} =\n{array}")
    return 0


def key_tuple(graph, key: dict[str, int]) -> tuple[int, ...]:
    return tuple(key[s] for s in graph.meta.symbols)
