"""CLI start-up: what one ``engine`` command costs before it does any work, against bare Python.

A person types several commands a minute; each is a fresh process, so its import time is felt
every time. The ``engine.commands`` entry points (``engine-onnx``'s ``convert``) are loaded to
list them in ``--help``; before issue 24 that imported the ``engine_onnx`` package and with it
onnx, in every command. Each case is one subprocess, timed from spawn to exit:

* floors: ``python -c pass`` (the interpreter) and ``python -c "import engine"`` (the core);
* ``python -m engine --help`` and ``python -m engine inspect --help`` (every command's parser,
  entry points included), and ``engine inspect`` of the demo bundle (a real command);
* ``python -m engine convert --help`` (the one command that needs onnx) and ``python -c "import
  onnx"`` (what the other commands no longer pay).

Every case runs once per round, the order alternating, so a figure and its floors see the same
machine; the headline is the minimum over rounds, beside the median. Each command's process is
also checked for whether it imported onnx (``sys.modules`` at exit, through ``-X importtime``).

Run: ``python benchmarks/cli_startup.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "cli_startup"
ROUNDS = 9
QUICK_ROUNDS = 3


def _cases(bundle: Path) -> dict[str, list[str]]:
    py = sys.executable
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "import engine": [py, "-c", "import engine"],
        "engine --help": [py, "-m", "engine", "--help"],
        "engine inspect --help": [py, "-m", "engine", "inspect", "--help"],
        "engine inspect mlp.cgb": [py, "-m", "engine", "inspect", str(bundle)],
    }
    if _has_onnx_frontend():
        cases["engine convert --help"] = [py, "-m", "engine", "convert", "--help"]
        cases["import onnx"] = [py, "-c", "import onnx"]
    return cases


def _has_onnx_frontend() -> bool:
    import importlib.util

    return importlib.util.find_spec("engine_onnx") is not None


def _spawn(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        C.fail(f"{' '.join(argv[1:])} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


def imports_onnx(argv: list[str], env: dict[str, str]) -> bool:
    """Whether the process imported the onnx package (``-X importtime`` lists every import)."""
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return any(n == "onnx" or n.startswith("onnx.") for n in names)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds instead of {ROUNDS}")
    args = ap.parse_args(argv)
    rounds = QUICK_ROUNDS if args.quick else ROUNDS

    load_start = C.loadavg()
    cache = C.isolated_cache()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPROFILEIMPORTTIME",)}
    env["ENGINE_CACHE_DIR"] = str(cache)
    with tempfile.TemporaryDirectory(prefix="engine-bench-cli-") as tmp:
        from engine.demo.mlp import build_mlp

        bundle = Path(tmp) / "mlp.cgb"
        build_mlp(registry=C.make_registry(cache)).save(bundle)
        cases = _cases(bundle)
        for cmd in cases.values():  # warm the page cache and the bytecode caches
            _spawn(cmd, env)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                samples[name].append(_spawn(cases[name], env))
        onnx_loaded = {name: imports_onnx(cmd, env) for name, cmd in cases.items() if name.startswith("engine ")}

    best = {name: min(s) for name, s in samples.items()}
    median = {name: statistics.median(s) for name, s in samples.items()}
    floor, core = best["python -c pass"], best["import engine"]

    def ms(v: float) -> str:
        return f"{v * 1e3:.0f}"

    table, rows = [], []
    for name in cases:
        loaded = onnx_loaded.get(name)
        table.append([name, ms(best[name]), ms(median[name]), C.ratio(best[name], floor, 2),
                      C.ratio(best[name], core, 2), "-" if loaded is None else ("yes" if loaded else "no")])
        rows.append({"case": name, "argv": cases[name][1:], "min_ms": round(best[name] * 1e3, 1),
                     "median_ms": round(median[name] * 1e3, 1), "imports_onnx": loaded})
    print(C.format_table(["case", "min ms", "median ms", "/ python -c pass", "/ import engine", "imports onnx"],
                         table, title=f"CLI start-up, one process per case, {rounds} rounds interleaved"))

    summary = [
        {"metric": "engine inspect --help / import engine", "value": round(best["engine inspect --help"] / core, 2),
         "unit": "x"},
        {"metric": "engine inspect --help minus import engine",
         "value": round((best["engine inspect --help"] - core) * 1e3, 1), "unit": "ms"},
        {"metric": "engine --help / import engine", "value": round(best["engine --help"] / core, 2), "unit": "x"},
        {"metric": "engine inspect --help imports onnx", "value": onnx_loaded["engine inspect --help"],
         "unit": "", "target": "False", "ok": not onnx_loaded["engine inspect --help"]},
    ]
    if "import onnx" in best:
        summary.append({"metric": "import onnx minus python -c pass",
                        "value": round((best["import onnx"] - floor) * 1e3, 1), "unit": "ms"})
        summary.append({"metric": "engine convert --help / import engine",
                        "value": round(best["engine convert --help"] / core, 2), "unit": "x"})
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    path = C.write_results(NAME, quick=args.quick, params={"rounds": rounds, "statistic": "min",
                                                           "loadavg_start": load_start},
                           rows=rows, summary=summary)
    print(f"results: {path.relative_to(C.REPO_ROOT)}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
