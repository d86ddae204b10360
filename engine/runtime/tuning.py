"""Timing kernel candidates and choosing one: the tuning half of dispatch (issue 4).

Every measurement goes through ``Backend.time`` (host clock around a synchronize on the CPU,
device events on GPUs), so a plugin decides how its device is timed. The selection rule, also
documented in ``docs/runtime.md`` §4.1:

1. **Estimate.** Each candidate runs ``warmup`` times (at least once); the fastest of those calls
   estimates its cost. A candidate whose estimate is below ``min_sample_ms`` is called several
   times per sample (up to ``max_calls_per_sample``), so that each sample lasts about
   ``min_sample_ms``: tiny kernels are measured above the timer's and the launch's noise.
2. **First round.** ``min(3, repeat)`` samples per candidate.
3. **Early drop.** A candidate whose *fastest* sample is still more than ``drop_ratio`` times the
   best *median* is clearly slower and is not timed further (its numbers are kept).
4. **Second round.** The others get the rest of ``repeat`` samples.
5. **Choice.** The lowest median wins. Candidates within ``tie_tolerance`` (relative) of it are
   tied, and ties go to the lowest candidate index: the same machine picks the same candidate
   from run to run, and the compiler's first (default) candidate wins when nothing beats it.

A task that writes in place (``share_map``) would overwrite its own input when run repeatedly, so
its candidates run on clones of the inputs it writes (``timing_operands``): timing never changes
the real run's values.

Each decision is logged (``engine.runtime.tuning``, DEBUG): the instruction and task, every
candidate's median, the dropped ones and the choice.

Tuning is never silent (issue 24): a key's tuning is logged at INFO when it starts (the key, the
kernels and candidates to time) and when it ends (the elapsed time), and, when its estimate
(``estimate_tuning_s``) reaches ``TuningOptions.warn_s``, at WARNING before it starts, naming the
ways to avoid it at run time. ``graph.tuning_listener`` hears the same as ``TuningEvent``s (the
command line draws its progress from them). None of it is on the path of a key that has a row.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Literal, Mapping, Sequence

import attrs

from engine.backend import BackendBase
from engine.errors import OutOfMemoryError
from engine.log import get_logger
from engine.runtime.context import RunContext
from engine.runtime.tasks import CompiledTask
from engine.settings import DEFAULT_TUNING_WARN_S
from engine.storage import Storage

__all__ = ["TuningOptions", "CandidateTiming", "TuningStats", "TuningEvent", "TuningListener", "select_candidate",
           "timing_operands", "tune_instruction", "launch_runner", "estimate_tuning_s"]

log = get_logger("engine.runtime.tuning")


def _positive_int(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"TuningOptions.{attr.name} must be a positive integer, got {value!r}")


def _non_negative(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
        raise ValueError(f"TuningOptions.{attr.name} must be a non-negative number, got {value!r}")


def _ratio(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or not value > 1:
        raise ValueError(f"TuningOptions.{attr.name} must be a number above 1, got {value!r}")


@attrs.frozen
class TuningOptions:
    """How candidates are timed (``graph.tuning``); the rule is in this module's docstring."""

    #: Calls per candidate before sampling; the fastest of them estimates the candidate's cost.
    warmup: int = attrs.field(default=2, validator=_positive_int)
    #: Samples per candidate that is not dropped early.
    repeat: int = attrs.field(default=5, validator=_positive_int)
    #: A sample of a faster candidate repeats the call until it lasts about this long.
    min_sample_ms: float = attrs.field(default=2.0, validator=_non_negative)
    #: Upper bound on calls per sample.
    max_calls_per_sample: int = attrs.field(default=1000, validator=_positive_int)
    #: Drop a candidate after the first round when its best sample exceeds this times the best median.
    drop_ratio: float = attrs.field(default=1.5, validator=_ratio)
    #: Medians within this relative distance of the lowest are tied; ties go to the lower index.
    tie_tolerance: float = attrs.field(default=0.02, validator=_non_negative)
    #: Write a Chrome trace of each key tuned at run time (and one per ``tune()`` call) under the
    #: cache directory. Off by default: a trace per tuned key grows the cache by a file per key
    #: (``ENGINE_TUNING_TRACES=1``, ``Settings.tuning_traces``, turns it on; so does
    #: ``graph.tuning = attrs.evolve(graph.tuning, write_traces=True)``).
    write_traces: bool = False
    #: Tuning at run time whose estimate (``estimate_tuning_s``) is at least this many seconds is
    #: announced at WARNING level before it starts (0: every tuning; ``math.inf``: never). Default
    #: ``ENGINE_TUNING_WARN_S`` (``Settings.tuning_warn_s``), else ``DEFAULT_TUNING_WARN_S``.
    warn_s: float = attrs.field(default=DEFAULT_TUNING_WARN_S, validator=_non_negative)


