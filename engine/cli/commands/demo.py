"""``engine demo``: what a newcomer wants to see in one command.

Builds the example MLP from C sources through the CPU plugin, saves it as a bundle, loads it back,
checks it against numpy at three batch sizes, shows what tuning chose and how fast the fast path is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.cli.args import UsageError
from engine.cli.commands import add_command

if TYPE_CHECKING:
    from engine.device import Device
    from engine.runtime.compiled_graph import CompiledGraph

__all__ = ["run_demo"]

EXAMPLES = """
  engine demo                 build the example in a temporary directory, run it, show what happened
  engine demo --keep demo/    keep the bundle in demo/mlp.cgb, to try the other commands on it
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "demo",
                    help="build, save, load and run the example MLP classifier (on the CPU, or --device KIND)",
                    description="The README's first command: builds an MLP classifier from C kernels through the "
                                "CPU plugin, saves it as a bundle, loads it back, checks it against numpy at three "
                                "batch sizes, and shows what tuning chose and how fast the fast path is.",
                    examples=EXAMPLES, parents=[common["debug"]])
    p.add_argument("--keep", metavar="DIR", help="write the demo bundle into DIR and keep it")
    p.add_argument("--device", default="cpu", metavar="KIND[:N]",
                   help="run the model on this device (default cpu); other kinds use the kernels their plugin "
                        "supplies (its reference kernels)")
    p.set_defaults(func=lambda args: run_demo(keep=args.keep, device=args.device))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _us_per_call(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def _on(x: np.ndarray, target) -> object:
    """``x`` where the graph reads it: the array itself on the CPU, else a copy on the device."""
    import engine

    return x if target.kind == "cpu" else engine.asarray(x, device=str(target))


def run_demo(keep: str | None = None, device: str = "cpu") -> int:
    """The demo in ``keep`` (kept), or in a temporary directory removed afterwards, also after a failure.

    ``device`` is checked first (a ``UsageError`` naming the kind, why it is unusable and the usable
    kinds): building the example compiles kernels for that kind, seconds wasted on a kind that
    cannot run them.
    """
    from engine.cli.loading import resolve_device
    from engine.device import Device
    from engine.errors import InputError
    from engine.plugins import default_registry

    try:
        kind = Device.parse(device).kind
    except InputError as exc:
        raise UsageError(f"--device {device!r}: {exc}") from None
    resolve_device(device, (kind,), default_registry())
    if keep:
        folder = Path(keep)
        folder.mkdir(parents=True, exist_ok=True)
        return _run_demo(folder, kept=True, device=device)
    with tempfile.TemporaryDirectory(prefix="engine-demo-") as tmp:
        return _run_demo(Path(tmp), kept=False, device=device)


def _run_demo(folder: Path, *, kept: bool, device: str) -> int:
    import engine
    from engine.cli.loading import bundle_size
    from engine.cli.render import format_bytes
    from engine.demo.mlp import build_mlp, mlp_weights

    target = engine.Device.parse(device)
    kind = target.kind
    source = "C kernels" if kind == "cpu" else f"the {kind} plugin's reference kernels"
    print(f"engine {engine.__version__} demo: an MLP classifier (64 -> 128 -> 10) built from {source}, on {target}\n")
    for row in engine.devices():
        state = "available" if row.available else f"unavailable ({row.reason})"
        print(f"  device kind {row.kind!r}: {state}, plugin {row.distribution or '?'} {row.version or ''}")

    weights = mlp_weights()
    start = time.perf_counter()
    builder = build_mlp(weights=weights, device=kind)
    path = folder / "mlp.cgb"
    builder.save(path)
    print(f"\n1. built and saved {path} ({format_bytes(bundle_size(path))}) in {_ms(time.perf_counter() - start)}"
          f" (sources compiled by the {kind} plugin)")

    start = time.perf_counter()
    graph = engine.load_compiled_graph(path, device=str(target))
    with graph:  # closed (its weights unmapped) before the temporary directory goes
        return _run_loaded(graph, path, target, weights, kept=kept, start=start)


def _run_loaded(graph: "CompiledGraph", path: Path, target: "Device", weights: Any, *, kept: bool,
                start: float) -> int:
    from engine.demo.mlp import reference_mlp

    kind = target.kind
    placed = "memory-mapped" if kind == "cpu" else f"uploaded to {target}"
    print(f"2. loaded it back in {_ms(time.perf_counter() - start)}: weights {placed}, kernels hash-checked\n")
    print("\n".join("   " + line for line in str(graph).splitlines()))

    print("\n3. batch sizes 1, 3 and 64 through one bundle (symbol 'batch'), checked against numpy:")
    rng = np.random.default_rng(1)
    ok = True
    batches = (1, 3, 64)
    cached = {b for b in batches if (b,) in graph.dispatch_table}  # rows an earlier run left in the cache
    for batch in batches:
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        (probs,) = graph.run_async([_on(x, target)])
        expected = reference_mlp(x, weights)
        err = float(np.max(np.abs(probs.numpy() - expected)))
        good = err < 1e-5
        ok &= good
        print(f"   batch={batch:<3} probs{list(probs.shape)}  max |engine - numpy| = {err:.2e}  "
              f"{'ok' if good else 'MISMATCH'}  (first row argmax: {int(probs.numpy()[0].argmax())})")

    stats = graph.run_stats()
    if not cached:
        print("\n4. tuning: the first run at each batch size timed both matmul candidates and kept the faster:")
    elif len(cached) == len(batches):
        print("\n4. tuning: no timing needed: the dispatch cache already held a choice for each batch size (an earlier "
              "run timed them;\n   ENGINE_DISPATCH_CACHE=0 times them again):")
    else:
        print(f"\n4. tuning: batch {', '.join(str(b) for b in batches if b not in cached)} timed both matmul "
              f"candidates now; batch {', '.join(str(b) for b in sorted(cached))} took its choice from the dispatch "
              f"cache:")
    names = [t.name for t in graph.compiled_tasks]
    table = graph.dispatch_table
    for batch in batches:
        choice = table.get((batch,))
        if choice is None:
            continue
        picks = ", ".join(f"{n}={graph.compiled_tasks[i].meta.candidates[c].entry}"
                          for i, (n, c) in enumerate(zip(names, choice)) if len(graph.compiled_tasks[i].candidates) > 1)
        print(f"   batch={batch:<3} {picks}  ({'from the cache' if batch in cached else 'timed now'})")
    print(f"   runs so far: {stats.slow_runs} tuned (slow path), {stats.prepared_runs} prepared, "
          f"{stats.fast_runs} fast path")

    print("\n5. latency per call once prepared (fast path), beside numpy doing the same math:")
    for batch in (1, 64):
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        xd = _on(x, target)
        graph.run_async([xd])
        wait = graph.runtime.devices.synchronize  # work on a device is queued: time it until done

        def run_once() -> None:
            graph.run_async([xd])
            wait()

        t_engine = _us_per_call(run_once, 2000 if batch == 1 else 300)
        t_numpy = _us_per_call(lambda: reference_mlp(x, weights), 2000 if batch == 1 else 300)
        print(f"   batch={batch:<3} engine {t_engine:8.1f} us   numpy {t_numpy:8.1f} us")

    if kept:
        print(f"\nthe bundle stays at {path}; try:\n"
              f"   engine inspect {path}\n"
              f"   engine bench {path} --symbol batch=1,8,64\n"
              f"   engine run {path} --random --symbol batch=2")
    else:
        print("\nthe bundle was written to a temporary directory, now removed; 'engine demo --keep DIR' keeps it "
              "(DIR/mlp.cgb) to try 'engine inspect', 'engine bench' and 'engine run' on")
    print("demo " + ("passed" if ok else "FAILED: results differ from numpy"))
    return 0 if ok else 1
