"""Captured graphs: one key's run bound to static buffers, replayed with nothing in between.

``graph.capture(*example_inputs)`` makes sure the key is tuned, then builds a prepared run of its
own (own workspaces, own output buffers, own copies of the inputs) and patches every address
once. A replay is then only the kernel launches: on a backend that can record a run (a CUDA or HIP
graph) the backend's ``capture`` records them; otherwise (the CPU, whose fused launches already
run the whole plan in one native call) the launches themselves are the replay.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.errors import InputError, Unsupported
from engine.runtime.prepared import OutputWrapper, PreparedRun
from engine.tensor import Tensor

if TYPE_CHECKING:
    from engine.runtime.compiled_graph import CompiledGraph

__all__ = ["CapturedGraph", "capture_graph"]


class CapturedGraph:
    """A replayable run on static buffers (reference: hidet's ``cuda_graph()`` object).

    ``inputs`` and ``outputs`` are the static tensors: write new values into ``inputs`` (or pass
    them to ``__call__``, which copies them in), ``replay()``, read ``outputs``. Every replay
    overwrites the same output buffers. Replays are serialised by a lock (the buffers are shared);
    the weights are those the graph had at capture time.
    """

    def __init__(self, graph: "CompiledGraph", key: tuple[int, ...], inputs: list[Tensor], outputs: list[Tensor],
                 replay: Callable[[], None], method: str, keep: list[Any]):
        self.graph = graph
        self.key = key
        self.inputs = inputs
        self.outputs = outputs
        self.method = method  # "native launches" or the backend that recorded it
        self._replay = replay
        self._keep = keep
        self._lock = threading.Lock()

    def replay(self) -> None:
        with self._lock:
            self._replay()

    def __call__(self, *inputs: Any) -> Any:
        """Copy ``inputs`` into the static input buffers, replay, return the static outputs."""
        if len(inputs) != len(self.inputs):
            raise InputError(f"the captured graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        addrs, _, key = self.graph._binder.bind(inputs)
        if key != self.key:
            named = ", ".join(f"{s}={v}" for s, v in zip(self.graph.meta.symbols, key))
            raise InputError(f"the graph was captured at {self._key_text()}; these inputs give {named}: capture "
                             f"again for other shapes")
        with self._lock:
            for static, addr in zip(self.inputs, addrs):
                if static.nbytes and static.addr != addr:
                    backend = self.graph._backends[static.device.kind]
                    backend.copy_device(static.addr, addr, static.nbytes, backend.current_stream(static.device.index))
            self._replay()
        return self.outputs[0] if len(self.outputs) == 1 else list(self.outputs)

    def close(self) -> None:
        """Drop the static buffers and the recorded run; safe to call twice."""
        with self._lock:
            self._replay = _closed
            self._keep = []
            self.inputs, self.outputs = [], []

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key_text(self) -> str:
        return ", ".join(f"{s}={v}" for s, v in zip(self.graph.meta.symbols, self.key)) or "its static shapes"

    def __repr__(self) -> str:
        return f"<CapturedGraph at {self._key_text()} ({self.method})>"


def _closed() -> None:
    raise InputError("this captured graph was closed")


def capture_graph(graph: "CompiledGraph", example_inputs: Sequence[Any]) -> CapturedGraph:
    graph.run_async(example_inputs)  # tunes (or applies the policy to) this key first
    addrs, _, key = graph._binder.bind(example_inputs)
    plan = graph._key_plan(key)
    choices = graph._choice_for(key)
    backends, index = graph._backends, graph._device_index
    streams = {k: b.current_stream(index[k]) for k, b in backends.items()}

    inputs = []
    for i, sig in enumerate(graph.meta.inputs):
        backend = backends[sig.device]
        storage = backend.allocate(plan.nbytes[i], index[sig.device])
        if storage.nbytes:
            backend.copy_device(storage.addr, addrs[i], storage.nbytes, streams[sig.device])
        inputs.append(Tensor(storage, sig.dtype, plan.shapes[i], 0, registry=graph._registry))
    workspaces = {k: backends[k].allocate(n, index[k]) for k, n in plan.workspace_bytes.items()}
    out_storages = [backends[s.kind].allocate(s.nbytes, index[s.kind]) for s in plan.output_slots]
    weights = graph._weights_or_raise()
    run = PreparedRun(graph._contents, plan, graph._tasks, choices, weights, workspaces, streams, backends, index,
                      graph._registry)
    static_addrs = [t.addr for t in inputs]
    run.patch(static_addrs, out_storages)
    wrapper = OutputWrapper(graph._contents, plan, backends, index, graph._registry)
    outputs = wrapper.wrap(static_addrs, inputs, out_storages)

    replay: Callable[[], None] = run.launch
    method = "native launches"
    kinds = set(plan.layout.kind) | {t.meta.device for t in graph._tasks}
    if len(kinds) == 1:
        (kind,) = kinds
        try:
            recorded = backends[kind].capture(run.launch, index[kind])
        except Unsupported:
            pass
        else:
            replay, method = recorded.replay, f"{kind} capture"
            workspaces["__recorded__"] = recorded  # type: ignore[assignment]  # kept alive with the buffers
    for kind, backend in backends.items():
        backend.synchronize(index[kind])
    keep: list[Any] = [run, workspaces, out_storages, weights]
    return CapturedGraph(graph, key, inputs, outputs, replay, method, keep)
