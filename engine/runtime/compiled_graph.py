"""``CompiledGraph``: a loaded bundle bound to devices, with the reference runtime's API.

State that changes while serving lives in three places, each with one owner: the dispatch table
(locked updates), the weights (replaced whole by ``set_weights``, which bumps a generation counter),
and per-thread state (workspaces, prepared runs, counters) in a ``threading.local``. The hot path
reads the thread's state and one dict; nothing in it is process-global (DESIGN §6).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import attrs
import numpy as np

from engine.backend import BackendBase
from engine.bundle import archive as _archive
from engine.bundle.contents import BundleContents, bundle_members, read_bundle
from engine.bundle.schema import GraphExecution, GraphMetaData
from engine.device import Device
from engine.errors import BundleError, DeviceUnavailableError, InputError
from engine.plugins import Registry, default_registry
from engine.runtime.binding import InputBinder
from engine.runtime.dispatch import DispatchTable
from engine.runtime.interpreter import CandidateTiming, ModelExecutionHook, TuningOptions, interpret
from engine.runtime.plan import KeyPlan, build_key_plan
from engine.runtime.prepared import OutputWrapper, PreparedRun
from engine.runtime.tasks import CompiledTask, load_tasks
from engine.runtime.weights import check_weights, place_weights
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor, from_dlpack, tensor_from_numpy

__all__ = ["CompiledGraph", "RunStats", "load_compiled_graph", "save_compiled_graph"]

ENGINE_VERSION = "0.1.0"


@attrs.frozen
class RunStats:
    """Counters summed over live threads: how many runs took which path."""

    fast_runs: int
    slow_runs: int
    prepared_runs: int
    tuned_keys: int


class _Counters:
    """Per-thread run counts; kept by the graph after the thread ends (its workspaces are not)."""

    __slots__ = ("fast_runs", "slow_runs", "prepared")

    def __init__(self) -> None:
        self.fast_runs = 0
        self.slow_runs = 0
        self.prepared = 0


class _ThreadState:
    __slots__ = ("generation", "runs", "workspaces", "streams", "counters", "__weakref__")

    def __init__(self, generation: int, streams: dict[str, object], counters: _Counters):
        self.generation = generation
        self.runs: dict[tuple[int, ...], PreparedRun] = {}
        self.workspaces: dict[str, Storage] = {}
        self.streams = streams
        self.counters = counters


class CompiledGraph:
    """A compiled graph ready to run (reference API: ``hidet.runtime.CompiledGraph``)."""

    def __init__(self, contents: BundleContents, *, device: str | Device | None = None,
                 registry: Registry | None = None):
        self._contents = contents
        self._registry = registry if registry is not None else default_registry()
        an = contents.analysis
        wanted = Device.parse(device) if device is not None else None
        if wanted is not None and wanted.kind not in an.kinds:
            raise InputError(f"device {wanted} was asked for, but the bundle only runs on {', '.join(an.kinds)}")
        self._backends: dict[str, BackendBase] = {}
        self._devices: dict[str, Device] = {}
        for kind in an.kinds:
            backend = self._registry.backend(kind)
            avail = backend.availability()
            if not avail.available:
                raise DeviceUnavailableError(f"device kind {kind!r} is not usable here: {avail.reason or 'unavailable'}")
            index = wanted.index if wanted is not None and wanted.kind == kind else 0
            if index >= avail.device_count:
                raise DeviceUnavailableError(f"{kind}:{index} does not exist ({avail.device_count} {kind} devices)")
            self._backends[kind] = backend
            self._devices[kind] = Device(kind, index)
        self._device_index = {k: d.index for k, d in self._devices.items()}
        self._tasks = load_tasks(contents, self._backends, self._device_index)
        self._weights = place_weights(contents, self._backends, self._devices, self._registry)
        self._binder = InputBinder(contents.meta, self._devices)
        self._dispatch = DispatchTable(contents.meta.symbols, [len(t.candidates) for t in self._tasks],
                                       contents.dispatch_rows, policy=self._registry.settings.dispatch_policy)
        self._policy_choices: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._plans: dict[tuple[int, ...], KeyPlan] = {}
        self._lock = threading.RLock()
        self._local = threading.local()
        self._counters: list[_Counters] = []
        self._generation = 0
        self._hooks: list[ModelExecutionHook] = []
        self._tuning_log: dict[tuple[int, ...], list[CandidateTiming]] = {}
        self.tuning = TuningOptions()

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
        return None if self._weights is None else list(self._weights)

    @property
    def dispatch_table(self) -> DispatchTable:
        return self._dispatch

    @property
    def graph_string(self) -> str:
        return self._contents.graph_string

    @property
    def identity(self) -> str:
        """The bundle's identity (cache key): unchanged by a new dispatch table."""
        return self._contents.identity

    @property
    def devices(self) -> dict[str, Device]:
        return dict(self._devices)

    @property
    def dispatch_policy(self) -> str:
        return self._dispatch.policy

    @dispatch_policy.setter
    def dispatch_policy(self, value: str) -> None:
        self._dispatch.policy = value

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
        addrs, keep, key = self._binder.bind(inputs)
        state = getattr(self._local, "state", None)
        if state is None or state.generation != self._generation:
            state = self._new_state()
        out_storages = None if outputs is None else self._output_storages(outputs, key)
        run = state.runs.get(key)
        if run is None or self._hooks:
            result = self._run_slow(state, key, addrs, keep, out_storages)
        else:
            state.counters.fast_runs += 1
            result = run.run(addrs, keep, out_storages)
        if output_to_torch_tensor:
            return [t.torch() for t in result]
        return result

    def _new_state(self) -> _ThreadState:
        streams = {k: b.current_stream(self._device_index[k]) for k, b in self._backends.items()}
        old = getattr(self._local, "state", None)
        if old is not None:  # keep workspaces and counts across a set_weights; prepared runs are rebuilt
            state = _ThreadState(self._generation, streams, old.counters)
            state.workspaces = old.workspaces
        else:
            state = _ThreadState(self._generation, streams, _Counters())
            with self._lock:
                self._counters.append(state.counters)
        self._local.state = state
        return state

    def _key_plan(self, key: tuple[int, ...]) -> KeyPlan:
        plan = self._plans.get(key)
        if plan is None:
            plan = build_key_plan(self._contents, key, {k: b.alignment for k, b in self._backends.items()})
            with self._lock:
                plan = self._plans.setdefault(key, plan)
        return plan

    def _ensure_workspaces(self, state: _ThreadState, plan: KeyPlan) -> None:
        for kind, size in plan.workspace_bytes.items():
            current = state.workspaces.get(kind)
            if current is None or current.nbytes < size:
                state.runs.clear()  # prepared runs point into the old workspace
                state.workspaces[kind] = self._backends[kind].allocate(size, self._device_index[kind])

    def _weights_or_raise(self) -> list[Tensor]:
        if self._weights is None:
            raise InputError("this graph was saved without weights: call set_weights(...) before running it")
        return self._weights

    def _choice_for(self, key: tuple[int, ...]) -> list[int | None]:
        row = self._dispatch.get(key) or self._policy_choices.get(key)
        if row is not None:
            return list(row)
        if not self._dispatch.needs_tuning:
            return list(self._dispatch.trivial_choice())
        policy = self._dispatch.policy
        if policy == "error":
            raise self._dispatch.error_for(key)
        if policy == "first":
            self._policy_choices[key] = self._dispatch.trivial_choice()
            return list(self._policy_choices[key])
        if policy == "nearest":
            near = self._dispatch.nearest(key)
            if near is not None:
                self._policy_choices[key] = near
                return list(near)
        return [None if len(t.candidates) > 1 else 0 for t in self._tasks]

    def _run_slow(self, state: _ThreadState, key: tuple[int, ...], addrs: list[int], keep: list[Any],
                  out_storages: list[Storage] | None) -> list[Tensor]:
        weights = self._weights_or_raise()
        plan = self._key_plan(key)
        self._ensure_workspaces(state, plan)
        choices = self._choice_for(key)
        if None not in choices and not self._hooks:
            run = PreparedRun(self._contents, plan, self._tasks, choices, weights, state.workspaces, state.streams,
                              self._backends, self._device_index, self._registry)
            state.runs[key] = run
            state.counters.prepared += 1
            return run.run(addrs, keep, out_storages)
        return self._interpret(state, plan, choices, addrs, keep, out_storages)

    def _interpret(self, state: _ThreadState, plan: KeyPlan, choices: list[int | None], addrs: list[int],
                   keep: list[Any], out_storages: list[Storage] | None) -> list[Tensor]:
        """Run instruction by instruction, tuning the tasks whose choice is ``None``, and record it."""
        key = plan.key
        weights = self._weights_or_raise()
        if out_storages is None:
            out_storages = [self._backends[s.kind].allocate(s.nbytes, self._device_index[s.kind])
                            for s in plan.output_slots]
        timings = interpret(self._contents, plan, self._tasks, choices, weights=weights,
                            workspaces=state.workspaces, streams=state.streams, backends=self._backends,
                            device_index=self._device_index, input_addrs=addrs, out_storages=out_storages,
                            hooks=tuple(self._hooks), tuning=self.tuning, registry=self._registry)
        state.counters.slow_runs += 1
        if timings:
            self._dispatch.record(key, tuple(c or 0 for c in choices))
            with self._lock:
                self._tuning_log[key] = timings
        # Outputs are wrapped exactly as the fast path does (share_map and copied inputs included).
        wrapper = OutputWrapper(self._contents, plan, self._backends, self._device_index, self._registry)
        return wrapper.wrap(addrs, keep, out_storages)

    def _output_storages(self, outputs: Sequence[Any], key: tuple[int, ...]) -> list[Storage]:
        plan = self._key_plan(key)
        ex = self._contents.execution
        if len(outputs) != len(ex.outputs_index):
            raise InputError(f"outputs=: the graph has {len(ex.outputs_index)} outputs, got {len(outputs)}")
        storages: list[Storage | None] = [None] * len(plan.output_slots)
        for k, (out, (what, ref)) in enumerate(zip(outputs, plan.outputs)):
            if what == "input":
                continue
            t = out if isinstance(out, Tensor) else _as_tensor(out)
            sig = self._contents.meta.outputs[k]
            shape = plan.shapes[ex.outputs_index[k]]
            if t.dtype != sig.dtype or tuple(t.shape) != shape or t.device != self._devices[sig.device]:
                raise InputError(f"outputs[{k}]: expected {sig.dtype.name}{list(shape)} on "
                                 f"{self._devices[sig.device]}, got {t.dtype.name}{list(t.shape)} on {t.device}")
            if t.storage.readonly:
                raise InputError(f"outputs[{k}]: the buffer is read-only")
            storages[ref] = t.storage if t.offset == 0 else ExternalStorage(t.device, t.addr, t.nbytes, owner=t)
        return storages  # type: ignore[return-value]

    # -- tuning and introspection ---------------------------------------------------------------
    def run_stats(self) -> RunStats:
        """Counts over every thread that ever ran this graph."""
        with self._lock:
            counters = list(self._counters)
        return RunStats(sum(c.fast_runs for c in counters), sum(c.slow_runs for c in counters),
                        sum(c.prepared for c in counters), len(self._dispatch))

    def tune(self, progress: Callable[[int, int, dict[str, int]], None] | None = None,
             **symbols: int | Iterable[int]) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Tune ahead of time over the grid of the given symbol values (``batch=[1, 8, 64]``).

        Keys already in the dispatch table are kept. Each new key runs once on zero-filled inputs
        through the slow path, whatever the dispatch policy. ``progress(done, total, symbols)`` is
        called after each key. Returns the rows for the whole grid; save them with
        ``save(..., save_dispatch_table=True)``.
        """
        names = self.meta.symbols
        missing = [s for s in names if s not in symbols]
        unknown = [s for s in symbols if s not in names]
        if missing or unknown:
            raise InputError(f"tune needs values for exactly the symbols {list(names)}; missing {missing}, "
                             f"unknown {unknown}")
        axes = [[int(v) for v in ([symbols[s]] if isinstance(symbols[s], int) else symbols[s])] for s in names]
        grid = list(itertools.product(*axes))
        state = getattr(self._local, "state", None)
        if state is None or state.generation != self._generation:
            state = self._new_state()
        for done, key in enumerate(grid, start=1):
            if key not in self._dispatch and self._dispatch.needs_tuning:
                plan = self._key_plan(key)
                self._ensure_workspaces(state, plan)
                inputs = self._zero_inputs(plan)
                addrs = [t.addr for t in inputs]
                self._interpret(state, plan, [None if len(t.candidates) > 1 else 0 for t in self._tasks], addrs,
                                inputs, None)
            if progress is not None:
                progress(done, len(grid), dict(zip(names, key)))
        return {key: self._dispatch.get(key) or self._dispatch.trivial_choice() for key in grid}

    def _zero_inputs(self, plan: KeyPlan) -> list[Tensor]:
        out = []
        for i, sig in enumerate(self.meta.inputs):
            backend = self._backends[sig.device]
            index = self._device_index[sig.device]
            storage = backend.allocate(plan.nbytes[i], index)
            if storage.nbytes:
                backend.memset(storage.addr, 0, storage.nbytes, backend.current_stream(index))
            out.append(Tensor(storage, sig.dtype, plan.shapes[i], 0, registry=self._registry))
        return out

    def tuning_results(self) -> dict[tuple[int, ...], list[CandidateTiming]]:
        with self._lock:
            return {k: list(v) for k, v in self._tuning_log.items()}

    def register_hook(self, hook: ModelExecutionHook) -> None:
        """Call ``hook(instruction_index, inputs, outputs)`` after each instruction (runs interpreted)."""
        if not callable(hook):
            raise TypeError("register_hook expects a callable (int, list[Tensor], list[Tensor]) -> None")
        with self._lock:
            self._hooks.append(hook)

    def memory_report(self, **symbols: int) -> dict[str, Any]:
        from engine.runtime.report import memory_report
        return memory_report(self, symbols)

    # -- weights -------------------------------------------------------------------------------
    def set_weights(self, weights: Sequence[Any]) -> None:
        """Replace every weight (``weights_index`` order); checked for count, dtype, shape, device."""
        new = check_weights(list(weights), self._contents, self._devices, self._backends, self._registry)
        with self._lock:
            self._weights = new
            self._generation += 1

    # -- saving and pickling -------------------------------------------------------------------
    def _members(self, *, save_dispatch_table: bool, save_weights: bool) -> dict[str, Any]:
        c = self._contents
        binaries = {}
        for k, kernel in enumerate(c.kernels):
            for cand in kernel.candidates:
                for b in cand.binaries:
                    name = f"kernels/{k}/{b.path}"
                    binaries[name] = c.archive.map(name)
        weights = None
        if save_weights and self._weights is not None:
            names = [e.name for e in c.weight_entries] if c.weight_entries else [
                f"w{j}" for j in range(len(self._weights))]
            weights = [(n, w.numpy()) for n, w in zip(names, self._weights)]
        entries = c.weight_entries
        if entries is None and c.npz_weights is not None:
            from engine.bundle.contents import weights_layout
            entries = tuple(weights_layout([(f"w{j}", a) for j, a in enumerate(c.npz_weights)])[0])
        return bundle_members(meta=c.meta, execution=c.execution, kernels=c.kernels, binaries=binaries,
                              weights=weights, weight_entries=entries,
                              dispatch_rows=self._dispatch.rows() if save_dispatch_table else None,
                              graph_string=c.graph_string)

    def save(self, path: str | Path, *, save_dispatch_table: bool = False, save_weights: bool = True,
             form: str | None = None) -> None:
        """Write the bundle atomically (``.cgb`` zip, or a directory when ``form="dir"``)."""
        target = Path(path)
        chosen = form or ("dir" if target.is_dir() else "zip")
        _archive.write_bundle(target, self._members(save_dispatch_table=save_dispatch_table,
                                                    save_weights=save_weights),
                              engine_version=ENGINE_VERSION, form=chosen)

    def to_bytes(self) -> bytes:
        """The bundle as bytes, dispatch table and current weights included (used by pickling)."""
        return _archive.bundle_to_bytes(self._members(save_dispatch_table=True, save_weights=True),
                                        engine_version=ENGINE_VERSION)

    def __reduce__(self) -> tuple[Any, ...]:
        device = None
        non_cpu = [d for k, d in self._devices.items() if k != "cpu"]
        if non_cpu:
            device = str(non_cpu[0])
        return (_load_from_bytes, (self.to_bytes(), device))

    def close(self) -> None:
        """Drop prepared runs and workspaces of the calling thread and the bundle's file handle."""
        with self._lock:
            self._generation += 1
        self._local = threading.local()
        self._contents.archive.close()

    def __enter__(self) -> "CompiledGraph":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        from engine.runtime.report import graph_table
        return graph_table(self)

    def __repr__(self) -> str:
        m = self.meta
        return (f"<CompiledGraph {len(m.inputs)} inputs, {len(m.outputs)} outputs, {m.num_kernels} kernels on "
                f"{', '.join(str(d) for d in self._devices.values())}>")


