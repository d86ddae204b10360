"""Chrome traces of interpreted runs (``graph.trace``, and, when asked, of each key tuned at run time).

The output is the Trace Event Format's JSON object form, which Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
Every instruction is one complete event (``"ph": "X"``) on the "kernels" track, with its measured
duration (``Backend.time`` around the real call: device events on GPUs) and, in ``args``, the
instruction and task index, the chosen candidate and its entry, and the input and output shapes.
When the run tuned, each tuning step is an event on the "tuning" track with what it measured.

Timestamps are microseconds from the start of the run. An event starts at the host time of its
launch or at the end of the previous event, whichever is later, so events on a track never
overlap even where the device time exceeds the host interval.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from engine.bundle.contents import BundleContents
from engine.cache import note_write
from engine.device import Device
from engine.runtime.interpreter import TimingRunnerFactory
from engine.runtime.plan import KeyPlan
from engine.runtime.tasks import CompiledTask
from engine.runtime.tuning import CandidateTiming
from engine.safefiles import atomic_write

__all__ = ["TraceRecorder", "write_trace", "trace_file_name"]

_PID = 1
_TID_KERNELS = 1
_TID_TUNING = 2


def _entry(task: CompiledTask, choice: int) -> str:
    cands = task.meta.candidates
    return cands[choice].entry if choice < len(cands) else (task.meta.builtin or "")


class TraceRecorder:
    """An ``InstructionObserver`` that records one trace event per instruction (and per tuning step)."""

    def __init__(self, contents: BundleContents, plan: KeyPlan, devices: dict[str, Device], *, identity: str,
                 warmup: int = 0, streams: Mapping[str, object] | None = None):
        self._contents = contents
        self._streams = dict(streams or {})  # the lane's streams: work is timed where it is queued
        self._plan = plan
        self._devices = devices
        self._identity = identity
        self._warmup = warmup
        self._origin = time.perf_counter_ns()
        self._cursor_us = 0.0
        self._tuning_cursor_us = 0.0
        self.events: list[dict[str, Any]] = []
        self.choices: dict[int, int] = {}

    def _shapes(self, pos: int) -> tuple[list[list[int]], list[list[int]]]:
        ins = self._contents.execution.instructions[pos]
        shapes = self._plan.shapes
        return [list(shapes[t]) for t in ins.inputs], [list(shapes[t]) for t in ins.outputs]

    def _us(self, ns: int) -> float:
        return (ns - self._origin) / 1e3

    def tuned(self, pos: int, task: CompiledTask, timing: CandidateTiming, start_ns: int, end_ns: int) -> None:
        ts = max(self._us(start_ns), self._tuning_cursor_us)
        dur = max((end_ns - start_ns) / 1e3, 0.001)
        self._tuning_cursor_us = ts + dur
        inputs, outputs = self._shapes(pos)
        self.events.append({
            "name": f"tune {task.name}", "cat": "tuning", "ph": "X", "ts": round(ts, 3), "dur": round(dur, 3),
            "pid": _PID, "tid": _TID_TUNING,
            "args": {"instruction": pos, "task": task.index, "chosen": timing.chosen,
                     "entries": [c.entry for c in task.meta.candidates],
                     "medians_ms": [round(m, 6) for m in timing.medians_ms],
                     "min_ms": [round(m, 6) for m in timing.min_ms], "samples": list(timing.samples),
                     "calls_per_sample": list(timing.calls_per_sample), "dropped": list(timing.dropped),
                     "inputs": inputs, "outputs": outputs},
        })

    def execute(self, pos: int, task: CompiledTask, choice: int, run_once: Callable[[], None],
                timing_runner: TimingRunnerFactory) -> None:
        if self._warmup:
            runner, keep = timing_runner()
            for _ in range(self._warmup):
                runner()
            del keep
        start = time.perf_counter_ns()
        (ms,) = task.backend.time(run_once, stream=self._streams.get(task.meta.device), warmup=0, repeat=1,
                                  device_index=task.device_index)
        ts = max(self._us(start), self._cursor_us)
        dur = ms * 1e3
        self._cursor_us = ts + dur
        self.choices[task.index] = choice
        inputs, outputs = self._shapes(pos)
        self.events.append({
            "name": task.name, "cat": "kernel", "ph": "X", "ts": round(ts, 3), "dur": round(dur, 3),
            "pid": _PID, "tid": _TID_KERNELS,
            "args": {"instruction": pos, "task": task.index, "candidate": choice, "entry": _entry(task, choice),
                     "device": str(self._devices[task.meta.device]), "inputs": inputs, "outputs": outputs},
        })

    @property
    def origin_ns(self) -> int:
        """``perf_counter_ns`` at the start of the run (timestamps are relative to it)."""
        return self._origin

    def to_events(self, *, pid: int = _PID, process: str | None = None, origin_ns: int | None = None
                  ) -> list[dict[str, Any]]:
        """Metadata and events under process ``pid``, timestamps relative to ``origin_ns``."""
        shift = 0.0 if origin_ns is None else (self._origin - origin_ns) / 1e3
        name = process or f"engine graph {self._identity[:12]}"
        meta = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": _TID_KERNELS, "args": {"name": "kernels"}},
        ]
        if any(e["tid"] == _TID_TUNING for e in self.events):
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": _TID_TUNING,
                         "args": {"name": "tuning"}})
        events = [{**e, "pid": pid, "ts": round(e["ts"] + shift, 3)} if (pid != _PID or shift) else e
                  for e in sorted(self.events, key=lambda e: (e["tid"], e["ts"]))]
        return meta + events

    def to_dict(self, *, symbols: Sequence[str], key: tuple[int, ...], choices: Sequence[int]) -> dict[str, Any]:
        """The trace as a JSON-ready dict."""
        kernels_ms = sum(e["dur"] for e in self.events if e["tid"] == _TID_KERNELS) / 1e3
        return {
            "traceEvents": self.to_events(),
            "displayTimeUnit": "ms",
            "otherData": {
                "identity": self._identity,
                "key": dict(zip(symbols, key)),
                "choices": list(choices),
                "kernels_ms": round(kernels_ms, 6),
            },
        }


def session_trace(runs: Sequence[tuple[tuple[int, ...], tuple[int, ...], TraceRecorder]], *,
                  symbols: Sequence[str], identity: str) -> dict[str, Any]:
    """One trace of several tuned keys (``graph.tune``): one process per key, on one time axis."""
    origin = min((r.origin_ns for _, _, r in runs), default=0)
    events: list[dict[str, Any]] = []
    for pid, (key, _, recorder) in enumerate(runs, start=1):
        label = ", ".join(f"{s}={v}" for s, v in zip(symbols, key)) or "static"
        events.extend(recorder.to_events(pid=pid, process=label, origin_ns=origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "identity": identity,
            "keys": [dict(zip(symbols, key)) for key, _, _ in runs],
            "choices": [list(choice) for _, choice, _ in runs],
        },
    }


def trace_file_name(symbols: Sequence[str], key: tuple[int, ...]) -> str:
    """``batch=8_seq=128.json`` (``static.json`` for a graph without symbols)."""
    return ("_".join(f"{s}={v}" for s, v in zip(symbols, key)) or "static") + ".json"


def write_trace(path: str | Path, trace: dict[str, Any], *, atomic: bool = True) -> Path:
    """Write ``trace`` as JSON (no fsync: a trace is a diagnostic, not state).

    ``atomic`` writes a temporary file and renames it over ``path``. The per-key traces of the
    cache directory are written directly (one file system operation less per tuned key, issue 4's
    overhead budget): a crash mid-write can only leave a truncated diagnostic file. A trace written
    into the cache directory counts towards its size cap (``engine.cache.note_write``).
    """
    target = Path(path)
    text = json.dumps(trace, separators=(",", ":"))
    if atomic:
        atomic_write(target, text, fsync=False)
    else:
        try:
            f = open(target, "w", encoding="utf-8")
        except FileNotFoundError:
            target.parent.mkdir(parents=True, exist_ok=True)
            f = open(target, "w", encoding="utf-8")
        with f:
            f.write(text)
    note_write(target, len(text))
    return target
