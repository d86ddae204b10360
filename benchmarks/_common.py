"""Shared helpers for the benchmarks: an isolated cache, interleaved timing, tables, JSON results.

Every benchmark measures its floor *in the same run as* the engine, alternating them round by
round, and reports ratios: on a small shared machine (2 cores, other processes) absolute times
drift by 2x from one minute to the next, but two things measured in the same few milliseconds see
the same machine. The headline statistic is the minimum over rounds (the run least disturbed by
others); the median is recorded beside it.

Timed loops run with the garbage collector disabled, as ``timeit`` does, for the engine and the
floors alike.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

__all__ = ["BENCH_DIR", "RESULTS_DIR", "Timing", "isolated_cache", "make_registry", "interleaved",
           "calibrate", "format_table", "machine_info", "write_results", "print_summary", "us", "ratio",
           "loadavg", "warn_if_busy", "fail"]


# -- environment ----------------------------------------------------------------------------------
def isolated_cache(prefix: str = "engine-bench-") -> Path:
    """A fresh cache directory (removed at exit), exported as ``ENGINE_CACHE_DIR`` for this process."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["ENGINE_CACHE_DIR"] = str(path)
    atexit.register(shutil.rmtree, path, True)
    return path


def make_registry(cache_dir: Path, backend: Any = None, *, native_run: bool | None = None):
    """A registry on ``cache_dir``: the installed plugins, or only ``backend`` when one is given.

    ``native_run=False`` turns the native run path off for it (``None``: ``ENGINE_NATIVE_RUN``)."""
    from engine.plugins import Registry
    from engine.settings import Settings

    switch = {} if native_run is None else {"native_run": native_run}
    if backend is None:
        registry = Registry(Settings(cache_dir=cache_dir, **switch))
        registry.load_entry_points()
        return registry
    registry = Registry(Settings(cache_dir=cache_dir, autoload_plugins=False, **switch))
    registry.register_backend(backend, distribution="benchmarks")
    return registry


# -- timing ---------------------------------------------------------------------------------------
class Timing:
    """Per-call seconds of one case over several rounds."""

    __slots__ = ("name", "samples", "inner")

    def __init__(self, name: str, inner: int):
        self.name = name
        self.inner = inner
        self.samples: list[float] = []

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"min_us": round(self.min * 1e6, 4), "median_us": round(self.median * 1e6, 4),
                "rounds": len(self.samples), "calls_per_round": self.inner}


def _loop(fn: Callable[[], Any], n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` calls, GC off."""
    rng = range(n)
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in rng:
            fn()
        t1 = time.perf_counter()
    finally:
        if enabled:
            gc.enable()
    return (t1 - t0) / n


def calibrate(fn: Callable[[], Any], target_s: float) -> int:
    """How many calls of ``fn`` take about ``target_s`` (at least 1)."""
    n = 1
    while True:
        per = _loop(fn, n)
        if per * n >= min(0.005, target_s / 4) or n >= 1 << 24:
            return max(1, int(target_s / max(per, 1e-9)))
        n *= 4


def interleaved(cases: Mapping[str, Callable[[], Any]], *, rounds: int, round_s: float,
                warmup: int = 3, settle_s: float = 0.0) -> dict[str, Timing]:
    """Time every case once per round, alternating the order each round; ``round_s`` per sample.

    ``settle_s`` > 0: before each sample, sleep that long, then call the case ``warmup`` times
    untimed. For cases that keep threads of their own busy after they return (a runtime's thread
    pool spinning for work), so that no sample pays for the previous case's threads: each case is
    measured as it runs alone, in its steady state.
    """
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    timings = {name: Timing(name, calibrate(fn, round_s)) for name, fn in cases.items()}
    names = list(cases)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t = timings[name]
            if settle_s > 0:
                time.sleep(settle_s)
                for _ in range(warmup):
                    cases[name]()
            t.samples.append(_loop(cases[name], t.inner))
    return timings


# -- formatting -----------------------------------------------------------------------------------
def us(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.{digits}f}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.{digits}f}x"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    out = []
    if title:
        out.append(title)
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


# -- results --------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    import numpy as np

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "loadavg_1min_end": loadavg(),
        "git_commit": (_git("rev-parse", "--short", "HEAD") or "?"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "engine", "plugins",
                               "frontends", "benchmarks")),
    }
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return info


def write_results(name: str, *, quick: bool, params: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                  summary: Sequence[Mapping[str, Any]], notes: Sequence[str] = ()) -> Path:
    """``results/<name>.json``: small, stable keys, rounded numbers (commit-friendly).

    ``summary`` rows are what ``run_all.py`` prints: ``metric``, ``value``, ``unit`` and optionally
    ``target`` (text) and ``ok`` (bool).
    """
    RESULTS_DIR.mkdir(exist_ok=True)
    doc = {
        "benchmark": name,
        "quick": quick,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info(),
        "params": dict(params),
        "summary": [dict(s) for s in summary],
        "rows": [dict(r) for r in rows],
        "notes": list(notes),
    }
    path = RESULTS_DIR / f"{name}{'.quick' if quick else ''}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def print_summary(summary: Sequence[Mapping[str, Any]]) -> None:
    rows = []
    for s in summary:
        ok = s.get("ok")
        rows.append([s["metric"], f"{s['value']}", s.get("unit", ""), s.get("target", ""),
                     "" if ok is None else ("ok" if ok else "MISSED")])
    print(format_table(["summary", "value", "unit", "target", ""], rows))


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def warn_if_busy(load_start: float) -> None:
    """Say so when other processes competed for the cores: microseconds inflate, ratios hold better."""
    cores = os.cpu_count() or 1
    load = max(load_start, loadavg())
    if load > 0.75 * cores:
        print(f"note: the machine was busy (1-min load average up to {load:.2f} on {cores} cores): absolute "
              "times are inflated; ratios to the floors measured in the same rounds are the figures to trust")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)
