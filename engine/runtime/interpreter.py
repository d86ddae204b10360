"""The slow path: run the plan instruction by instruction.

Used for a key with no dispatch-table entry (candidates are timed in place and the fastest is
recorded), and whenever debugging hooks are registered (they see every intermediate). It shares
the key's memory plan and the thread's workspaces with the fast path, so both compute the same.
"""

from __future__ import annotations

import ctypes
import statistics
from typing import Any, Callable, Sequence

import attrs

from engine.backend import BackendBase
from engine.bundle.contents import BundleContents
from engine.device import Device
from engine.dtypes import DType
from engine.plugins import Registry
from engine.runtime.plan import INPUT, OUTPUT, KeyPlan
from engine.runtime.prepared import prepare_instruction, resolve_static_addresses
from engine.runtime.tasks import CompiledTask
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor

__all__ = ["TuningOptions", "CandidateTiming", "interpret", "ModelExecutionHook"]

ModelExecutionHook = Callable[[int, list[Tensor], list[Tensor]], None]


@attrs.frozen
class TuningOptions:
    warmup: int = 1
    repeat: int = 5


@attrs.frozen
class CandidateTiming:
    """What tuning measured for one instruction (kept for traces and profiles)."""

    instruction: int
    task: int
    medians_ms: tuple[float, ...]
    chosen: int


def view_tensor(backend: BackendBase, device: Device, addr: int, dtype: DType, shape: tuple[int, ...],
                nbytes: int, owner: object, registry: Registry | None = None) -> Tensor:
    """A tensor over memory the engine already owns (workspace, outputs) without copying."""
    host = None
    if backend.host_accessible and nbytes:
        host = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
    storage = ExternalStorage(device, addr, nbytes, owner=owner, host_view=host)
    return Tensor(storage, dtype, shape, 0, registry=registry)


def interpret(
    contents: BundleContents,
    plan: KeyPlan,
    tasks: Sequence[CompiledTask],
    choices: list[int | None],
    *,
    weights: Sequence[Tensor],
    workspaces: dict[str, Storage],
    streams: dict[str, object],
    backends: dict[str, BackendBase],
    device_index: dict[str, int],
    input_addrs: Sequence[int],
    out_storages: Sequence[Storage],
    hooks: Sequence[ModelExecutionHook] = (),
    tuning: TuningOptions = TuningOptions(),
    registry: Registry | None = None,
) -> list[CandidateTiming]:
    """Run every instruction; fill ``choices`` (``None`` = tune now). Returns what tuning measured."""
    ex = contents.execution
    addr = resolve_static_addresses(plan, weights, workspaces)
    for t, p in enumerate(plan.placements):
        if p.where == INPUT:
            addr[t] = input_addrs[p.index]
        elif p.where == OUTPUT:
            addr[t] = out_storages[p.index].addr
    timings = []
    for pos, ins in enumerate(ex.instructions):
        task = tasks[ins.task_idx]
        tensors = (*ins.inputs, *ins.outputs)
        addrs = [addr[t] for t in tensors]
        if choices[ins.task_idx] is None:
            timing = _tune(contents, plan, task, pos, addrs, workspaces, streams, backends, device_index, tuning)
            choices[ins.task_idx] = timing.chosen
            timings.append(timing)
        launch, _ = prepare_instruction(contents, plan, task, pos, choices[ins.task_idx] or 0, addrs, workspaces,
                                        streams, backends, device_index)
        code = launch.call()
        if code:
            launch.fail(code)
        if hooks:
            _call_hooks(hooks, pos, ins, contents, plan, backends, device_index, addr, workspaces, registry)
    return timings


def _tune(contents: BundleContents, plan: KeyPlan, task: CompiledTask, pos: int, addrs: list[int],
          workspaces: dict[str, Storage], streams: dict[str, object], backends: dict[str, BackendBase],
          device_index: dict[str, int], tuning: TuningOptions) -> CandidateTiming:
    """Time every candidate on this instruction's real operands and pick the lowest median.

    A task that writes in place would corrupt its input when run repeatedly, so it is timed on
    clones of the inputs it writes. Ties go to the lower candidate index (deterministic).
    """
    ins = contents.execution.instructions[pos]
    timing_addrs = list(addrs)
    clones = []
    backend = task.backend
    stream = streams.get(task.meta.device)
    n_in = len(ins.inputs)
    for out_arg, in_arg in task.meta.share_map.items():
        nbytes = plan.nbytes[ins.inputs[in_arg]]
        clone = backend.allocate(nbytes, task.device_index)
        clones.append(clone)
        if nbytes:
            backend.copy_device(clone.addr, addrs[in_arg], nbytes, stream)
        timing_addrs[in_arg] = clone.addr
        timing_addrs[n_in + out_arg] = clone.addr
    medians = []
    for c in range(len(task.candidates)):
        launch, _ = prepare_instruction(contents, plan, task, pos, c, timing_addrs, workspaces, streams, backends,
                                        device_index)

        def run_once(launch: Any = launch) -> None:
            code = launch.call()
            if code:
                launch.fail(code)

        samples = backend.time(run_once, warmup=tuning.warmup, repeat=tuning.repeat, device_index=task.device_index)
        medians.append(statistics.median(samples))
    chosen = min(range(len(medians)), key=lambda c: (medians[c], c))
    return CandidateTiming(pos, ins.task_idx, tuple(medians), chosen)


def _call_hooks(hooks: Sequence[ModelExecutionHook], pos: int, ins: Any, contents: BundleContents, plan: KeyPlan,
                backends: dict[str, BackendBase], device_index: dict[str, int], addr: list[int],
                workspaces: dict[str, Storage], registry: Registry | None) -> None:
    ex = contents.execution

    def tensor(t: int) -> Tensor:
        kind = ex.tensor_device[t]
        sig = ex.tensor_signatures[t]
        backends[kind].synchronize(device_index[kind])
        return view_tensor(backends[kind], Device(kind, device_index[kind]), addr[t], sig.dtype, plan.shapes[t],
                           plan.nbytes[t], workspaces, registry)

    ins_tensors = [tensor(t) for t in ins.inputs]
    out_tensors = [tensor(t) for t in ins.outputs]
    for hook in hooks:
        hook(pos, ins_tensors, out_tensors)
