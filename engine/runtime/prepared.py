"""The fast path: a key's launches with every argument bound, for one thread's workspaces.

Preparing resolves each tensor's address once (weights and workspace offsets are fixed), binds
each kernel's arguments through ``Kernel.prepare`` and fuses runs of launches on backends that can
run them in one native call. A run then only patches the graph inputs' and the fresh outputs'
addresses into the argument arrays that mention them, and makes the calls.

A fresh output that cannot be allocated is an ``OutOfMemoryError`` naming the output and the key
(``output_purpose``); the ``try`` around the allocations costs nothing when they succeed.

Where every launch has a native form (``native_launch``) and every output is a plain fresh buffer,
the run is also compiled into a ``KeyRun`` (``engine.runtime.native``), over the same argument
arrays: ``run`` and ``launch`` then delegate to it, and the lane runs numpy inputs through it
without entering Python at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from engine.backend import BackendBase, LaunchDims
from engine.errors import KernelError, OutOfMemoryError
from engine.expr import ExprError
from engine.runtime.native import MAX_COUNT, external_storage_factory, key_run
from engine.runtime.context import RunContext
from engine.runtime.plan import INPUT, OUTPUT, KeyPlan, device_text, key_text
from engine.runtime.tasks import CompiledTask, CopyLaunch
from engine.storage import Storage, close_all
from engine.tensor import Tensor, tensor_from_numpy

if TYPE_CHECKING:
    from engine.bundle.contents import BundleContents

__all__ = ["PreparedRun", "OutputWrapper", "resolve_static_pointers", "prepare_instruction", "launch_dims",
           "output_purpose", "input_text"]


def input_text(names: Sequence[str], i: int) -> str:
    """Graph input ``i`` in messages: ``"input 0 ('x')"`` (``"input 0"`` when the bundle names none)."""
    return f"input {i} ({names[i]!r})" if names else f"input {i}"


def output_purpose(contents: "BundleContents", plan: KeyPlan, slot: int) -> str:
    """What output buffer ``slot`` is for, in messages: ``"output 0 ('probs') at batch=8"`` (every
    graph output it holds, named where the bundle names its outputs)."""
    names = contents.meta.output_names
    held = [k for k, (what, ref) in enumerate(plan.outputs) if what != "input" and ref == slot]
    listed = ", ".join(f"{k} ({names[k]!r})" if names else str(k) for k in held)
    return f"output{'s' if len(held) > 1 else ''} {listed} at {key_text(plan.env)}"


def resolve_static_pointers(ctx: RunContext, weights: Sequence[Tensor]) -> list[Any]:
    """Pointers of weights and workspace tensors; null (0 or None) for inputs/outputs, patched per run.

    Vectorised over the plan's layout when every pointer is an integer address (CPU, CUDA, HIP):
    a new key or thread resolves a 1,000-tensor graph without a Python step per tensor. Devices
    whose pointers are handles, or whose workspace is split in segments, take one step per tensor.
    """
    plan = ctx.plan
    layout = plan.layout
    workspaces = ctx.workspaces
    weight_ptrs = [w.ptr for w in weights]
    # Flat only when every kind is known to use integer pointers (a kind with neither workspace nor
    # weights shows none: its inputs and outputs then get None, not the integer 0).
    flat = (workspaces.keys() >= ctx.devices.backends.keys()
            and all(isinstance(ws.base, int) and not ws.segmented for ws in workspaces.values())
            and all(isinstance(p, int) for p in weight_ptrs))
    if flat:
        ptrs = np.zeros(len(layout.where), np.uint64)
        for kind, tensors in layout.workspace_tensors.items():
            ptrs[tensors] = plan.tensor_offsets[tensors].astype(np.uint64) + np.uint64(workspaces[kind].base)
        if len(layout.weight_tensors):
            ptrs[layout.weight_tensors] = np.array(weight_ptrs, np.uint64)[layout.weight_numbers]
        return ptrs.tolist()
    out: list[Any] = [None] * len(layout.where)  # inputs and outputs: set before any call (set_tensor)
    offsets = plan.tensor_offsets
    for kind, tensors in layout.workspace_tensors.items():
        ptr_at = workspaces[kind].ptr_at
        for t in tensors.tolist():
            out[t] = ptr_at(int(offsets[t]))
    for t, j in zip(layout.weight_tensors.tolist(), layout.weight_numbers.tolist()):
        out[t] = weight_ptrs[j]
    return out


def launch_dims(task: CompiledTask, choice: int, symbol_values: Sequence[int]) -> LaunchDims | None:
    """The candidate's launch geometry at these symbol values (``None`` when it declares none)."""
    spec = task.candidates[choice].spec
    if spec.launch is None:
        return None
    try:
        return spec.launch.evaluate(spec.symbols, symbol_values)
    except ExprError as exc:
        values = ", ".join(f"{s}={v}" for s, v in zip(spec.symbols, symbol_values))
        raise KernelError(f"{spec.describe()}: launch dimensions at {values}: {exc}") from None


