"""``GraphRuntime``: a loaded graph's device and run state, the public seam under ``CompiledGraph``.

``CompiledGraph`` is the user's API (running, tuning, saving); everything it runs *on* lives here,
each with one owner:

* the devices (``DeviceSet``: one backend and device per kind) and the loaded tasks;
* the weights, replaced by ``set_weights`` (in place where the buffers are writable; a new
  *generation*: prepared runs are rebuilt);
* the memory plans per key (one ``GraphPlanner`` per graph, plans shared by every thread);
* the *lanes*: per (thread, streams) workspaces and prepared runs, in a ``threading.local``, and
  the run counters that outlive their threads.

Captures, reports and tools use this object (``graph.runtime``) rather than the graph's private
attributes. Nothing here is process-global (DESIGN §6).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from engine.device import Device
from engine.errors import DeviceUnavailableError, GraphClosedError, InputError, OutOfMemoryError, PluginError
from engine.plugins import Registry
from engine.runtime import native
from engine.runtime.binding import InputBinder
from engine.runtime.context import DeviceSet, RunContext
from engine.runtime.plan import GraphPlanner, KeyPlan, MemoryLimit, device_text, key_text, memory_limits
from engine.runtime.prepared import output_purpose
from engine.runtime.tasks import CompiledTask, load_tasks
from engine.runtime.weights import place_weights
from engine.runtime.workspace import Workspace
from engine.storage import Storage, close_all
from engine.tensor import Tensor, order_after

if TYPE_CHECKING:
    from engine.bundle.contents import BundleContents
    from engine.runtime.prepared import PreparedRun

__all__ = ["GraphRuntime", "Lane", "RunCounters", "RunStats", "open_devices"]


@attrs.frozen
class RunStats:
    """Counters summed over live threads: how many runs took which path."""

    fast_runs: int
    slow_runs: int
    prepared_runs: int
    tuned_keys: int


class RunCounters:
    """One thread's run counts; kept by the runtime after the thread ends (its lanes are not)."""

    __slots__ = ("fast_runs", "slow_runs", "prepared")

    def __init__(self) -> None:
        self.fast_runs = 0
        self.slow_runs = 0
        self.prepared = 0


class Lane:
    """What one thread owns on one set of streams: its streams, workspaces and prepared runs."""

    __slots__ = ("generation", "runs", "workspaces", "streams", "stream_key", "counters", "native", "__weakref__")

    def __init__(self, generation: int, streams: dict[str, object], counters: RunCounters,
                 stream_key: tuple[object, ...] = ()):
        self.generation = generation
        self.runs: dict[tuple[int, ...], PreparedRun] = {}
        self.workspaces: dict[str, Workspace] = {}
        self.streams = streams
        self.stream_key = stream_key
        self.counters = counters
        #: The native form of ``runs`` (``engine.runtime.native``'s ``NativeLane``), made with the
        #: first prepared run that has one; None: every run takes the Python path.
        self.native: Any = None


def open_devices(contents: "BundleContents", registry: Registry, device: str | Device | None) -> tuple[DeviceSet, str]:
    """The graph's devices (one per kind of the bundle, ``device`` picking the index of its kind) and
    the tag of their models that tuning results are keyed by."""
    kinds = contents.analysis.kinds
    wanted = Device.parse(device) if device is not None else None
    if wanted is not None and wanted.kind not in kinds:
        raise InputError(f"device {wanted} was asked for, but the bundle only runs on {', '.join(kinds)}")
    backends = {}
    devices = {}
    names: dict[str, str] = {}
    for kind in kinds:
        backend = registry.backend(kind)
        avail = backend.availability()
        if not avail.available:
            raise DeviceUnavailableError(f"device kind {kind!r} is not usable here: {avail.reason or 'unavailable'}")
        index = wanted.index if wanted is not None and wanted.kind == kind else 0
        if index >= avail.device_count:
            raise DeviceUnavailableError(f"{kind}:{index} does not exist ({avail.device_count} {kind} devices)")
        backends[kind] = backend
        devices[kind] = Device(kind, index)
        names[kind] = avail.device_names[index] if index < len(avail.device_names) else ""
    tag = hashlib.sha256("|".join(f"{k}={names[k]}" for k in sorted(names)).encode()).hexdigest()[:16]
    return DeviceSet(backends, devices, registry), tag


