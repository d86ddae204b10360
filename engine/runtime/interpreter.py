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
from engine.device import Device
from engine.dtypes import DType
from engine.plugins import Registry
from engine.runtime.context import RunContext
from engine.runtime.plan import INPUT, OUTPUT
from engine.runtime.prepared import prepare_instruction, resolve_static_pointers
from engine.runtime.tasks import CompiledTask
from engine.runtime.tuning import CandidateTiming, TuningOptions, launch_runner, timing_operands, tune_instruction
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor, host_wait

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


def view_tensor(backend: BackendBase, device: Device, ptr: Any, dtype: DType, shape: tuple[int, ...],
                nbytes: int, owner: object, registry: Registry | None = None) -> Tensor:
    """A tensor over memory the engine already owns (workspace, outputs) without copying."""
    host = None
    if backend.host_accessible and nbytes:
        host = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    storage = ExternalStorage(device, ptr, nbytes, owner=owner, host_view=host)
    return Tensor(storage, dtype, shape, 0, registry=registry)


def interpret(
    ctx: RunContext,
    tasks: Sequence[CompiledTask],
    choices: list[int | None],
    *,
    weights: Sequence[Tensor],
    input_ptrs: Sequence[Any],
    out_storages: Sequence[Storage],
    hooks: Sequence[ModelExecutionHook] = (),
    tuning: TuningOptions = TuningOptions(),
    observer: InstructionObserver | None = None,
    on_tuned: Callable[[int], None] | None = None,
) -> list[CandidateTiming]:
    """Run every instruction; fill ``choices`` (``None`` = tune now). Returns what tuning measured.

    ``on_tuned(count)`` is called after each instruction whose candidates were timed (``count``
    so far): the graph's tuning listener follows the progress of a key with it.
    """
    plan = ctx.plan
    ex = ctx.contents.execution
    ptr = resolve_static_pointers(ctx, weights)
    for t, (where, index) in enumerate(zip(plan.layout.where, plan.layout.index)):
        if where == INPUT:
            ptr[t] = input_ptrs[index]
        elif where == OUTPUT:
            ptr[t] = out_storages[index].ptr
    timings = []
    clock = time.perf_counter_ns
    for pos, ins in enumerate(ex.instructions):
        task = tasks[ins.task_idx]
        tensors = (*ins.inputs, *ins.outputs)
        ptrs = [ptr[t] for t in tensors]
        if choices[ins.task_idx] is None:
            start = clock()
            timing = _tune(ctx, task, pos, ptrs, tuning)
            choices[ins.task_idx] = timing.chosen
            timings.append(timing)
            if observer is not None:
                observer.tuned(pos, task, timing, start, clock())
            if on_tuned is not None:
                on_tuned(len(timings))
        choice = choices[ins.task_idx] or 0
        launch, _ = prepare_instruction(ctx, task, pos, choice, ptrs)
        if observer is None:
            code = launch.call()
            if code:
                launch.fail(code)
        else:
            observer.execute(pos, task, choice, launch_runner(launch), _timing_factory(ctx, task, pos, choice, ptrs))
        if hooks:
            _call_hooks(ctx, hooks, pos, ins, ptr)
    return timings


def _timing_factory(ctx: RunContext, task: CompiledTask, pos: int, choice: int, ptrs: list[Any]) -> TimingRunnerFactory:
    def make() -> tuple[Callable[[], None], list[Storage]]:
        operands, clones = timing_operands(ctx, task, pos, ptrs)
        launch, _ = prepare_instruction(ctx, task, pos, choice, operands)
        return launch_runner(launch), [*clones, launch]  # type: ignore[list-item]

    return make


def _tune(ctx: RunContext, task: CompiledTask, pos: int, ptrs: list[Any], tuning: TuningOptions) -> CandidateTiming:
    """Time every candidate of instruction ``pos`` on its real operands (clones where it writes in place)."""
    operands, clones = timing_operands(ctx, task, pos, ptrs)
    launches = [prepare_instruction(ctx, task, pos, c, operands)[0] for c in range(len(task.candidates))]
    timing = tune_instruction([launch_runner(launch) for launch in launches], task.backend, task.device_index,
                              tuning, instruction=pos, task=ctx.contents.execution.instructions[pos].task_idx,
                              stream=ctx.streams.get(task.meta.device))
    del clones  # kept alive until every candidate was timed on them
    return timing


def _call_hooks(ctx: RunContext, hooks: Sequence[ModelExecutionHook], pos: int, ins: Any, ptr: list[Any]) -> None:
    ex = ctx.contents.execution
    devices = ctx.devices

    def tensor(t: int) -> Tensor:
        kind = ex.tensor_device[t]
        sig = ex.tensor_signatures[t]
        backend, index = devices.backends[kind], devices.index[kind]
        host_wait(backend, index, ctx.streams.get(kind))
        return view_tensor(backend, Device(kind, index), ptr[t], sig.dtype, ctx.plan.shapes[t], ctx.plan.nbytes[t],
                           ctx.workspaces, devices.registry)

    ins_tensors = [tensor(t) for t in ins.inputs]
    out_tensors = [tensor(t) for t in ins.outputs]
    for hook in hooks:
        hook(pos, ins_tensors, out_tensors)
