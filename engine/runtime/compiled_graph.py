"""``CompiledGraph``: a loaded bundle bound to devices, with the reference runtime's API.

The graph is split along its seams: what it runs *on* (devices, tasks, weights, plans, per-thread
and per-stream lanes) is its ``GraphRuntime`` (``graph.runtime``, also what captures and reports
use); what it *decides* (the dispatch table, policy choices, tuning records, the cache file and
traces) is its ``Dispatcher`` (``graph.dispatcher``). This class is the user's API on top: running
(fast path, slow path, interpreting and tuning runs), ahead-of-time tuning, traces, profiles,
hooks, weights, saving and pickling. The hot path reads the thread's lane and one dict; nothing in
it is process-global (DESIGN §6).
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Literal, Sequence, cast

import attrs
import numpy as np

from engine.bundle.contents import BundleContents, bundle_members, read_bundle
from engine.bundle.save import write_bundle
from engine.bundle.schema import GraphExecution, GraphMetaData
from engine.bundle.writer import MemberData, bundle_to_bytes, bundle_to_file
from engine.device import Device
from engine.errors import InputError, OutOfMemoryError, Unsupported
from engine.plugins import Registry, default_registry
from engine.hostptr import array_address
from engine.runtime.context import RunContext
from engine.runtime.dispatch import DispatchTable
from engine.runtime.dispatch_cache import DispatchCache
from engine.runtime.dispatcher import Dispatcher, TuneBatch
from engine.runtime.interpreter import InstructionObserver, ModelExecutionHook, interpret
from engine.runtime.plan import KeyPlan, device_text, key_text
from engine.runtime.prepared import OutputWrapper, PreparedRun, input_text
from engine.runtime.runtime import GraphRuntime, Lane, RunStats, open_devices
from engine.runtime.profile import Profile, ProfileRecorder
from engine.runtime.trace import TraceRecorder, write_trace
from engine.runtime.tuning import CandidateTiming, TuningListener, TuningOptions, TuningStats
from engine.runtime.tasks import CompiledTask, availability_tag
from engine.runtime.weights import check_weights
from engine.storage import ExternalStorage, Storage, close_all
from engine.tensor import Tensor, from_dlpack, tensor_from_numpy

if TYPE_CHECKING:
    from engine.runtime.capture import CapturedGraph

__all__ = ["CompiledGraph", "RunStats", "load_compiled_graph", "save_compiled_graph"]

ENGINE_VERSION = "0.1.0"

#: ``tune()`` stores tuned rows in the cache file at most this often (seconds), and at the end.
_TUNE_FLUSH_S = 1.0


class CompiledGraph:
    """A compiled graph ready to run (reference API: ``hidet.runtime.CompiledGraph``)."""

    def __init__(self, contents: BundleContents, *, device: str | Device | None = None,
                 registry: Registry | None = None, dispatch_policy: str | None = None):
        self._contents = contents
        registry = registry if registry is not None else default_registry()
        devices, tag = open_devices(contents, registry, device)
        self._runtime = GraphRuntime(contents, devices)
        self._binder = self._runtime.binder
        self._tasks = self._runtime.tasks
        #: Which devices (and loadable candidates) tuning results are valid for (the dispatch cache
        #: is keyed by it).
        self.device_tag = tag = availability_tag(tag, self._tasks)
        self._dispatcher = Dispatcher(contents, [len(t.candidates) for t in self._tasks], registry.settings, tag,
                                      dispatch_policy, self._runtime.invalidate)
        #: The Chrome trace the latest ``tune()`` wrote (``None`` until one tuned a key).
        self.last_tune_trace: Path | None = None
        self._lock = threading.RLock()
        self._hooks: list[ModelExecutionHook] = []
        self.tuning = TuningOptions(write_traces=registry.settings.tuning_traces,
                                    warn_s=registry.settings.tuning_warn_s)
        #: Called with a ``TuningEvent`` when a key starts being tuned, after each of its kernels and
        #: at its end (``engine.runtime.tuning``; the command line draws its progress with it).
        #: Never called for a key that has a row.
        self.tuning_listener: TuningListener | None = None

    @property
    def runtime(self) -> GraphRuntime:
        """Devices, tasks, weights, memory plans and per-thread lanes (``engine.runtime.runtime``)."""
        return self._runtime

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatch table, policy choices and tuning records (``engine.runtime.dispatcher``)."""
        return self._dispatcher

    # -- reference attributes -----------------------------------------------------------------
    @property
    def meta(self) -> GraphMetaData:
        return self._contents.meta

    @property
    def graph_execution(self) -> GraphExecution:
        return self._contents.execution

    @property
    def compiled_tasks(self) -> tuple[CompiledTask, ...]:
        return self._tasks

    @property
    def weights(self) -> list[Tensor] | None:
        return self._runtime.weights

    @property
    def dispatch_table(self) -> DispatchTable:
        return self._dispatcher.table

    @property
    def graph_string(self) -> str:
        return self._contents.graph_string

    @property
    def identity(self) -> str:
        """The bundle's identity (cache key): unchanged by a new dispatch table."""
        return self._contents.identity

    @property
    def devices(self) -> dict[str, Device]:
        return dict(self._runtime.devices.devices)

    @property
    def dispatch_policy(self) -> str:
        return self._dispatcher.policy

    @dispatch_policy.setter
    def dispatch_policy(self, value: str) -> None:
        self._dispatcher.policy = value

    @property
    def dispatch_cache(self) -> DispatchCache | None:
        """The cache file of this bundle's tuned rows (``None`` when nothing needs tuning or caching is off)."""
        return self._dispatcher.cache

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        outputs = self.run_async(args)
        return outputs[0] if len(outputs) == 1 else outputs

    def run_async(self, inputs: Sequence[Any], output_to_torch_tensor: bool = False, *,
                  outputs: Sequence[Any] | None = None) -> list[Any]:
        """Run once. Inputs: engine Tensors, numpy arrays or DLPack tensors, on the graph's devices.

        Work on GPU devices is queued on the current stream (hence *async*); CPU work is done when
        this returns. ``outputs=`` supplies output buffers instead of fresh ones.
        """
        runtime = self._runtime
        lane = getattr(runtime.local, "lane", None)
        if lane is not None and lane.native is not None and lane.generation == runtime.generation:
            # The native run path (engine.runtime.native): the whole run in one C call, or None
            # whenever anything is not the plain case (then the Python path below does it all).
            result = lane.native.run(inputs, outputs)
            if result is not None:
                lane.counters.fast_runs += 1
                return [t.torch() for t in result] if output_to_torch_tensor else result
        if lane is None or lane.generation != runtime.generation:
            lane = runtime.new_lane()  # raises GraphClosedError after close(), before the inputs are looked at
        ptrs, keep, key = self._binder.bind(inputs)
        if runtime.devices.stream_kinds:
            lane = runtime.stream_lane(lane)
        if runtime.device_inputs:
            runtime.order_inputs(lane, keep)
        out_storages = None if outputs is None else self._output_storages(outputs, key)
        run = lane.runs.get(key)
        if run is None or self._hooks:
            result = self._run_slow(lane, key, ptrs, keep, out_storages)
        else:
            lane.counters.fast_runs += 1
            result = run.run(ptrs, keep, out_storages)
        if output_to_torch_tensor:
            return [t.torch() for t in result]
        return result

    def choice_for(self, key: tuple[int, ...]) -> list[int | None]:
        """The candidate per task at ``key`` (``Dispatcher.choice_for``)."""
        return self._dispatcher.choice_for(key)

    def _run_slow(self, lane: Lane, key: tuple[int, ...], ptrs: list[Any], keep: list[Any],
                  out_storages: list[Storage] | None) -> list[Tensor]:
        runtime = self._runtime
        weights = runtime.require_weights()
        plan = runtime.key_plan(key)
        runtime.ensure_workspaces(lane, plan)
        dispatcher = self._dispatcher
        choices = dispatcher.choice_for(key)
        if None in choices:  # the tune policy at a key without a row
            with dispatcher.tuning_lock:
                row = dispatcher.known_row(key)  # another thread, or process, may have tuned it meanwhile
                if row is None:
                    return self._interpret(lane, plan, choices, ptrs, keep, out_storages)
                choices = list(row)
        if not self._hooks:
            run = PreparedRun(runtime.context(plan, lane), self._tasks, choices,  # type: ignore[arg-type]  # all set
                              weights, native=runtime.native_run)
            runtime.add_run(lane, key, run)
            lane.counters.prepared += 1
            return run.run(ptrs, keep, out_storages)
        return self._interpret(lane, plan, choices, ptrs, keep, out_storages)

    def _interpret(self, lane: Lane, plan: KeyPlan, choices: list[int | None], ptrs: list[Any],
                   keep: list[Any], out_storages: list[Storage] | None,
                   observer: InstructionObserver | None = None, *, batch: TuneBatch | None = None
                   ) -> list[Tensor]:
        """Run instruction by instruction, tuning the tasks whose choice is ``None``, and record it.

        Call with ``dispatcher.tuning_lock`` held when ``choices`` has a ``None``. ``observer`` (traces,
        profiles) watches the run; a run that tunes also records a trace for the cache directory,
        and stores its row in the cache file, or in ``batch`` when given (``tune`` stores in batches).
        """
        key = plan.key
        runtime = self._runtime
        weights = runtime.require_weights()
        start = time.perf_counter()
        recorder: TraceRecorder | None = None
        watch = observer
        if None in choices and self.tuning.write_traces and self._dispatcher.cache is not None:
            if isinstance(observer, TraceRecorder):
                recorder = observer
            else:
                recorder = TraceRecorder(self._contents, plan, self.devices, identity=self.identity,
                                         streams=lane.streams)
                watch = recorder if observer is None else _Tee(recorder, observer)
        if out_storages is None:
            out_storages = runtime.output_storages(plan, lane)
        ctx = runtime.context(plan, lane)
        if None not in choices:
            timings = interpret(ctx, self._tasks, choices, weights=weights, input_ptrs=ptrs,
                                out_storages=out_storages, hooks=tuple(self._hooks), tuning=self.tuning,
                                observer=watch)
        else:
            timings = self._interpret_tuning(ctx, choices, weights, ptrs, out_storages, watch, start,
                                             ahead_of_time=batch is not None)
        if observer is None or timings:
            lane.counters.slow_runs += 1
        if timings:
            self._dispatcher.record_tuned(key, tuple(c or 0 for c in choices), timings, recorder, start, batch=batch)
        # Outputs are wrapped exactly as the fast path does (share_map and copied inputs included).
        return OutputWrapper(ctx).wrap(ptrs, keep, out_storages)

    def _interpret_tuning(self, ctx: RunContext, choices: list[int | None], weights: Sequence[Tensor], ptrs: list[Any],
                          out_storages: list[Storage], watch: InstructionObserver | None, start: float, *,
                          ahead_of_time: bool) -> list[CandidateTiming]:
        """``interpret`` at a key that is tuned: announced before (log, listener), followed per kernel
        and at the end (issue 24: tuning is never silent)."""
        tasks = self._tasks
        event = self._dispatcher.announce_tuning(ctx.plan.key, [len(tasks[t].candidates) for t, c in
                                                                enumerate(choices) if c is None],
                                                 self.tuning, ahead_of_time=ahead_of_time)
        listener = self.tuning_listener
        on_tuned = None
        if listener is not None:
            listener(event)

            def on_tuned(done: int) -> None:
                listener(attrs.evolve(event, phase="kernel", done=done, elapsed_s=time.perf_counter() - start))

        try:
            timings = interpret(ctx, tasks, choices, weights=weights, input_ptrs=ptrs, out_storages=out_storages,
                                hooks=tuple(self._hooks), tuning=self.tuning, observer=watch, on_tuned=on_tuned)
        except BaseException:
            if listener is not None:
                listener(attrs.evolve(event, phase="failed", elapsed_s=time.perf_counter() - start))
            raise
        if listener is not None:
            listener(attrs.evolve(event, phase="end", done=len(timings), elapsed_s=time.perf_counter() - start))
        return timings

    @property
    def trace_dir(self) -> Path | None:
        """Where tuning traces go: ``<cache_dir>/traces/<identity>`` (``None`` when caching is off)."""
        return self._dispatcher.trace_dir

    def _output_storages(self, outputs: Sequence[Any], key: tuple[int, ...]) -> list[Storage]:
        plan = self._runtime.key_plan(key)
        devices = self._runtime.devices.devices
        ex = self._contents.execution
        if len(outputs) != len(ex.outputs_index):
            raise InputError(f"outputs=: the graph has {len(ex.outputs_index)} outputs, got {len(outputs)}")
        storages: list[Storage | None] = [None] * len(plan.output_slots)
        for k, (out, (what, ref)) in enumerate(zip(outputs, plan.outputs)):
            if what == "input":
                continue
            sig = self._contents.meta.outputs[k]
            shape = plan.shapes[ex.outputs_index[k]]
            if type(out) is np.ndarray and sig.device == "cpu":
                # The common case, checked directly: wrapping it as a Tensor first cost ~4 µs a run.
                if out.dtype != sig.dtype.numpy or out.shape != shape or not out.flags.c_contiguous:
                    raise InputError(f"outputs[{k}]: expected a C-contiguous {sig.dtype.name}{list(shape)} array, "
                                     f"got {out.dtype}{list(out.shape)}"
                                     + ("" if out.flags.c_contiguous else " (not C-contiguous)"))
                if not out.flags.writeable:
                    raise InputError(f"outputs[{k}]: the buffer is read-only")
                host = out.reshape(-1).view(np.uint8).data
                storages[ref] = ExternalStorage(devices["cpu"], array_address(out), out.nbytes, owner=out,
                                                host_view=host)
                continue
            t = out if isinstance(out, Tensor) else _as_tensor(out)
            if t.dtype != sig.dtype or tuple(t.shape) != shape or t.device != devices[sig.device]:
                raise InputError(f"outputs[{k}]: expected {sig.dtype.name}{list(shape)} on "
                                 f"{devices[sig.device]}, got {t.dtype.name}{list(t.shape)} on {t.device}")
            if t.storage.readonly:
                raise InputError(f"outputs[{k}]: the buffer is read-only")
            storages[ref] = t.storage if t.offset == 0 else ExternalStorage(t.device, t.ptr, t.nbytes, owner=t)
        return storages  # type: ignore[return-value]

    # -- tuning and introspection ---------------------------------------------------------------
    def run_stats(self) -> RunStats:
        """Counts over every thread that ever ran this graph."""
        counters = self._runtime.counters()
        return RunStats(sum(c.fast_runs for c in counters), sum(c.slow_runs for c in counters),
                        sum(c.prepared for c in counters), len(self._dispatcher.table))

    def tune(self, progress: Callable[[int, int, dict[str, int]], None] | None = None,
             **symbols: int | Iterable[int]) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Tune ahead of time over the grid of the given symbol values (``batch=[1, 8, 64]``).

        Keys already in the dispatch table (from the bundle, the cache or earlier tuning) are kept.
        Each new key runs once on zero-filled inputs through the slow path, whatever the dispatch
        policy. Tuned rows go to the cache file at least every second and at the end (also when
        interrupted), and one Chrome trace of the whole grid (one process per key) is written to
        ``trace_dir/tune-<time>-<pid>-<n>.json`` (``last_tune_trace``). ``progress(done, total,
        symbols)`` is called after each key. Returns the rows for the whole grid; save them with
        ``save(..., save_dispatch_table=True)``.
        """
        names = self.meta.symbols
        missing = [s for s in names if s not in symbols]
        unknown = [s for s in symbols if s not in names]
        if missing or unknown:
            raise InputError(f"tune needs values for exactly the symbols {list(names)}; missing {missing}, "
                             f"unknown {unknown}")
        axes = [_symbol_values(s, symbols[s]) for s in names]
        grid = list(itertools.product(*axes))
        runtime = self._runtime
        lane = runtime.lane()
        # Rows go to the cache file in batches (at most every _TUNE_FLUSH_S, and at the end, also
        # when interrupted) and traces into one file: a locked rewrite and a new file per key cost
        # more than tuning a small key (issue 4's overhead budget, benchmarks/tuning.py).
        dispatcher = self._dispatcher
        batch = dispatcher.new_batch()
        last_flush = time.perf_counter()
        try:
            for done, key in enumerate(grid, start=1):
                if key not in self._dispatcher.table and self._dispatcher.table.needs_tuning:
                    with dispatcher.tuning_lock:
                        if self._dispatcher.table.get(key) is None:
                            plan = runtime.key_plan(key)
                            runtime.ensure_workspaces(lane, plan)
                            inputs = self._zero_inputs(plan, lane)
                            ptrs = [t.ptr for t in inputs]
                            choices = [None if len(t.candidates) > 1 else 0 for t in self._tasks]
                            self._interpret(lane, plan, choices, ptrs, inputs, None, batch=batch)
                    if time.perf_counter() - last_flush >= _TUNE_FLUSH_S:
                        dispatcher.persist(batch.rows)
                        batch.rows = {}
                        last_flush = time.perf_counter()
                if progress is not None:
                    progress(done, len(grid), dict(zip(names, key)))
        finally:
            dispatcher.persist(batch.rows)
            dispatcher.write_session_trace(batch)
            if batch.trace_path is not None:
                self.last_tune_trace = batch.trace_path
        return {key: self._dispatcher.table.get(key) or self._dispatcher.table.trivial_choice() for key in grid}

    def _zero_inputs(self, plan: KeyPlan, lane: Lane) -> list[Tensor]:
        devices = self._runtime.devices
        out: list[Tensor] = []
        for i, sig in enumerate(self.meta.inputs):
            backend = devices.backends[sig.device]
            stream = lane.streams.get(sig.device)
            try:
                storage = backend.allocate(plan.nbytes[i], devices.index[sig.device], stream)
            except MemoryError as exc:
                close_all(t.storage for t in out)
                raise OutOfMemoryError.from_error(exc, plan.nbytes[i], device_text(devices.devices[sig.device]),
                                                  f"{input_text(self.meta.input_names, i)} (zero-filled, to tune) "
                                                  f"at {key_text(plan.env)}") from exc
            if storage.nbytes:
                backend.memset(storage.ptr, 0, storage.nbytes, stream)
            out.append(Tensor(storage, sig.dtype, plan.shapes[i], 0, registry=devices.registry))
        return out

    def tuning_results(self) -> dict[tuple[int, ...], list[CandidateTiming]]:
        """What tuning measured in this process, per key: one ``CandidateTiming`` per tuned instruction."""
        return self._dispatcher.results()

    def tuning_stats(self) -> TuningStats:
        """Where tuning time went, over every key this graph tuned (a copy)."""
        return self._dispatcher.stats()

    def _observed_run(self, inputs: Sequence[Any], observer: Callable[[KeyPlan, Lane], InstructionObserver]
                      ) -> tuple[KeyPlan, tuple[int, ...], InstructionObserver]:
        """Run ``inputs`` interpreted under ``observer(plan, lane)``; tunes first if the key needs it."""
        ptrs, keep, key = self._binder.bind(inputs)
        runtime = self._runtime
        lane = runtime.lane()
        if runtime.device_inputs:
            runtime.order_inputs(lane, keep)
        plan = runtime.key_plan(key)
        runtime.ensure_workspaces(lane, plan)
        dispatcher = self._dispatcher
        choices = dispatcher.choice_for(key)  # raises under the error policy at an unknown key
        watcher = observer(plan, lane)
        if None in choices:
            with dispatcher.tuning_lock:
                row = dispatcher.known_row(key)
                if row is None:  # tuned during the observed run, exactly like a slow-path run
                    self._interpret(lane, plan, choices, ptrs, keep, None, observer=watcher)
                    return plan, tuple(c or 0 for c in choices), watcher
                choices = list(row)
        self._interpret(lane, plan, choices, ptrs, keep, None, observer=watcher)
        return plan, tuple(c or 0 for c in choices), watcher

    def trace(self, inputs: Sequence[Any], path: str | Path | None = None, *, warmup: int = 1) -> dict[str, Any]:
        """Run ``inputs`` once interpreted, timing every instruction; return a Chrome trace.

        The dict is the Trace Event Format (``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``):
        one complete event per instruction with its measured duration, kernel name, chosen
        candidate and operand shapes (open it in Perfetto). Each instruction first runs ``warmup``
        times (on clones of the inputs it writes in place) so that durations are warm, as in
        ``profile``. Written atomically to ``path`` when given. The dispatch policy applies: a key
        without a row is tuned first under ``tune`` (the tuning steps appear on their own track).
        """
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
        plan, choices, recorder = self._observed_run(
            inputs, lambda plan, lane: TraceRecorder(self._contents, plan, self.devices, identity=self.identity,
                                                     warmup=warmup, streams=lane.streams))
        doc = cast(TraceRecorder, recorder).to_dict(symbols=self.meta.symbols, key=plan.key, choices=choices)
        if path is not None:
            write_trace(path, doc)
        return doc

    def profile(self, inputs: Sequence[Any], *, warmup: int = 1, repeat: int = 10) -> Profile:
        """Per-instruction times of the chosen candidates on ``inputs``.

        Runs the plan interpreted once; before each instruction's real call its chosen candidate
        is timed with ``Backend.time(warmup, repeat)`` (on clones of the inputs it writes in
        place). ``print(profile)`` shows a table; ``profile.rows`` and ``profile.to_json()`` are
        for programs. The dispatch policy applies as for ``trace``.
        """
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
        if not isinstance(repeat, int) or repeat < 1:
            raise ValueError(f"repeat must be a positive integer, got {repeat!r}")
        plan, _, recorder = self._observed_run(
            inputs, lambda plan, lane: ProfileRecorder(self._contents, plan, self.devices, warmup=warmup, repeat=repeat,
                                                       streams=lane.streams))
        rows = tuple(cast(ProfileRecorder, recorder).rows)
        return Profile(tuple(self.meta.symbols), plan.key, rows, warmup, repeat)

    def capture(self, *example_inputs: Any) -> "CapturedGraph":
        """A replayable run at the key of ``example_inputs``, on static buffers (see ``CapturedGraph``).

        The key is tuned first if needed; a backend that can record runs (CUDA/HIP graphs) records
        it, otherwise the replay is the prepared launches alone (on the CPU: one fused native call).
        """
        from engine.runtime.capture import capture_graph

        return capture_graph(self, self._runtime, self.meta.symbols, example_inputs)

    def cuda_graph(self, *example_inputs: Any) -> "CapturedGraph":
        """The reference runtime's name for ``capture`` on CUDA devices."""
        if "cuda" not in self.devices:
            raise Unsupported(f"cuda_graph() needs a graph that runs on CUDA; this one runs on "
                              f"{', '.join(str(d) for d in self.devices.values())}: use capture()")
        return self.capture(*example_inputs)

    def register_hook(self, hook: ModelExecutionHook) -> None:
        """Call ``hook(instruction_index, inputs, outputs)`` after each instruction (runs interpreted)."""
        if not callable(hook):
            raise TypeError("register_hook expects a callable (int, list[Tensor], list[Tensor]) -> None")
        with self._lock:
            self._hooks.append(hook)
        self._runtime.invalidate()

    def memory_report(self, **symbols: int) -> dict[str, Any]:
        from engine.runtime.report import memory_report
        return memory_report(self.meta.symbols, self._runtime, symbols)

    # -- weights -------------------------------------------------------------------------------
    def set_weights(self, weights: Sequence[Any]) -> None:
        """Replace every weight (``weights_index`` order); checked for count, dtype, shape, device."""
        devices = self._runtime.devices
        new = check_weights(list(weights), self._contents, dict(devices.devices), dict(devices.backends),
                            devices.registry)
        self._runtime.replace_weights(new)

    # -- saving and pickling -------------------------------------------------------------------
    def _members(self, *, save_dispatch_table: bool, save_weights: bool) -> dict[str, Any]:
        c = self._contents
        binaries: dict[str, MemberData] = {}
        for k, kernel in enumerate(c.kernels):
            for cand in kernel.candidates:
                for b in cand.binaries:
                    name = f"kernels/{k}/{b.path}"
                    binaries[name] = c.archive.map(name)
        weights = None
        current = self._runtime.weights
        if save_weights and current is not None:
            names = [e.name for e in c.weight_entries] if c.weight_entries else [
                f"w{j}" for j in range(len(current))]
            weights = [(n, w.numpy()) for n, w in zip(names, current)]
        entries = c.weight_entries
        if entries is None and c.npz_weights is not None:
            from engine.bundle.contents import weights_layout
            entries = tuple(weights_layout([(f"w{j}", a) for j, a in enumerate(c.npz_weights)])[0])
        return bundle_members(meta=c.meta, execution=c.execution, kernels=c.kernels, binaries=binaries,
                              weights=weights, weight_entries=entries,
                              dispatch_rows=self._dispatcher.table.rows() if save_dispatch_table else None,
                              graph_string=c.graph_string)

    def save(self, path: str | Path, *, save_dispatch_table: bool = False, save_weights: bool = True,
             form: Literal["zip", "dir"] | None = None, overwrite: bool = False) -> None:
        """Write the bundle atomically (``.cgb`` zip, or a directory when ``form="dir"``). An existing
        ``path`` is replaced only when it is a bundle (or an empty directory); anything else raises
        ``SaveTargetError`` unless ``overwrite``."""
        target = Path(path)
        chosen: Literal["zip", "dir"] = form or ("dir" if target.is_dir() else "zip")
        write_bundle(target, self._members(save_dispatch_table=save_dispatch_table, save_weights=save_weights),
                     engine_version=ENGINE_VERSION, form=chosen, overwrite=overwrite)

    def to_bytes(self) -> bytes:
        """The bundle as bytes, dispatch table and current weights included (used by pickling)."""
        return bundle_to_bytes(self._members(save_dispatch_table=True, save_weights=True),
                               engine_version=ENGINE_VERSION)

    def write_to(self, fp: BinaryIO) -> None:
        """Write what ``to_bytes`` returns into ``fp`` (seekable, binary, at its start) without building
        it in memory: the weights stream from where they are. ``engine.ray.put_bundle`` writes a
        temporary file this way and maps it, so the heap never holds a copy of the weights."""
        bundle_to_file(fp, self._members(save_dispatch_table=True, save_weights=True),
                       engine_version=ENGINE_VERSION)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        device = None
        non_cpu = [d for k, d in self.devices.items() if k != "cpu"]
        if non_cpu:
            device = str(non_cpu[0])
        data: Any = self.to_bytes()
        if isinstance(protocol, int) and protocol >= 5:
            # Out-of-band where the pickler takes buffers (Ray's object store, multiprocessing with
            # buffer_callback): the receiver maps the weights from the shared buffer, no heap copy.
            data = pickle.PickleBuffer(data)
        return (_load_from_bytes, (data, device))

    def close(self) -> None:
        """Drop prepared runs and workspaces of the calling thread and the bundle's file handle."""
        self._runtime.close()
        self._contents.archive.close()

    def __enter__(self) -> "CompiledGraph":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        from engine.runtime.report import graph_table
        return graph_table(self._runtime, self._dispatcher.table)

    def __repr__(self) -> str:
        m = self.meta
        return (f"<CompiledGraph {len(m.inputs)} inputs, {len(m.outputs)} outputs, {m.num_kernels} kernels on "
                f"{', '.join(str(d) for d in self.devices.values())}>")


