"""``Dispatcher``: which candidate each task runs at each key, and the record of how it was decided.

The tuning seam of a graph (issue 4): the dispatch table (the bundle's rows, then rows cached by
any process for keys the bundle lacks), what the dispatch policy chose at keys without a row, the
cache file tuned rows go to, the tuning log and statistics, and the Chrome traces of tuning runs.
``CompiledGraph`` runs the plan; this object decides and remembers. One tuning runs at a time per
graph (``tuning_lock``), so that timings are not disturbed by another thread tuning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import attrs

from engine.log import get_logger
from engine.runtime.dispatch import DispatchTable
from engine.runtime.dispatch_cache import DispatchCache
from engine.runtime.trace import TraceRecorder, session_trace, trace_file_name, write_trace
from engine.runtime.tuning import CandidateTiming, TuningEvent, TuningOptions, TuningStats, estimate_tuning_s

if TYPE_CHECKING:
    from engine.bundle.contents import BundleContents
    from engine.settings import Settings

__all__ = ["Dispatcher", "TuneBatch"]

Key = tuple[int, ...]

log = get_logger("engine.runtime.tuning")


class TuneBatch:
    """What one ``tune()`` call has tuned but not yet stored: cache rows and traces."""

    def __init__(self, serial: int):
        self.serial = serial
        self.started = time.time()
        self.rows: dict[Key, Key] = {}
        self.traces: list[tuple[Key, Key, TraceRecorder]] = []
        self.trace_path: Path | None = None


class Dispatcher:
    """The graph's dispatch table, policy choices, tuning records and cache (module docstring).

    ``on_change`` is called when choices that prepared runs were built with are replaced (the
    runtime then rebuilds them).
    """

    def __init__(self, contents: "BundleContents", candidates_per_task: Sequence[int], settings: "Settings",
                 device_tag: str, policy: str | None, on_change: Callable[[], None]):
        self._identity = contents.identity
        self._symbols = contents.meta.symbols
        self._candidates = tuple(candidates_per_task)
        self.table = DispatchTable(self._symbols, list(self._candidates), contents.dispatch_rows,
                                   policy=policy or settings.dispatch_policy, on_change=on_change)
        #: The cache file of this bundle's tuned rows (``None`` when nothing needs tuning or caching is off).
        self.cache: DispatchCache | None = None
        if self.table.needs_tuning and settings.dispatch_cache:
            self.cache = DispatchCache(settings.cache_dir, contents.identity, self._symbols,
                                       self.table.candidates_per_task, device_tag)
            self.table.merge(self.cache.load(), source="cache")
        self._on_change = on_change
        self._policy_choices: dict[Key, Key] = {}
        self.tuning_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stats = TuningStats()
        self._log: dict[Key, list[CandidateTiming]] = {}
        self._serial = 0

    # -- choosing ------------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.table.policy

    @policy.setter
    def policy(self, value: str) -> None:
        self.table.policy = value
        with self._lock:
            # Choices made by the previous policy are forgotten (and runs prepared with them rebuilt),
            # so that e.g. switching from "first" to "tune" tunes those keys.
            changed = bool(self._policy_choices)
            self._policy_choices.clear()
        if changed:
            self._on_change()

    def choice_for(self, key: Key) -> list[int | None]:
        """The candidate per task at ``key``: the table's row, else what the dispatch policy says
        (``None`` for a task the tune policy will tune; ``InputError`` under the error policy)."""
        table = self.table
        row = table.get(key) or self._policy_choices.get(key)
        if row is not None:
            return list(row)
        if not table.needs_tuning:
            return list(table.trivial_choice())
        policy = table.policy
        if policy == "error":
            raise table.error_for(key)
        if policy == "first":
            self._policy_choices[key] = table.trivial_choice()
            return list(self._policy_choices[key])
        if policy == "nearest":
            near = table.nearest(key)
            if near is not None:
                self._policy_choices[key] = near
                return list(near)
        return [None if n > 1 else 0 for n in self._candidates]

    def known_row(self, key: Key) -> Key | None:
        """The table's row for ``key``, after adopting rows other processes stored in the cache since load."""
        row = self.table.get(key)
        if row is None and self.cache is not None:
            self.table.merge(self.cache.rows(), source="cache")
            row = self.table.get(key)
        return row

    # -- announcing ----------------------------------------------------------------------------
    def announce_tuning(self, key: Key, candidates: Sequence[int], options: TuningOptions, *,
                        ahead_of_time: bool) -> TuningEvent:
        """Say that ``key`` is about to be tuned (``candidates``: one count per kernel to time).

        INFO always; WARNING too when the estimate reaches ``options.warn_s`` at run time (not in
        ``graph.tune``, which is the advice itself). Only ever called on the tuning path.
        """
        symbols = dict(zip(self._symbols, key))
        kernels, total = len(candidates), sum(candidates)
        estimate = estimate_tuning_s(candidates, options)
        long = not ahead_of_time and estimate >= options.warn_s
        of = f"{total} candidates of {kernels} kernel{'' if kernels == 1 else 's'}"
        log.info("tuning %s at %s: timing %s (estimated %.2f s%s)", self._identity[:16], symbols, of, estimate,
                 ", ahead of time" if ahead_of_time else "")
        if long:
            option = "".join(f" --symbol {s}={v}" for s, v in symbols.items())
            call = ", ".join(f"{s}={v}" for s, v in symbols.items())
            log.warning("tuning %s at %s is expected to take about %.2f s (%s, %d samples "
                        "of at least %g ms each; longer where the kernels are slower) and this run waits for it; "
                        "to avoid tuning at run time, tune ahead of time ('engine tune BUNDLE%s --save', or "
                        "graph.tune(%s)) and ship the table, or set "
                        "ENGINE_DISPATCH_POLICY=nearest (the nearest tuned key's choice) or "
                        "ENGINE_DISPATCH_POLICY=first (candidate 0, no timing); ENGINE_TUNING_WARN_S (now %g) "
                        "sets when this is said", self._identity[:16], symbols, estimate, of, options.repeat,
                        options.min_sample_ms, option, call, options.warn_s)
        return TuningEvent("start", symbols, kernels, total, 0, estimate, long, ahead_of_time)

    # -- recording -----------------------------------------------------------------------------
    def record_tuned(self, key: Key, choice: Key, timings: list[CandidateTiming], recorder: TraceRecorder | None,
                     start: float, *, batch: TuneBatch | None = None) -> None:
        """Keep a tuned row: in the table, the tuning log, the cache file and its trace (or in ``batch``)."""
        self.table.record(key, choice, source="tuned")
        if log.isEnabledFor(logging.INFO):
            log.info("tuned %s at %s in %.3f s: chose candidates %s (%s)", self._identity[:16],
                     dict(zip(self._symbols, key)), time.perf_counter() - start, list(choice),
                     "; ".join(f"task {t.task}: medians {[round(m, 4) for m in t.medians_ms]} ms" for t in timings))
        with self._lock:
            self._log[key] = timings
            replaced = self._policy_choices.pop(key, None) is not None
        if replaced:
            self._on_change()  # runs prepared with the policy's choice are rebuilt
        cache = self.cache
        if batch is not None:
            batch.rows[key] = choice
            if recorder is not None:
                batch.traces.append((key, choice, recorder))
        elif cache is not None:
            self.persist({key: choice})
            if recorder is not None:
                path = cache.directory.parent / "traces" / self._identity / trace_file_name(self._symbols, key)
                try:
                    write_trace(path, recorder.to_dict(symbols=self._symbols, key=key, choices=choice), atomic=False)
                except OSError as exc:
                    cache.report(f"trace {path} cannot be written ({exc})")
        with self._lock:
            stats = self._stats
            stats.keys += 1
            stats.candidates_timed += sum(len(t.medians_ms) for t in timings)
            stats.timed_s += sum(t.timed_ms for t in timings) / 1e3
            stats.total_s += time.perf_counter() - start

    def persist(self, rows: dict[Key, Key]) -> None:
        """Store tuned rows in the cache file and adopt the rows other processes stored there."""
        if self.cache is not None and rows:
            start = time.perf_counter()
            self.table.merge(self.cache.store(rows), source="cache")
            self._add_overhead(time.perf_counter() - start)

    def new_batch(self) -> TuneBatch:
        with self._lock:
            self._serial += 1
            return TuneBatch(self._serial)

    @property
    def trace_dir(self) -> Path | None:
        """Where tuning traces go: ``<cache_dir>/traces/<identity>`` (``None`` when caching is off)."""
        if self.cache is None:
            return None
        return self.cache.directory.parent / "traces" / self._identity

    def write_session_trace(self, batch: TuneBatch) -> None:
        """One Chrome trace of every key a ``tune()`` call tuned (``batch.trace_path`` when written)."""
        cache, folder = self.cache, self.trace_dir
        if not batch.traces or cache is None or folder is None:
            return
        start = time.perf_counter()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(batch.started))
        path = folder / f"tune-{stamp}-{os.getpid()}-{batch.serial}.json"
        try:
            write_trace(path, session_trace(batch.traces, symbols=self._symbols, identity=self._identity),
                        atomic=False)
            batch.trace_path = path
        except OSError as exc:
            cache.report(f"trace {path} cannot be written ({exc})")
        self._add_overhead(time.perf_counter() - start)

    def _add_overhead(self, seconds: float) -> None:
        with self._lock:
            self._stats.total_s += seconds

    # -- reading -------------------------------------------------------------------------------
    def results(self) -> dict[Key, list[CandidateTiming]]:
        with self._lock:
            return {k: list(v) for k, v in self._log.items()}

    def stats(self) -> TuningStats:
        with self._lock:
            return attrs.evolve(self._stats)