def prepare_instruction(ctx: RunContext, task: CompiledTask, pos: int, choice: int,
                        ptrs: list[Any]) -> tuple[Any, BackendBase | None]:
    """Bind instruction ``pos`` (candidate ``choice``) to ``ptrs``; returns the launch and its backend
    (``None`` for the core's copy tasks, which cannot be fused)."""
    plan = ctx.plan
    ex = ctx.contents.execution
    ins = ex.instructions[pos]
    if task.is_copy:
        src_kind, dst_kind = ex.tensor_device[ins.inputs[0]], ex.tensor_device[ins.outputs[0]]
        index = ctx.devices.index
        copy = CopyLaunch(task.name, ctx.backend(src_kind), ctx.backend(dst_kind), ptrs[0], ptrs[1],
                          plan.nbytes[ins.inputs[0]], ctx.streams.get(src_kind), ctx.streams.get(dst_kind),
                          index[src_kind])
        return copy, None
    nbytes = plan.scratch_nbytes[pos]
    kind = plan.layout.scratch_kind[pos]
    scratch = ctx.workspaces[kind].ptr_at(int(plan.scratch_offsets[pos])) if nbytes and kind is not None else None
    symbols = plan.kernel_symbols[pos]
    launch = task.candidates[choice].prepare(ptrs, symbols, scratch, ctx.streams.get(task.meta.device),
                                             launch_dims(task, choice, symbols))
    return launch, task.backend