class _Tee:
    """Two observers of one run: ``first`` records the trace of a tuning run, ``second`` is the caller's.

    ``second`` calls its ``run_once`` exactly once; that call runs the instruction through ``first``.
    """

    def __init__(self, first: InstructionObserver, second: InstructionObserver):
        self.first = first
        self.second = second

    def tuned(self, pos: int, task: CompiledTask, timing: CandidateTiming, start_ns: int, end_ns: int) -> None:
        self.first.tuned(pos, task, timing, start_ns, end_ns)
        self.second.tuned(pos, task, timing, start_ns, end_ns)

    def execute(self, pos: int, task: CompiledTask, choice: int, run_once: Callable[[], None],
                timing_runner: Callable[[], tuple[Callable[[], None], list[Storage]]]) -> None:
        def through_first() -> None:
            self.first.execute(pos, task, choice, run_once, timing_runner)

        self.second.execute(pos, task, choice, through_first, timing_runner)


def _symbol_values(name: str, values: int | Iterable[int]) -> list[int]:
    """One axis of a tuning grid: distinct non-negative integers, in the order given."""
    items = [values] if isinstance(values, (int, np.integer)) else list(values)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise InputError(f"tune: values of symbol {name!r} must be non-negative integers, got {v!r}")
    if not items:
        raise InputError(f"tune: no values given for symbol {name!r}")
    return list(dict.fromkeys(int(v) for v in items))