def estimate_tuning_s(candidates: Sequence[int], options: TuningOptions) -> float:
    """How long timing these candidates (one count per kernel to tune) is expected to take, in seconds.

    The rule (docs/runtime.md §4.1): every candidate of every kernel takes ``repeat`` samples, and a
    sample is made to last about ``min_sample_ms`` (tuning rule, step 1), so the estimate is
    ``sum(candidates) * repeat * min_sample_ms``. It is known before anything runs and depends only
    on the bundle and the options: kernels slower than ``min_sample_ms`` at the key take longer
    (each sample is then one call), candidates dropped early take less.
    """
    return sum(candidates) * options.repeat * options.min_sample_ms / 1e3


@attrs.frozen
class TuningEvent:
    """What ``graph.tuning_listener`` hears while one key is tuned.

    ``phase`` is ``"start"`` (before any candidate is timed), ``"kernel"`` (after each kernel's
    candidates were timed: ``done`` of ``kernels``), then ``"end"`` or, when the run raised,
    ``"failed"``. ``long`` is true when ``estimate_s`` reached ``TuningOptions.warn_s`` (the WARNING
    was logged); ``ahead_of_time`` when ``graph.tune`` tunes the key (no warning then).
    """

    phase: Literal["start", "kernel", "end", "failed"]
    #: The key: symbol name -> value.
    symbols: Mapping[str, int]
    #: Kernels (tasks with several candidates) to time at this key.
    kernels: int
    #: Their candidates, added up.
    candidates: int
    #: Kernels timed so far.
    done: int = 0
    estimate_s: float = 0.0
    long: bool = False
    ahead_of_time: bool = False
    #: Seconds since the start (``"end"`` and ``"failed"``: the whole tuning run).
    elapsed_s: float = 0.0


#: ``graph.tuning_listener``: called with each ``TuningEvent``, in the tuning thread.
TuningListener = Callable[[TuningEvent], None]


@attrs.frozen
class CandidateTiming:
    """What tuning measured for one instruction (kept for traces, profiles and ``tuning_results``)."""

    instruction: int
    task: int
    #: Median milliseconds per call, one per candidate (a dropped candidate's from its first round).
    medians_ms: tuple[float, ...]
    chosen: int
    #: Fastest sample per candidate (milliseconds per call).
    min_ms: tuple[float, ...] = ()
    #: Samples taken per candidate.
    samples: tuple[int, ...] = ()
    #: Calls per sample per candidate.
    calls_per_sample: tuple[int, ...] = ()
    #: Candidates dropped after the first round as clearly slower.
    dropped: tuple[int, ...] = ()
    #: Wall milliseconds spent inside ``Backend.time`` for this instruction (all candidates).
    timed_ms: float = 0.0


@attrs.define
class TuningStats:
    """Where tuning time went, summed over every key a graph tuned (``graph.tuning_stats()``).

    ``timed_s`` is wall time inside ``Backend.time`` (the candidates' own runs, warmup included);
    ``total_s`` covers whole slow-path runs that tuned (planning, interpreting, clones, recording,
    the cache and trace files). The difference is the tuning machinery's overhead.
    """

    keys: int = 0
    candidates_timed: int = 0
    timed_s: float = 0.0
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.timed_s)

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_s / self.total_s if self.total_s > 0 else 0.0


def select_candidate(medians: Sequence[float], eligible: Sequence[int], tie_tolerance: float) -> int:
    """The lowest median among ``eligible``; within ``tie_tolerance`` of it, the lowest index."""
    best = min(medians[c] for c in eligible)
    limit = best * (1.0 + tie_tolerance)
    return min(c for c in eligible if medians[c] <= limit)


def launch_runner(launch: Any) -> Callable[[], None]:
    """A no-argument callable that runs a prepared launch once and raises on a failure code."""
    call = launch.call

    def run_once() -> None:
        code = call()
        if code:
            launch.fail(code)

    return run_once


