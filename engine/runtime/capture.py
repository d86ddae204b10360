"""Captured graphs: one key's run bound to static buffers, replayed with nothing in between.

``graph.capture(*example_inputs)`` makes sure the key is tuned, then builds a prepared run of its
own (own workspaces, own output buffers, own copies of the inputs) and patches every address
once. A replay is then only the kernel launches: on a backend that can record a run (a CUDA or HIP
graph) the backend's ``capture`` records them; otherwise (the CPU) the launches themselves are the
replay: with the native run path (``engine.runtime.native``) one C call over the static buffers,
else the fused native call(s).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

from engine.backend import BackendBase, Replayable
from engine.errors import InputError, OutOfMemoryError, Unsupported
from engine.runtime.context import RunContext
from engine.runtime.plan import KeyPlan, key_text
from engine.runtime.prepared import OutputWrapper, PreparedRun, input_text, output_purpose
from engine.runtime.runtime import GraphRuntime
from engine.runtime.workspace import Workspace
from engine.storage import Storage, close_all
from engine.tensor import Tensor

__all__ = ["CapturedGraph", "capture_graph", "KeyTuner"]


class KeyTuner(Protocol):
    """What a capture needs of the graph it captures beyond its ``GraphRuntime``: a run that tunes
    the key of its inputs (or applies the dispatch policy), and the candidates chosen for a key.

    ``CompiledGraph`` is one; naming only these two methods keeps this module below the facade, so
    that ``compiled_graph`` imports ``capture`` and not the other way round.
    """

    def run_async(self, inputs: Sequence[Any]) -> object: ...

    def choice_for(self, key: tuple[int, ...]) -> list[int | None]: ...


class CapturedGraph:
    """A replayable run on static buffers (reference: hidet's ``cuda_graph()`` object).

    ``inputs`` and ``outputs`` are the static tensors: write new values into ``inputs`` (or pass
    them to ``__call__``, which copies them in), ``replay()``, read ``outputs`` (which hold the
    example inputs' results when ``capture`` returns). Every replay
    overwrites the same output buffers. Replays are serialised by a lock (the buffers are shared).
    A replay uses the graph's current weights: ``set_weights`` writes into the weight buffers the
    capture points at where it can, and where a weight moved to a new buffer the next replay
    prepares (and records) the launches again first. Work is queued on the streams current in the
    capturing thread (``replay(stream=...)`` may name another stream of a single-kind capture).
    """

    def __init__(self, runtime: GraphRuntime, symbols: Sequence[str], key: tuple[int, ...], inputs: list[Tensor],
                 outputs: list[Tensor], bind: Callable[[], Binding], streams: dict[str, object], keep: list[Any]):
        self.runtime = runtime
        self.symbols = tuple(symbols)
        self.key = key
        self.inputs = inputs
        self.outputs = outputs
        self._bind = bind
        self._binding = bind()
        self._streams = streams
        self._keep = keep
        self._lock = threading.Lock()

    @property
    def method(self) -> str:
        """``"native launches"``, or the backend that recorded the launches (``"cuda capture"``)."""
        return self._binding.method

    def replay(self, stream: Any = None) -> None:
        """Run the captured work again, on ``stream`` (a recorded capture only; ``None``: the stream it
        was captured on). The outputs are then read after the work on that stream."""
        with self._lock:
            self._replay_locked(stream)
            if stream is not None:
                for out in self.outputs:
                    out.storage.stream = stream

    def __call__(self, *inputs: Any) -> Any:
        """Copy ``inputs`` into the static input buffers, replay, return the static outputs."""
        if len(inputs) != len(self.inputs):
            raise InputError(f"the captured graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        ptrs, _, key = self.runtime.binder.bind(inputs)
        if key != self.key:
            named = ", ".join(f"{s}={v}" for s, v in zip(self.symbols, key))
            raise InputError(f"the graph was captured at {self._key_text()}; these inputs give {named}: capture "
                             f"again for other shapes")
        devices = self.runtime.devices
        with self._lock:
            for static, ptr in zip(self.inputs, ptrs):
                if static.nbytes and static.ptr != ptr:
                    kind = static.device.kind
                    devices.backends[kind].copy_device(static.ptr, ptr, static.nbytes, self._streams.get(kind))
            self._replay_locked(None)
        return self.outputs[0] if len(self.outputs) == 1 else list(self.outputs)

    def _replay_locked(self, stream: Any) -> None:
        binding = self._binding
        if binding.weights_version != self.runtime.weights_version and binding.replay is not _closed:
            self._binding = self._bind()  # a weight moved to a new buffer: prepare (and record) again
            binding.release()
            binding = self._binding
        binding.replay(stream)

    def close(self) -> None:
        """Release the recorded run and drop the static buffers; safe to call twice."""
        with self._lock:
            self._binding.release()
            self._binding = Binding(_closed, self._binding.method, None, [], self._binding.weights_version)
            self._keep = []
            self.inputs, self.outputs = [], []

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key_text(self) -> str:
        return ", ".join(f"{s}={v}" for s, v in zip(self.symbols, self.key)) or "its static shapes"

    def __repr__(self) -> str:
        return f"<CapturedGraph at {self._key_text()} ({self.method})>"


def _static_buffers(runtime: GraphRuntime, plan: KeyPlan, streams: dict[str, Any]
                    ) -> tuple[list[Tensor], dict[str, Workspace], list[Storage]]:
    """The capture's own input buffers, workspaces and output buffers at ``plan``'s key.

    An ``OutOfMemoryError`` says which buffer failed; the ones already made are released first.
    """
    devices, contents = runtime.devices, runtime.contents
    backends, index = devices.backends, devices.index
    at = key_text(plan.env)
    made: list[Storage] = []
    try:
        inputs = []
        for i, sig in enumerate(contents.meta.inputs):
            what = f"a capture's copy of {input_text(contents.meta.input_names, i)} at {at}"
            storage = _allocate(backends[sig.device], index[sig.device], plan.nbytes[i], streams[sig.device], what)
            made.append(storage)
            inputs.append(Tensor(storage, sig.dtype, plan.shapes[i], 0, registry=devices.registry))
        workspaces = {}
        for kind, nbytes in plan.workspace_bytes.items():
            workspaces[kind] = Workspace(backends[kind], index[kind], nbytes, streams[kind],
                                         plan.segment_bytes.get(kind), purpose=f"a capture's {kind} workspace at {at}")
            made.extend(workspaces[kind].storages)
        out_storages = []
        for slot, s in enumerate(plan.output_slots):
            what = f"a capture's {output_purpose(contents, plan, slot)}"
            out_storages.append(_allocate(backends[s.kind], index[s.kind], s.nbytes, streams[s.kind], what))
            made.append(out_storages[-1])
    except OutOfMemoryError:
        close_all(made)
        raise
    return inputs, workspaces, out_storages


def _allocate(backend: BackendBase, device_index: int, nbytes: int, stream: Any, purpose: str) -> Storage:
    """``backend.allocate``, its ``OutOfMemoryError`` saying what the memory was for."""
    try:
        return backend.allocate(nbytes, device_index, stream)
    except MemoryError as exc:
        raise OutOfMemoryError.from_error(exc, nbytes, f"{backend.kind}:{device_index}", purpose) from exc


def _closed(stream: Any = None) -> None:
    raise InputError("this captured graph was closed")


def capture_graph(tuner: KeyTuner, runtime: GraphRuntime, symbols: Sequence[str],
                  example_inputs: Sequence[Any]) -> CapturedGraph:
    """Capture the run of ``runtime`` at the key of ``example_inputs`` (``symbols`` name the key's
    entries); ``tuner`` runs them first, so the key is tuned, and gives its candidate choices."""
    tuner.run_async(example_inputs)  # tunes (or applies the policy to) this key first
    devices = runtime.devices
    ptrs, _, key = runtime.binder.bind(example_inputs)
    plan = runtime.key_plan(key)
    choices = tuner.choice_for(key)
    streams = devices.current_streams()
    backends, index = devices.backends, devices.index

    inputs, workspaces, out_storages = _static_buffers(runtime, plan, streams)
    for i, static in enumerate(inputs):
        if static.nbytes:
            kind = static.device.kind
            backends[kind].copy_device(static.ptr, ptrs[i], static.nbytes, streams[kind])
    ctx = RunContext(runtime.contents, plan, devices, streams, workspaces)
    static_ptrs = [t.ptr for t in inputs]
    outputs = OutputWrapper(ctx).wrap(static_ptrs, inputs, out_storages)
    kinds = set(plan.layout.kind) | {t.meta.device for t in runtime.tasks}

    def check_stream(stream: Any) -> None:
        if stream not in streams.values():
            raise InputError("this capture replays its prepared launches, which are bound to the streams it was "
                             "captured on; replay() it without a stream, or capture on the stream you want")

    def bind() -> Binding:
        """Prepare (and, where the backend can, record) the launches over the static buffers and the
        graph's current weight buffers; done again when ``set_weights`` moved a weight."""
        version = runtime.weights_version
        weights = runtime.require_weights()
        run = PreparedRun(ctx, runtime.tasks, choices, weights,  # type: ignore[arg-type]  # the key is tuned
                          native=runtime.native_run)
        run.patch(static_ptrs, out_storages)

        def launches(stream: Any) -> None:
            if stream is not None:
                check_stream(stream)
            run.launch()

        replay: Callable[[Any], None] = launches
        if run.native is not None:
            # The native run path's launches: replay() is one C call over the static buffers.
            run.native.on_stream = check_stream
            replay = run.native.launch
        method = "native launches"
        recorded: Replayable | None = None
        if len(kinds) == 1:
            (kind,) = kinds
            try:
                recorded = backends[kind].capture(run.launch, stream=streams[kind], device_index=index[kind])
            except Unsupported:
                pass
            else:
                default = streams[kind]
                replay = lambda stream: recorded.replay(default if stream is None else stream)  # noqa: E731
                method = f"{kind} capture"
        devices.synchronize()
        return Binding(replay, method, recorded, [run, weights], version)

    keep: list[Any] = [workspaces, out_storages]
    captured = CapturedGraph(runtime, symbols, key, inputs, outputs, bind, streams, keep)
    # Recording runs nothing (a CUDA graph capture only records): one replay, so that the outputs
    # hold the example inputs' results whichever way the launches were captured.
    captured.replay()
    return captured


class Binding:
    """One preparation of a capture's launches: how to replay them and what they point at."""

    __slots__ = ("replay", "method", "recorded", "keep", "weights_version")

    def __init__(self, replay: Callable[[Any], None], method: str, recorded: Replayable | None, keep: list[Any],
                 weights_version: int):
        self.replay = replay
        self.method = method
        self.recorded = recorded
        self.keep = keep
        self.weights_version = weights_version

    def release(self) -> None:
        """Free what the backend recorded (safe to call twice)."""
        recorded, self.recorded = self.recorded, None
        if recorded is not None:
            recorded.close()
        self.keep = []