def _as_tensor(value: Any) -> Tensor:
    if isinstance(value, np.ndarray):
        return tensor_from_numpy(value)
    if hasattr(value, "__dlpack__"):
        return from_dlpack(value)
    raise InputError(f"outputs=: expected engine Tensors, numpy arrays or DLPack tensors, got {type(value).__name__}")


def _load_from_bytes(data: Any, device: str | None) -> CompiledGraph:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data = memoryview(data)  # an out-of-band pickle buffer
    return CompiledGraph(read_bundle(data), device=device)


def _bundle_source(path: object) -> str | os.PathLike[str] | bytes | bytearray | memoryview:
    """``path`` as ``read_bundle`` takes it: a path, or any object exporting a buffer (bytes, a
    memoryview, a numpy uint8 array, an ``mmap``), used in place."""
    if isinstance(path, (str, os.PathLike, bytes, bytearray, memoryview)):
        return path
    try:
        view = memoryview(path)  # type: ignore[arg-type]  # any object: a TypeError says it is no buffer
    except TypeError:
        raise InputError(f"load_compiled_graph: expected a bundle path, a directory or a buffer (bytes, "
                         f"memoryview, numpy uint8 array), got {type(path).__name__}") from None
    if not view.c_contiguous:
        raise InputError("load_compiled_graph: the bundle buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


#: What ``load_compiled_graph`` reads a bundle from: a ``.cgb`` file or directory, or a buffer holding one.
BundleSource = str | os.PathLike[str] | bytes | bytearray | memoryview | np.ndarray | mmap.mmap


def load_compiled_graph(path: BundleSource, device: str | Device | None = None, *,
                        registry: Registry | None = None, verify_weights: bool = False,
                        dispatch_policy: str | None = None) -> CompiledGraph:
    """Load a bundle (``.cgb`` file, directory, or a buffer holding one). Bundles contain native
    code: loading runs it.

    A buffer (bytes, memoryview, numpy uint8 array, mmap) is read in place: the weights are views
    of it, so a read-only buffer shared between processes (an ``mmap``, Ray's object store) is one
    copy however many graphs load it. The dispatch table is the bundle's rows, then the rows cached
    under the registry's ``cache_dir`` for keys the bundle lacks. ``dispatch_policy`` overrides
    ``ENGINE_DISPATCH_POLICY``.
    """
    contents = read_bundle(_bundle_source(path))
    try:
        if verify_weights:
            contents.verify_weights()
        return CompiledGraph(contents, device=device, registry=registry, dispatch_policy=dispatch_policy)
    except BaseException:
        contents.archive.close()
        raise


def save_compiled_graph(graph: CompiledGraph, path: str | Path, save_dispatch_table: bool = False,
                        save_weights: bool = True, overwrite: bool = False) -> None:
    graph.save(path, save_dispatch_table=save_dispatch_table, save_weights=save_weights, overwrite=overwrite)