def timing_operands(ctx: RunContext, task: CompiledTask, pos: int,
                    ptrs: Sequence[Any]) -> tuple[list[Any], list[Storage]]:
    """Operand pointers safe to run instruction ``pos`` repeatedly on, and the clones they use.

    An output written in place over an input (``share_map``) is redirected, together with that
    input, to a fresh copy of the input. Keep the returned storages alive while timing.
    """
    ins = ctx.contents.execution.instructions[pos]
    out = list(ptrs)
    clones: list[Storage] = []
    if not task.meta.share_map:
        return out, clones
    backend = task.backend
    stream = ctx.streams.get(task.meta.device)
    n_in = len(ins.inputs)
    for out_arg, in_arg in task.meta.share_map.items():
        nbytes = ctx.plan.nbytes[ins.inputs[in_arg]]
        try:
            clone = backend.allocate(nbytes, task.device_index, stream)
        except MemoryError as exc:
            raise OutOfMemoryError.from_error(exc, nbytes, f"{backend.kind}:{task.device_index}",
                                              f"a copy of input {in_arg} of instruction {pos} to time it "
                                              f"at {dict(ctx.plan.env)}") from None
        clones.append(clone)
        if nbytes:
            backend.copy_device(clone.ptr, ptrs[in_arg], nbytes, stream)
        out[in_arg] = clone.ptr
        out[n_in + out_arg] = clone.ptr
    return out, clones


def _repeated(run_once: Callable[[], None], calls: int) -> Callable[[], None]:
    if calls == 1:
        return run_once
    rng = range(calls)

    def run_many() -> None:
        for _ in rng:
            run_once()

    return run_many


class _Clock:
    """Calls ``Backend.time`` and adds the wall time it took to ``elapsed`` (overhead accounting)."""

    __slots__ = ("backend", "device_index", "stream", "elapsed")

    def __init__(self, backend: BackendBase, device_index: int, stream: Any):
        self.backend = backend
        self.device_index = device_index
        self.stream = stream
        self.elapsed = 0.0

    def time(self, fn: Callable[[], None], warmup: int, repeat: int) -> list[float]:
        start = time.perf_counter()
        try:
            return self.backend.time(fn, stream=self.stream, warmup=warmup, repeat=repeat,
                                     device_index=self.device_index)
        finally:
            self.elapsed += time.perf_counter() - start


def tune_instruction(runners: Sequence[Callable[[], None]], backend: BackendBase, device_index: int,
                     options: TuningOptions, *, instruction: int, task: int, stream: Any = None) -> CandidateTiming:
    """Time every candidate runner (one per candidate, on timing operands, queuing on ``stream``)
    and pick one."""
    count = len(runners)
    clock = _Clock(backend, device_index, stream)
    if count == 1:  # nothing to choose; callers normally skip single-candidate tasks
        return CandidateTiming(instruction, task, (0.0,), 0, (0.0,), (0,), (1,), (), 0.0)
    calls = []
    for run in runners:
        estimate = max(min(clock.time(run, 0, options.warmup)), 1e-6)
        calls.append(max(1, min(options.max_calls_per_sample, math.ceil(options.min_sample_ms / estimate))))
    batched = [_repeated(run, n) for run, n in zip(runners, calls)]
    first = min(3, options.repeat)
    samples: list[list[float]] = []
    for run, n in zip(batched, calls):
        samples.append([s / n for s in clock.time(run, 0, first)])
    medians = [statistics.median(s) for s in samples]
    best = min(medians)
    dropped = tuple(c for c in range(count) if min(samples[c]) > options.drop_ratio * best)
    survivors = [c for c in range(count) if c not in dropped]
    rest = options.repeat - first
    if rest > 0 and len(survivors) > 1:
        for c in survivors:
            samples[c].extend(s / calls[c] for s in clock.time(batched[c], 0, rest))
            medians[c] = statistics.median(samples[c])
    chosen = select_candidate(medians, survivors, options.tie_tolerance)
    log.debug("instruction %d (task %d): candidate medians %s ms, dropped %s, chose candidate %d",
              instruction, task, [round(m, 6) for m in medians], list(dropped), chosen)
    return CandidateTiming(instruction, task, tuple(medians), chosen, tuple(min(s) for s in samples),
                           tuple(len(s) for s in samples), tuple(calls), dropped, clock.elapsed * 1e3)
