"""The slow path: run the plan instruction by instruction.

Used for a key with no dispatch-table entry (candidates are timed on the real operands and the
fastest is recorded, see ``engine.runtime.tuning``), whenever debugging hooks are registered (they
see every intermediate), and by ``graph.trace`` / ``graph.profile``, which pass an
``InstructionObserver`` that times each instruction. It shares the key's memory plan and the
thread's workspaces with the fast path, so both compute the same.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Protocol, Sequence

from engine.backend import BackendBase
from engine.bundle.contents import BundleContents
from engine.device import Device
from engine.dtypes import DType
from engine.plugins import Registry
from engine.runtime.plan import INPUT, OUTPUT, KeyPlan
from engine.runtime.prepared import prepare_instruction, resolve_static_addresses
from engine.runtime.tasks import CompiledTask
from engine.runtime.tuning import CandidateTiming, TuningOptions, launch_runner, timing_operands, tune_instruction
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor

__all__ = ["TuningOptions", "CandidateTiming", "interpret", "ModelExecutionHook", "InstructionObserver"]

ModelExecutionHook = Callable[[int, list[Tensor], list[Tensor]], None]

#: Makes a runner of the instruction's chosen candidate that is safe to call repeatedly (in-place
#: tasks run on clones); returns it with the storages to keep alive while it is used.
TimingRunnerFactory = Callable[[], tuple[Callable[[], None], list[Storage]]]


class InstructionObserver(Protocol):
    """Watches an interpreted run (traces and profiles)."""

    def tuned(self, pos: int, task: CompiledTask, timing: CandidateTiming, start_ns: int, end_ns: int) -> None:
        """Instruction ``pos``'s candidates were just timed (``perf_counter_ns`` bounds)."""

    def execute(self, pos: int, task: CompiledTask, choice: int, run_once: Callable[[], None],
                timing_runner: TimingRunnerFactory) -> None:
        """Run instruction ``pos`` for real by calling ``run_once`` exactly once (timing it as wished)."""


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
    observer: InstructionObserver | None = None,
) -> list[CandidateTiming]:
    """Run every instruction; fill ``choices`` (``None`` = tune now). Returns what tuning measured."""
    ex = contents.execution
    addr = resolve_static_addresses(plan, weights, workspaces)
    for t, (where, index) in enumerate(zip(plan.layout.where, plan.layout.index)):
        if where == INPUT:
            addr[t] = input_addrs[index]
        elif where == OUTPUT:
            addr[t] = out_storages[index].addr
    timings = []
    clock = time.perf_counter_ns
    for pos, ins in enumerate(ex.instructions):
        task = tasks[ins.task_idx]
        tensors = (*ins.inputs, *ins.outputs)
        addrs = [addr[t] for t in tensors]
        if choices[ins.task_idx] is None:
            start = clock()
            timing = _tune(contents, plan, task, pos, addrs, workspaces, streams, backends, device_index, tuning)
            choices[ins.task_idx] = timing.chosen
            timings.append(timing)
            if observer is not None:
                observer.tuned(pos, task, timing, start, clock())
        choice = choices[ins.task_idx] or 0
        launch, _ = prepare_instruction(contents, plan, task, pos, choice, addrs, workspaces, streams, backends,
                                        device_index)
        if observer is None:
            code = launch.call()
            if code:
                launch.fail(code)
        else:
            observer.execute(pos, task, choice, launch_runner(launch),
                             _timing_factory(contents, plan, task, pos, choice, addrs, workspaces, streams, backends,
                                             device_index))
        if hooks:
            _call_hooks(hooks, pos, ins, contents, plan, backends, device_index, addr, workspaces, registry)
    return timings


def _timing_factory(contents: BundleContents, plan: KeyPlan, task: CompiledTask, pos: int, choice: int,
                    addrs: list[int], workspaces: dict[str, Storage], streams: dict[str, object],
                    backends: dict[str, BackendBase], device_index: dict[str, int]) -> TimingRunnerFactory:
    def make() -> tuple[Callable[[], None], list[Storage]]:
        operands, clones = timing_operands(contents, plan, task, pos, addrs, streams)
        launch, _ = prepare_instruction(contents, plan, task, pos, choice, operands, workspaces, streams, backends,
                                        device_index)
        return launch_runner(launch), [*clones, launch]  # type: ignore[list-item]

    return make


def _tune(contents: BundleContents, plan: KeyPlan, task: CompiledTask, pos: int, addrs: list[int],
          workspaces: dict[str, Storage], streams: dict[str, object], backends: dict[str, BackendBase],
          device_index: dict[str, int], tuning: TuningOptions) -> CandidateTiming:
    """Time every candidate of instruction ``pos`` on its real operands (clones where it writes in place)."""
    operands, clones = timing_operands(contents, plan, task, pos, addrs, streams)
    launches = [prepare_instruction(contents, plan, task, pos, c, operands, workspaces, streams, backends,
                                    device_index)[0]
                for c in range(len(task.candidates))]
    timing = tune_instruction([launch_runner(launch) for launch in launches], task.backend, task.device_index,
                              tuning, instruction=pos, task=contents.execution.instructions[pos].task_idx)
    del clones  # kept alive until every candidate was timed on them
    return timing


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