class PreparedRun:
    """One key, one thread: bound launches plus the patch lists for inputs and outputs."""

    __slots__ = ("plan", "calls", "launch_of_call", "input_patches", "slot_patches", "slot_alloc", "wrap_outputs",
                 "native", "_contents", "_devices", "_keep")

    def __init__(self, ctx: RunContext, tasks: Sequence[CompiledTask], choices: Sequence[int],
                 weights: Sequence[Tensor], *, native: bool = False):
        plan = ctx.plan
        ex = ctx.contents.execution
        static = resolve_static_pointers(ctx, weights)
        layout_where, layout_index = plan.layout.where, plan.layout.index
        input_patches: list[list[tuple[Callable[[int, int], None], int]]] = [[] for _ in ex.inputs_index]
        slot_patches: list[list[tuple[Callable[[int, int], None], int]]] = [[] for _ in plan.output_slots]
        # The same patches as (launch position, argument), for the native form of this run.
        input_args: list[list[tuple[int, int]]] = [[] for _ in ex.inputs_index]
        slot_args: list[list[tuple[int, int]]] = [[] for _ in plan.output_slots]
        launches = []
        groups: list[tuple[BackendBase | None, list[Any]]] = []
        for pos, ins in enumerate(ex.instructions):
            task = tasks[ins.task_idx]
            tensors = (*ins.inputs, *ins.outputs)
            launch, backend = prepare_instruction(ctx, task, pos, choices[ins.task_idx], [static[t] for t in tensors])
            for a, t in enumerate(tensors):
                where, index = layout_where[t], layout_index[t]
                if where == INPUT:
                    input_patches[index].append((launch.set_tensor, a))
                    input_args[index].append((pos, a))
                elif where == OUTPUT:
                    slot_patches[index].append((launch.set_tensor, a))
                    slot_args[index].append((pos, a))
            launches.append(launch)
            if groups and backend is not None and groups[-1][0] is backend:
                groups[-1][1].append(launch)
            else:
                groups.append((backend, [launch]))

        calls: list[Callable[[], int]] = []
        launch_of_call: dict[Callable[[], int], Any] = {}
        keep: list[Any] = list(launches)
        for backend, members in groups:
            fused = backend.fuse(members) if backend is not None and len(members) > 1 else None
            if fused is not None:
                keep.append(fused)
                calls.append(fused.call)
                launch_of_call[fused.call] = (fused, members)
            else:
                for launch in members:
                    calls.append(launch.call)
                    launch_of_call[launch.call] = launch
        self.plan = plan
        self.calls = tuple(calls)
        self.launch_of_call = launch_of_call
        self.input_patches = tuple(tuple(p) for p in input_patches)
        self.slot_patches = tuple(tuple(p) for p in slot_patches)
        backends, indices = ctx.devices.backends, ctx.devices.index
        self.slot_alloc = tuple(backends[s.kind].prepare_allocation(s.nbytes, indices[s.kind],
                                                                     ctx.streams.get(s.kind))
                                for s in plan.output_slots)
        self.wrap_outputs = OutputWrapper(ctx).wrap
        self._contents = ctx.contents
        self._devices = ctx.devices.devices
        self._keep = keep
        #: The compiled form of this run (``engine.runtime.native``), or None: the Python path below.
        self.native = _native_run(ctx, launches, input_args, slot_args, self.slot_alloc) if native else None

    def run(self, input_ptrs: Sequence[Any], inputs: Sequence[Any],
            out_storages: Sequence[Storage] | None = None) -> list[Tensor]:
        native = self.native
        if native is not None:
            return native.run_bound(input_ptrs, out_storages, self._raise_out_of_memory)
        # patch() and launch() inlined: this is the per-run path (issue 2 budget: 10 µs per run).
        for patches, ptr in zip(self.input_patches, input_ptrs):
            for set_tensor, a in patches:
                set_tensor(a, ptr)
        if out_storages is None:
            out_storages = []  # a loop, not a comprehension: as fast, and the failing slot is known
            try:
                for allocate in self.slot_alloc:
                    out_storages.append(allocate())
            except MemoryError as exc:
                raise self._out_of_memory(exc, out_storages) from exc
        for patches, storage in zip(self.slot_patches, out_storages):
            ptr = storage.ptr
            for set_tensor, a in patches:
                set_tensor(a, ptr)
        for call in self.calls:
            code = call()
            if code:
                self._fail(call, code)
        return self.wrap_outputs(input_ptrs, inputs, out_storages)

    def _out_of_memory(self, exc: MemoryError, made: list[Storage]) -> OutOfMemoryError:
        """The error for output slot ``len(made)`` failing to allocate (those before it are released)."""
        slot = len(made)
        close_all(made)
        spec = self.plan.output_slots[slot]
        return OutOfMemoryError.from_error(exc, spec.nbytes, device_text(self._devices[spec.kind]),
                                           output_purpose(self._contents, self.plan, slot))

    def _raise_out_of_memory(self, exc: MemoryError, slot: int) -> None:
        """The native form's report of output ``slot`` failing to allocate."""
        spec = self.plan.output_slots[slot]
        raise OutOfMemoryError.from_error(exc, spec.nbytes, device_text(self._devices[spec.kind]),
                                          output_purpose(self._contents, self.plan, slot)) from exc

    def patch(self, input_ptrs: Sequence[Any], out_storages: Sequence[Storage]) -> None:
        """Point every launch at these inputs and outputs (a captured graph does it once)."""
        for patches, ptr in zip(self.input_patches, input_ptrs):
            for set_tensor, a in patches:
                set_tensor(a, ptr)
        for patches, storage in zip(self.slot_patches, out_storages):
            for set_tensor, a in patches:
                set_tensor(a, storage.ptr)

    def launch(self) -> None:
        """Make every call with the addresses last patched; ``KernelError`` on a failing kernel."""
        if self.native is not None:
            self.native.launch()
            return
        for call in self.calls:
            code = call()
            if code:
                self._fail(call, code)

    def _fail(self, call: Callable[[], int], code: int) -> None:
        target = self.launch_of_call[call]
        if isinstance(target, tuple):
            fused, members = target
            target = members[code - 1]
            code = fused.code()
        target.fail(code)
        raise KernelError(f"launch failed with code {code}")  # fail() must raise; this is a safety net


