"""``python -m fuzzing`` (with ``tests/`` on the path; ``scripts/fuzz`` does that)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fuzzing.runner import TESTS_DIR, FuzzConfig, run_fuzz


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/fuzz", description="Structure-aware fuzzing of engine bundles.")
    p.add_argument("--cases", type=int, default=5000, help="number of cases (default 5000)")
    p.add_argument("--seed", type=int, default=0, help="run seed: case i is the same for the same seed")
    p.add_argument("--out", type=Path, default=TESTS_DIR / "fuzz_corpus",
                   help="where minimised failing cases are written (default tests/fuzz_corpus)")
    p.add_argument("--no-corpus", action="store_true", help="do not write failing cases")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds per case before it is a hang")
    p.add_argument("--no-minimise", action="store_true", help="keep failing cases as found")
    p.add_argument("--cache-dir", type=Path, help="engine cache for the workers (default: a temporary one)")
    p.add_argument("--report", type=Path, help="write the counts and failures as JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="print each failure as it happens")
    args = p.parse_args(argv)
    config = FuzzConfig(cases=args.cases, seed=args.seed, jobs=args.jobs, timeout=args.timeout,
                        corpus=None if args.no_corpus else args.out, minimise=not args.no_minimise,
                        cache_dir=args.cache_dir, verbose=args.verbose)
    report = run_fuzz(config)
    print(report.summary())
    for path in report.written:
        print(f"wrote {path}")
    if args.report:
        doc = {"counts": dict(report.counts), "seconds": round(report.seconds),
               "failures": [{"case": c, "result": r} for c, r in report.failures.values()],
               "native_trust": [{"case": c, "result": r} for c, r in report.native_examples]}
        args.report.write_text(json.dumps(doc, indent=1, ensure_ascii=True))
    return 1 if report.failure_count else 0


if __name__ == "__main__":
    sys.exit(main())
