"""``engine demo``: what a newcomer wants to see in one command.

Builds the example MLP from C sources through the CPU plugin, saves it as a bundle, loads it back,
checks it against numpy at three batch sizes, shows what tuning chose and how fast the fast path is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.cli.commands import add_command

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
    import engine
    from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp

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
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="engine-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mlp.cgb"
    builder.save(path)
    print(f"\n1. built and saved {path} ({path.stat().st_size / 1024:.0f} KiB) in {_ms(time.perf_counter() - start)}"
          f" (sources compiled by the {kind} plugin)")

    start = time.perf_counter()
    graph = engine.load_compiled_graph(path, device=str(target))
    placed = "memory-mapped" if kind == "cpu" else f"uploaded to {target}"
    print(f"2. loaded it back in {_ms(time.perf_counter() - start)}: weights {placed}, kernels hash-checked\n")
    print("\n".join("   " + line for line in str(graph).splitlines()))

    print("\n3. batch sizes 1, 3 and 64 through one bundle (symbol 'batch'), checked against numpy:")
    rng = np.random.default_rng(1)
    ok = True
    for batch in (1, 3, 64):
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        (probs,) = graph.run_async([_on(x, target)])
        expected = reference_mlp(x, weights)
        err = float(np.max(np.abs(probs.numpy() - expected)))
        good = err < 1e-5
        ok &= good
        print(f"   batch={batch:<3} probs{list(probs.shape)}  max |engine - numpy| = {err:.2e}  "
              f"{'ok' if good else 'MISMATCH'}  (first row argmax: {int(probs.numpy()[0].argmax())})")

    print("\n4. tuning: the first run at each batch size timed both matmul candidates and kept the faster:")
    names = [t.name for t in graph.compiled_tasks]
    for key, choice in sorted(graph.dispatch_table.items()):
        picks = ", ".join(f"{n}={graph.compiled_tasks[i].meta.candidates[c].entry}"
                          for i, (n, c) in enumerate(zip(names, choice)) if len(graph.compiled_tasks[i].candidates) > 1)
        print(f"   batch={key[0]:<3} {picks}")
    stats = graph.run_stats()
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

    print(f"\nthe bundle stays at {path}; try:\n"
          f"   engine inspect {path}\n"
          f"   engine bench {path} --symbol batch=1,8,64\n"
          f"   engine run {path} --random --symbol batch=2")
    print("demo " + ("passed" if ok else "FAILED: results differ from numpy"))
    return 0 if ok else 1