def _native_run(ctx: RunContext, launches: Sequence[Any], input_args: Sequence[Sequence[tuple[int, int]]],
                slot_args: Sequence[Sequence[tuple[int, int]]], slot_alloc: Sequence[Callable[[], Storage]]
                ) -> Any | None:
    """The ``KeyRun`` of this prepared run, or None where a piece has no native form: a launch
    without ``native_launch``, an output that is an input or a copy of one, or slots shared by
    several outputs (those keep the Python path, chosen here once per prepared plan)."""
    plan = ctx.plan
    meta = ctx.contents.meta
    refs = [ref for what, ref in plan.outputs if what == "slot"]
    if (len(refs) != len(plan.outputs) or sorted(refs) != list(range(len(plan.output_slots)))
            or any(s.kind != "cpu" for s in plan.output_slots)):
        return None
    if max(len(meta.inputs), len(meta.outputs), len(meta.symbols),
           *(len(sig.shape) for sig in (*meta.inputs, *meta.outputs))) > MAX_COUNT:
        return None
    ex = ctx.contents.execution
    slots: list[tuple[Any, ...]] = [()] * len(plan.output_slots)
    external = external_storage_factory(ctx.devices.devices["cpu"])
    for k, ref in enumerate(refs):
        dtype = meta.outputs[k].dtype
        slots[ref] = (slot_alloc[ref], external, dtype, tuple(plan.shapes[ex.outputs_index[k]]), dtype.numpy)
    return key_run(launches, input_args, slot_args, slots, refs, Tensor, ctx.devices.registry)


class OutputWrapper:
    """Turns a run's buffers into the graph's output tensors, the same way on both paths."""

    __slots__ = ("outputs", "output_meta", "copies", "registry")

    def __init__(self, ctx: RunContext):
        plan = ctx.plan
        ex = ctx.contents.execution
        self.registry = ctx.devices.registry
        self.outputs = plan.outputs
        self.output_meta = tuple((sig.dtype, plan.shapes[t])
                                 for sig, t in zip(ctx.contents.meta.outputs, ex.outputs_index))
        # Inputs returned as outputs without share_map are copied into their fresh output buffer.
        self.copies = tuple(
            (k, ctx.backend(plan.output_slots[ref].kind), plan.nbytes[ex.outputs_index[k]], ex.outputs_index[k],
             ctx.streams.get(plan.output_slots[ref].kind))
            for k, (what, ref) in enumerate(plan.outputs) if what == "copy")

    def wrap(self, input_ptrs: Sequence[Any], inputs: Sequence[Any], out_storages: Sequence[Storage]) -> list[Tensor]:
        result = []
        for (what, ref), (dtype, shape) in zip(self.outputs, self.output_meta):
            if what == "input":
                x = inputs[ref]
                if type(x) is Tensor:
                    result.append(Tensor(x.storage, dtype, shape, x.offset, registry=x.registry))
                else:
                    result.append(tensor_from_numpy(x))
            else:
                result.append(Tensor(out_storages[ref], dtype, shape, 0, registry=self.registry))
        for k, backend, nbytes, src, stream in self.copies:
            if nbytes:
                backend.copy_device(result[k].ptr, input_ptrs[src], nbytes, stream)
        return result
