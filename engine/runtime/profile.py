"""Per-instruction profiles of the chosen candidates (``graph.profile``).

The plan runs interpreted once with real data. Before each instruction's real call, its chosen
candidate is timed with ``Backend.time`` (``warmup`` calls, then ``repeat`` samples of one call
each) on the instruction's real operands, on clones of the inputs it writes in place, so the
profile's run computes the same values as any other run.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

import attrs

from engine.bundle.contents import BundleContents
from engine.device import Device
from engine.runtime.interpreter import TimingRunnerFactory
from engine.runtime.plan import KeyPlan
from engine.runtime.tasks import CompiledTask
from engine.runtime.tuning import CandidateTiming

__all__ = ["Profile", "ProfileRow", "ProfileRecorder", "render_profile"]

Shape = tuple[int, ...]


@attrs.frozen
class ProfileRow:
    """One instruction: what ran and how long it took (milliseconds per call)."""

    instruction: int
    task: int
    kernel: str
    candidate: int
    entry: str
    device: str
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    median_ms: float
    min_ms: float
    #: Every sample, in milliseconds, in the order taken.
    samples: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "instruction": self.instruction, "task": self.task, "kernel": self.kernel, "candidate": self.candidate,
            "entry": self.entry, "device": self.device,
            "input_shapes": [list(s) for s in self.input_shapes],
            "output_shapes": [list(s) for s in self.output_shapes],
            "median_ms": self.median_ms, "min_ms": self.min_ms, "samples": list(self.samples),
        }


def _shape(s: Shape) -> str:
    return "[" + ",".join(str(d) for d in s) + "]"


@attrs.frozen
class Profile:
    """``graph.profile(inputs)``: rows per instruction; ``str()`` is a table, ``to_json()`` a dict."""

    symbols: tuple[str, ...]
    key: tuple[int, ...]
    rows: tuple[ProfileRow, ...]
    warmup: int
    repeat: int

    @property
    def total_ms(self) -> float:
        """Sum of the instructions' medians: the run's kernel time without the engine around it."""
        return sum(r.median_ms for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": dict(zip(self.symbols, self.key)),
            "warmup": self.warmup,
            "repeat": self.repeat,
            "total_ms": self.total_ms,
            "rows": [r.to_json() for r in self.rows],
        }

    def __str__(self) -> str:
        return render_profile(self.to_json(), subject="profile")


def render_profile(doc: Mapping[str, Any], *, subject: str) -> str:
    """The one text view of a profile, from its JSON form: ``print(graph.profile(...))`` and ``engine
    profile`` (whose document holds the same ``rows``, ``total_ms``, ``warmup`` and ``repeat``, and the
    key as ``symbols``) print the same table. ``subject`` starts the first line (``"profile"``)."""
    from engine.runtime.report import format_ms

    rows: Sequence[Mapping[str, Any]] = doc["rows"]
    total = float(doc["total_ms"])
    header = ["#", "kernel", "candidate", "device", "inputs", "outputs", "median ms", "min ms", "share"]
    body = []
    for r in rows:
        share = f"{100 * r['median_ms'] / total:.1f}%" if total > 0 else "-"
        body.append([str(r["instruction"]), str(r["kernel"]), f"{r['candidate']}:{r['entry']}",
                     str(r.get("device", "-")),
                     " ".join(_shape(tuple(s)) for s in r["input_shapes"]),
                     " ".join(_shape(tuple(s)) for s in r["output_shapes"]),
                     format_ms(r["median_ms"]), format_ms(r["min_ms"]), share])
    right = {0, 6, 7, 8}
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        cols = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(cols).rstrip()

    key = doc.get("symbols", doc.get("key")) or {}
    at = ", ".join(f"{s}={v}" for s, v in key.items()) or "the static shapes"
    lines = [f"{subject} at {at}: median of {doc['repeat']} calls per kernel after {doc['warmup']} warmup",
             line(header), line(["-" * w for w in widths])]
    lines.extend(line(row) for row in body)
    lines.append(f"total: {format_ms(total)} ms (sum of the kernels' medians, without the engine around them)")
    return "\n".join(lines)


class ProfileRecorder:
    """An ``InstructionObserver`` that times each instruction's chosen candidate, then runs it."""

    def __init__(self, contents: BundleContents, plan: KeyPlan, devices: dict[str, Device], *, warmup: int,
                 repeat: int, streams: Mapping[str, object] | None = None):
        self._contents = contents
        self._streams = dict(streams or {})  # the lane's streams: work is timed where it is queued
        self._plan = plan
        self._devices = devices
        self.warmup = warmup
        self.repeat = repeat
        self.rows: list[ProfileRow] = []

    def tuned(self, pos: int, task: CompiledTask, timing: CandidateTiming, start_ns: int, end_ns: int) -> None:
        pass

    def execute(self, pos: int, task: CompiledTask, choice: int, run_once: Callable[[], None],
                timing_runner: TimingRunnerFactory) -> None:
        runner, keep = timing_runner()
        samples = task.backend.time(runner, stream=self._streams.get(task.meta.device), warmup=self.warmup,
                                    repeat=self.repeat, device_index=task.device_index)
        del keep
        run_once()
        ins = self._contents.execution.instructions[pos]
        shapes = self._plan.shapes
        cands = task.meta.candidates
        self.rows.append(ProfileRow(
            instruction=pos, task=task.index, kernel=task.name, candidate=choice,
            entry=cands[choice].entry if choice < len(cands) else (task.meta.builtin or ""),
            device=str(self._devices[task.meta.device]),
            input_shapes=tuple(tuple(shapes[t]) for t in ins.inputs),
            output_shapes=tuple(tuple(shapes[t]) for t in ins.outputs),
            median_ms=statistics.median(samples), min_ms=min(samples), samples=tuple(samples)))
