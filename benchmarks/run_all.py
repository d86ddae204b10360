"""Run every benchmark (each in its own process) and print one summary table.

The core benchmarks (dispatch_overhead, load_time, mlp_latency) run first, then any other
``benchmarks/<name>.py`` that takes ``--quick``; a benchmark's summary rows come from the
``summary`` list of its JSON results (``metric``, ``value``, ``unit``, optional ``target``/``ok``).

Run: ``python benchmarks/run_all.py [--quick] [--only NAME ...]``. ``--quick`` takes well under a
minute; the full run a few minutes (most of it writing and reading the 1 GiB bundle). Each
benchmark's own table is printed as it runs; results land in ``benchmarks/results/<name>.json``
(``<name>.quick.json`` for quick runs, so a smoke run never overwrites recorded figures).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

CORE = ("dispatch_overhead", "load_time", "mlp_latency")


def discover() -> tuple[str, ...]:
    """The core benchmarks, then any other ``benchmarks/<name>.py`` (not ``_*.py``, not this file)."""
    others = sorted(p.stem for p in C.BENCH_DIR.glob("*.py")
                    if not p.name.startswith("_") and p.stem not in CORE and p.stem != "run_all")
    return CORE + tuple(others)


BENCHMARKS = discover()


def result_file(name: str, quick: bool, since: float):
    """This run's JSON for ``name``: ``<name>.quick.json`` for quick runs, else ``<name>.json``
    (a benchmark that writes ``<name>.json`` in both modes is accepted if written during this run)."""
    candidates = [C.RESULTS_DIR / f"{name}.quick.json"] if quick else []
    candidates.append(C.RESULTS_DIR / f"{name}.json")
    for path in candidates:
        if path.exists() and path.stat().st_mtime >= since:
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 60 s in total)")
    ap.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
                    help=f"run only these ({', '.join(BENCHMARKS)})")
    args = ap.parse_args(argv)

    names = args.only or BENCHMARKS
    failed, seconds = [], {}
    start = time.perf_counter()
    start_wall = time.time() - 1
    for name in names:
        print(f"\n=== {name} {'(quick)' if args.quick else ''}", flush=True)
        cmd = [sys.executable, str(C.BENCH_DIR / f"{name}.py")] + (["--quick"] if args.quick else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        seconds[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            failed.append(name)
    total = time.perf_counter() - start

    rows = []
    for name in names:
        if name in failed:
            rows.append([name, "FAILED (see its output above)", "", "", "", ""])
            continue
        path = result_file(name, args.quick, start_wall)
        try:
            summary = json.loads(path.read_text()).get("summary") if path is not None else None
        except (OSError, ValueError):
            summary = None
        if not summary:
            rows.append([name, "ran; no summary in its results file (see its output above)", "", "", "", ""])
            continue
        for s in summary:
            ok = s.get("ok")
            rows.append([name, s["metric"], s["value"], s.get("unit", ""), s.get("target", ""),
                         "" if ok is None else ("ok" if ok else "MISSED")])
    info = C.machine_info()
    print()
    print(C.format_table(["benchmark", "metric", "value", "unit", "target", ""], rows,
                         title=(f"Summary ({'quick' if args.quick else 'full'}; {info['nproc']} x {info['cpu']}, "
                                f"load avg {info['loadavg_1min_end']}; {total:.0f} s: "
                                + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items()) + ")")))
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