class GraphRuntime:
    """A graph's devices, tasks, weights, plans and lanes (see the module docstring)."""

    def __init__(self, contents: "BundleContents", devices: DeviceSet):
        self.contents = contents
        self.devices = devices
        self.tasks: tuple[CompiledTask, ...] = load_tasks(contents, dict(devices.backends), dict(devices.index))
        self._weights = place_weights(contents, dict(devices.backends), dict(devices.devices), devices.registry)
        devices.synchronize()  # uploads went on this thread's streams; runs on any stream read them
        self.binder = InputBinder(contents.meta, dict(devices.devices))
        #: The graph inputs on devices with their own memory, ``(position, kind)``: a run orders its work
        #: after what is pending on their streams (``order_inputs``). Empty for host-only graphs.
        self.device_inputs = tuple((i, sig.device) for i, sig in enumerate(contents.meta.inputs)
                                   if not devices.backends[sig.device].host_accessible)
        #: Whether prepared runs are also compiled for the native run path (``engine.runtime.native``):
        #: on when the switch is (``Settings.native_run``), the extension is usable and no device of
        #: the graph has streams or memory of its own (there the Python path orders the work).
        self.native_run = (devices.registry.settings.native_run and native.unavailable() is None
                           and not devices.stream_kinds and not self.device_inputs)
        #: Bumped whenever prepared runs must be rebuilt (new weights, new choices, hooks).
        self.generation = 0
        #: Bumped when a weight moves to another buffer (captures bound to the old ones re-bind).
        self.weights_version = 0
        self._plans: dict[tuple[int, ...], KeyPlan] = {}
        self._planner: GraphPlanner | None = None
        self._lock = threading.RLock()
        #: The calling thread's lanes: ``local.lane`` (the current one) and ``local.by_stream``.
        self.local = threading.local()
        self._counters: list[RunCounters] = []
        #: Set by ``close()``: no new lane, hence no run, after it.
        self.closed = False

    # -- weights -------------------------------------------------------------------------------
    @property
    def weights(self) -> list[Tensor] | None:
        return None if self._weights is None else list(self._weights)

    def require_weights(self) -> list[Tensor]:
        if self._weights is None:
            raise InputError("this graph was saved without weights: call set_weights(...) before running it")
        return self._weights

    def replace_weights(self, weights: list[Tensor]) -> None:
        """Make ``weights`` the graph's weights: written into the current weight buffers where those
        are the engine's and writable (device copies, earlier ``set_weights``), so prepared launches
        and recorded captures that point at them see the new values; new buffers otherwise (the
        read-only mapped bundle), which bumps ``weights_version`` so captures re-bind."""
        devices = self.devices
        devices.synchronize()  # no run still reads the old values; the new ones are uploaded
        with self._lock:
            current = self._weights
            merged: list[Tensor] = []
            for j, new in enumerate(weights):
                old = current[j] if current is not None else None
                if old is None or old.storage.readonly or old.device != new.device or old.nbytes != new.nbytes:
                    merged.append(new)
                    continue
                if new.nbytes:
                    backend = devices.backends[new.device.kind]
                    backend.copy_device(old.ptr, new.ptr, new.nbytes, backend.current_stream(new.device.index))
                merged.append(old)
            devices.synchronize()  # the in-place copies are done before any run sees them
            if current is None or any(a is not b for a, b in zip(merged, current)):
                self.weights_version += 1
            self._weights = merged
            self.generation += 1

    def invalidate(self) -> None:
        """Make every lane rebuild its prepared runs before its next run."""
        with self._lock:
            self.generation += 1

    # -- plans ---------------------------------------------------------------------------------
    def key_plan(self, key: tuple[int, ...]) -> KeyPlan:
        """The memory plan at ``key`` (made once per key, shared by every thread)."""
        plan = self._plans.get(key)
        if plan is None:
            # One GraphPlanner per graph keeps what does not depend on the key (issue 3); made on the
            # first plan so that loading stays cheap.
            planner = self._planner
            if planner is None:
                with self._lock:
                    planner = self._planner
                    if planner is None:
                        backends = self.devices.backends
                        planner = GraphPlanner(self.contents, {k: b.alignment for k, b in backends.items()},
                                               self._segment_sizes(), self._memory_limits())
                        self._planner = planner
            plan = planner.plan(key)
            with self._lock:
                plan = self._plans.setdefault(key, plan)
        return plan

    def _segment_sizes(self) -> dict[str, int]:
        """Per kind with an allocation cap, the segment size: the cap rounded down to the kind's
        alignment, so that every segment starts aligned."""
        sizes = {}
        for kind, backend in self.devices.backends.items():
            cap = backend.max_allocation(self.devices.index[kind])
            if cap is None:
                continue
            segment = cap - cap % backend.alignment
            if segment <= 0:
                raise PluginError(f"the {kind} backend's largest allocation ({cap} bytes) is below its alignment "
                                  f"({backend.alignment} bytes)")
            sizes[kind] = segment
        return sizes

    def _memory_limits(self) -> dict[str, MemoryLimit]:
        """Per kind, the most memory a key's plan may need (``plan.memory_limits``; read when the
        first key is planned, so that loading stays cheap)."""
        host_kinds = {k for k, b in self.devices.backends.items() if b.host_accessible}
        return memory_limits(self.devices.devices, host_kinds, os.environ)

    def plan_for(self, inputs: Sequence[Any]) -> KeyPlan:
        """The plan at the key these inputs give (validated as a run validates them)."""
        return self.key_plan(self.binder.bind(inputs)[2])

    # -- lanes ---------------------------------------------------------------------------------
    def lane(self) -> Lane:
        """The calling thread's lane for its current streams (``CompiledGraph.run_async`` inlines this)."""
        lane = getattr(self.local, "lane", None)
        if lane is None or lane.generation != self.generation:
            lane = self.new_lane()
        if self.devices.stream_kinds:
            lane = self.stream_lane(lane)
        return lane

    def new_lane(self) -> Lane:
        if self.closed:
            raise GraphClosedError("this graph was closed (close(), or the end of its 'with' block); load the "
                                   "bundle again to run it")
        streams = self.devices.current_streams()
        stream_kinds = self.devices.stream_kinds
        stream_key = tuple(streams[k] for k in stream_kinds)
        old = getattr(self.local, "lane", None)
        if old is not None:  # keep workspaces and counts across a set_weights; prepared runs are rebuilt
            lane = Lane(self.generation, streams, old.counters, stream_key)
            if old.stream_key == stream_key:
                lane.workspaces = old.workspaces
        else:
            lane = Lane(self.generation, streams, RunCounters(), stream_key)
            with self._lock:
                self._counters.append(lane.counters)
        self.local.lane = lane
        if stream_kinds:
            self.local.__dict__.setdefault("by_stream", {})[stream_key] = lane
        return lane

    def stream_lane(self, lane: Lane) -> Lane:
        """The lane for the thread's current streams: work queued on another stream gets its own
        workspaces (and prepared runs pointing into them), so it never shares scratch memory."""
        devices = self.devices
        current = tuple(devices.backends[k].current_stream(devices.index[k]) for k in devices.stream_kinds)
        if current == lane.stream_key:
            return lane
        other = self.local.__dict__.setdefault("by_stream", {}).get(current)
        if other is None or other.generation != self.generation:
            streams = {**lane.streams, **dict(zip(devices.stream_kinds, current))}
            other = Lane(self.generation, streams, lane.counters, current)
            self.local.by_stream[current] = other
        self.local.lane = other
        return other

    def order_inputs(self, lane: Lane, inputs: Sequence[Any]) -> None:
        """Queue the lane's work after the work pending on each device input's stream (an event, when
        it was produced on another stream or another thread's queue), and order the input's release
        after the lane's stream."""
        devices = self.devices
        for position, kind in self.device_inputs:
            storage = inputs[position].storage
            producer, stream = storage.stream, lane.streams.get(kind)
            if producer is not stream and producer != stream:
                order_after(devices.backends[kind], devices.index[kind], producer, stream)
                storage.stream = stream

    def ensure_workspaces(self, lane: Lane, plan: KeyPlan) -> None:
        """Grow the lane's workspaces to what ``plan`` needs (prepared runs pointing into the old
        ones are dropped; the old memory is released after the work queued on the lane's stream).

        When the new workspace cannot be allocated (``OutOfMemoryError``) the old one stays the
        lane's, so that smaller keys still run.
        """
        devices = self.devices
        for kind, size in plan.workspace_bytes.items():
            current = lane.workspaces.get(kind)
            if current is None or current.nbytes < size:
                stream = lane.streams.get(kind)
                grown = Workspace(devices.backends[kind], devices.index[kind], size, stream,
                                  plan.segment_bytes.get(kind), purpose=f"the {kind} workspace at {key_text(plan.env)}")
                lane.runs.clear()
                if lane.native is not None:
                    lane.native.clear()
                if current is not None:
                    current.release_after(stream)
                lane.workspaces[kind] = grown

    def add_run(self, lane: Lane, key: tuple[int, ...], run: "PreparedRun") -> None:
        """Keep ``run`` as the lane's prepared run at ``key`` (and its native form in the lane's
        ``NativeLane``, made on first use)."""
        lane.runs[key] = run
        if run.native is not None:
            if lane.native is None:
                lane.native = native.native_lane(self.binder, len(self.contents.meta.outputs))
            lane.native.add(key, run.native)

    def context(self, plan: KeyPlan, lane: Lane) -> RunContext:
        return RunContext(self.contents, plan, self.devices, lane.streams, lane.workspaces)

    def output_storages(self, plan: KeyPlan, lane: Lane) -> list[Storage]:
        """Fresh output buffers of ``plan`` for work on the lane's streams (slow paths)."""
        devices = self.devices
        storages = []
        for slot, s in enumerate(plan.output_slots):
            try:
                storages.append(devices.backends[s.kind].allocate(s.nbytes, devices.index[s.kind],
                                                                  lane.streams.get(s.kind)))
            except MemoryError as exc:
                close_all(storages)
                raise OutOfMemoryError.from_error(exc, s.nbytes, device_text(devices.devices[s.kind]),
                                                  output_purpose(self.contents, plan, slot)) from exc
        return storages

    def counters(self) -> list[RunCounters]:
        with self._lock:
            return list(self._counters)

    def close(self) -> None:
        """Drop the calling thread's lanes (other threads' go with their threads) and refuse new ones:
        every later run, on any thread, needs a new lane (the generation moved on), so each raises
        ``GraphClosedError`` instead of running on a graph whose bundle is closed."""
        self.closed = True
        self.invalidate()
        self.local = threading.local()
