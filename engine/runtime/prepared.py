"""The fast path: a key's launches with every argument bound, for one thread's workspaces.

Preparing resolves each tensor's address once (weights and workspace offsets are fixed), binds
each kernel's arguments through ``Kernel.prepare`` and fuses runs of launches on backends that can
run them in one native call. A run then only patches the graph inputs' and the fresh outputs'
addresses into the argument arrays that mention them, and makes the calls.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from engine.backend import BackendBase
from engine.bundle.contents import BundleContents
from engine.errors import KernelError
from engine.plugins import Registry
from engine.runtime.plan import INPUT, OUTPUT, KeyPlan
from engine.runtime.tasks import CompiledTask, CopyLaunch
from engine.storage import Storage
from engine.tensor import Tensor, tensor_from_numpy

__all__ = ["PreparedRun", "OutputWrapper", "resolve_static_addresses", "prepare_instruction"]


def resolve_static_addresses(plan: KeyPlan, weights: Sequence[Tensor], workspaces: dict[str, Storage]) -> list[int]:
    """Addresses of weights and workspace tensors; 0 for inputs/outputs (patched per run).

    Vectorised over the plan's layout: a new key or thread resolves a 1,000-tensor graph without a
    Python step per tensor.
    """
    layout = plan.layout
    addrs = np.zeros(len(layout.where), np.uint64)
    for kind, tensors in layout.workspace_tensors.items():
        addrs[tensors] = plan.tensor_offsets[tensors].astype(np.uint64) + np.uint64(workspaces[kind].addr)
    if len(layout.weight_tensors):
        addrs[layout.weight_tensors] = np.array([w.addr for w in weights], np.uint64)[layout.weight_numbers]
    return addrs.tolist()


def prepare_instruction(contents: BundleContents, plan: KeyPlan, task: CompiledTask, pos: int, choice: int,
                        addrs: list[int], workspaces: dict[str, Storage], streams: dict[str, object],
                        backends: dict[str, BackendBase], device_index: dict[str, int]) -> tuple[Any, BackendBase | None]:
    """Bind instruction ``pos`` (candidate ``choice``) to ``addrs``; returns the launch and its backend
    (``None`` for the core's copy tasks, which cannot be fused)."""
    ex = contents.execution
    ins = ex.instructions[pos]
    if task.is_copy:
        src_kind, dst_kind = ex.tensor_device[ins.inputs[0]], ex.tensor_device[ins.outputs[0]]
        launch = CopyLaunch(task.name, backends[src_kind], backends[dst_kind], addrs[0], addrs[1],
                            plan.nbytes[ins.inputs[0]], streams.get(src_kind), streams.get(dst_kind),
                            device_index[src_kind])
        return launch, None
    nbytes = plan.scratch_nbytes[pos]
    kind = plan.layout.scratch_kind[pos]
    ws = workspaces[kind].addr + int(plan.scratch_offsets[pos]) if nbytes and kind is not None else 0
    launch = task.candidates[choice].prepare(addrs, plan.kernel_symbols[pos], ws, streams.get(task.meta.device))
    return launch, task.backend


class PreparedRun:
    """One key, one thread: bound launches plus the patch lists for inputs and outputs."""

    __slots__ = ("plan", "calls", "launch_of_call", "input_patches", "slot_patches", "slot_alloc", "wrap_outputs",
                 "_keep")

    def __init__(self, contents: BundleContents, plan: KeyPlan, tasks: Sequence[CompiledTask], choices: Sequence[int],
                 weights: Sequence[Tensor], workspaces: dict[str, Storage], streams: dict[str, object],
                 backends: dict[str, BackendBase], device_index: dict[str, int], registry: Registry):
        ex = contents.execution
        static = resolve_static_addresses(plan, weights, workspaces)
        layout_where, layout_index = plan.layout.where, plan.layout.index
        input_patches: list[list[tuple[Callable[[int, int], None], int]]] = [[] for _ in ex.inputs_index]
        slot_patches: list[list[tuple[Callable[[int, int], None], int]]] = [[] for _ in plan.output_slots]
        launches = []
        groups: list[tuple[BackendBase | None, list[Any]]] = []
        for pos, ins in enumerate(ex.instructions):
            task = tasks[ins.task_idx]
            tensors = (*ins.inputs, *ins.outputs)
            launch, backend = prepare_instruction(contents, plan, task, pos, choices[ins.task_idx],
                                                  [static[t] for t in tensors], workspaces, streams, backends,
                                                  device_index)
            for a, t in enumerate(tensors):
                where, index = layout_where[t], layout_index[t]
                if where == INPUT:
                    input_patches[index].append((launch.set_tensor, a))
                elif where == OUTPUT:
                    slot_patches[index].append((launch.set_tensor, a))
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
        self.slot_alloc = tuple(backends[s.kind].prepare_allocation(s.nbytes, device_index[s.kind])
                                for s in plan.output_slots)
        self.wrap_outputs = OutputWrapper(contents, plan, backends, device_index, registry).wrap
        self._keep = keep

    def run(self, input_addrs: Sequence[int], inputs: Sequence[Any],
            out_storages: Sequence[Storage] | None = None) -> list[Tensor]:
        # patch() and launch() inlined: this is the per-run path (issue 2 budget: 10 µs per run).
        for patches, addr in zip(self.input_patches, input_addrs):
            for set_tensor, a in patches:
                set_tensor(a, addr)
        if out_storages is None:
            out_storages = [allocate() for allocate in self.slot_alloc]
        for patches, storage in zip(self.slot_patches, out_storages):
            addr = storage.addr
            for set_tensor, a in patches:
                set_tensor(a, addr)
        for call in self.calls:
            code = call()
            if code:
                self._fail(call, code)
        return self.wrap_outputs(input_addrs, inputs, out_storages)

    def patch(self, input_addrs: Sequence[int], out_storages: Sequence[Storage]) -> None:
        """Point every launch at these inputs and outputs (a captured graph does it once)."""
        for patches, addr in zip(self.input_patches, input_addrs):
            for set_tensor, a in patches:
                set_tensor(a, addr)
        for patches, storage in zip(self.slot_patches, out_storages):
            for set_tensor, a in patches:
                set_tensor(a, storage.addr)

    def launch(self) -> None:
        """Make every call with the addresses last patched; ``KernelError`` on a failing kernel."""
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


class OutputWrapper:
    """Turns a run's buffers into the graph's output tensors, the same way on both paths."""

    __slots__ = ("outputs", "output_meta", "copies", "registry")

    def __init__(self, contents: BundleContents, plan: KeyPlan, backends: dict[str, BackendBase],
                 device_index: dict[str, int], registry: Registry):
        ex = contents.execution
        self.registry = registry
        self.outputs = plan.outputs
        self.output_meta = tuple((sig.dtype, plan.shapes[t]) for sig, t in zip(contents.meta.outputs, ex.outputs_index))
        # Inputs returned as outputs without share_map are copied into their fresh output buffer.
        self.copies = tuple(
            (k, backends[plan.output_slots[ref].kind], plan.nbytes[ex.outputs_index[k]], ex.outputs_index[k],
             device_index[plan.output_slots[ref].kind])
            for k, (what, ref) in enumerate(plan.outputs) if what == "copy")

    def wrap(self, input_addrs: Sequence[int], inputs: Sequence[Any], out_storages: Sequence[Storage]) -> list[Tensor]:
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
        for k, backend, nbytes, src, index in self.copies:
            if nbytes:
                backend.copy_device(result[k].addr, input_addrs[src], nbytes, backend.current_stream(index))
        return result