def _as_tensor(value: Any) -> Tensor:
    if isinstance(value, np.ndarray):
        return tensor_from_numpy(value)
    if hasattr(value, "__dlpack__"):
        return from_dlpack(value)
    raise InputError(f"outputs=: expected engine Tensors, numpy arrays or DLPack tensors, got {type(value).__name__}")


def _load_from_bytes(data: bytes, device: str | None) -> CompiledGraph:
    return CompiledGraph(read_bundle(data), device=device)


def load_compiled_graph(path: str | Path | bytes, device: str | Device | None = None, *,
                        registry: Registry | None = None, verify_weights: bool = False) -> CompiledGraph:
    """Load a bundle (``.cgb`` file, directory, or bytes). Bundles contain native code: loading runs it."""
    contents = read_bundle(path)
    try:
        if verify_weights:
            bad = contents.archive.verify([n for n in ("weights.bin", "weights.npz") if n in contents.archive])
            if bad:
                raise BundleError("sha256 mismatch: the weights are corrupted or were modified", member=bad[0])
        return CompiledGraph(contents, device=device, registry=registry)
    except BaseException:
        contents.archive.close()
        raise


def save_compiled_graph(graph: CompiledGraph, path: str | Path, save_dispatch_table: bool = False,
                        save_weights: bool = True) -> None:
    graph.save(path, save_dispatch_table=save_dispatch_table, save_weights=save_weights)
