"""What a run at one dispatch key needs, before any device is touched.

For a key (the symbol values) this evaluates every tensor's shape and size, decides where each
tensor lives (a graph input's buffer, a weight, a fresh per-run output buffer, or an offset in its
kind's workspace slot) and plans the workspace offsets. A ``KeyPlan`` is immutable and shared by
every thread; per-thread workspaces and prepared launches are built from it (``prepared``).
"""

from __future__ import annotations

from typing import Mapping

import attrs

from engine.bundle.contents import BundleContents
from engine.bundle.validate import ROLE_INPUT, ROLE_WEIGHT
from engine.errors import InputError
from engine.runtime.memory import Block, MemoryPlan, lower_bound, plan_offsets

__all__ = ["Placement", "KeyPlan", "OutputSlot", "build_key_plan", "INPUT", "WEIGHT", "OUTPUT", "WORKSPACE"]

INPUT, WEIGHT, OUTPUT, WORKSPACE = 0, 1, 2, 3

_MAX_BYTES = 2**62


@attrs.frozen
class Placement:
    """Where a tensor's bytes are: ``where`` is INPUT/WEIGHT/OUTPUT (``index`` = which one) or
    WORKSPACE (``index`` = byte offset in the workspace of kind ``kind``)."""

    where: int
    index: int
    kind: str


@attrs.frozen
class OutputSlot:
    """One fresh buffer allocated per run (several graph outputs may share it in place)."""

    kind: str
    nbytes: int


@attrs.frozen
class KeyPlan:
    key: tuple[int, ...]
    env: Mapping[str, int]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    placements: tuple[Placement, ...]
    output_slots: tuple[OutputSlot, ...]
    #: Per graph output: ("slot", output slot index) or ("input", graph input index) for share_map,
    #: or ("copy", output slot index) when an input is returned as an output without share_map.
    outputs: tuple[tuple[str, int], ...]
    #: Per instruction: (kind, workspace offset, nbytes) of the kernel's scratch, or None.
    scratch: tuple[tuple[str, int, int] | None, ...]
    #: Per instruction: values of the kernel's symbols, in the kernel's order.
    kernel_symbols: tuple[tuple[int, ...], ...]
    workspace_bytes: Mapping[str, int]
    lower_bound_bytes: Mapping[str, int]
    no_reuse_bytes: Mapping[str, int]


def build_key_plan(contents: BundleContents, key: tuple[int, ...], alignment: Mapping[str, int]) -> KeyPlan:
    meta, ex, an = contents.meta, contents.execution, contents.analysis
    env = dict(zip(meta.symbols, key))
    shapes = []
    nbytes = []
    for t, sig in enumerate(ex.tensor_signatures):
        shape = tuple(e.evaluate(env) for e in sig.shape)
        size = sig.dtype.nbytes
        for d in shape:
            if d < 0:
                raise InputError(f"tensor {t} would have a negative dimension {shape} at {env}")
            size *= d
            if size > _MAX_BYTES:
                raise InputError(f"tensor {t} of shape {shape} at {env} is too large")
        shapes.append(shape)
        nbytes.append(size)

    n_in = len(ex.inputs_index)
    placements: list[Placement | None] = [None] * len(nbytes)
    for i in range(n_in):
        placements[i] = Placement(INPUT, i, ex.tensor_device[i])
    for j, t in enumerate(ex.weights_index):
        placements[t] = Placement(WEIGHT, j, ex.tensor_device[t])

    # Group tensors by the storage they alias; a group holding a graph output becomes an output slot.
    members: dict[int, list[int]] = {}
    for t, root in enumerate(an.alias_root):
        members.setdefault(root, []).append(t)
    for root, group in members.items():  # kernels writing in place into a graph input use its buffer
        if an.roles[root] == ROLE_INPUT:
            for m in group:
                placements[m] = placements[root]

    output_slots: list[OutputSlot] = []
    slot_of_root: dict[int, int] = {}
    outputs: list[tuple[str, int]] = []
    for k, t in enumerate(ex.outputs_index):
        root = an.alias_root[t]
        if an.roles[root] == ROLE_INPUT:
            if t != root or meta.share_map.get(k) == root:
                outputs.append(("input", root))
            else:  # an input returned unchanged: outputs are fresh storage, so copy it
                output_slots.append(OutputSlot(ex.tensor_device[t], nbytes[t]))
                outputs.append(("copy", len(output_slots) - 1))
            continue
        if root not in slot_of_root:
            size = max(nbytes[m] for m in members[root])
            output_slots.append(OutputSlot(ex.tensor_device[root], size))
            slot_of_root[root] = len(output_slots) - 1
            for m in members[root]:
                placements[m] = Placement(OUTPUT, slot_of_root[root], ex.tensor_device[root])
        outputs.append(("slot", slot_of_root[root]))

    # Remaining intermediates and kernel scratch are planned per workspace kind.
    blocks: dict[str, list[Block]] = {}
    owners: dict[str, list[object]] = {}
    for root, group in members.items():
        if an.roles[root] in (ROLE_INPUT, ROLE_WEIGHT) or placements[root] is not None:
            continue
        kind = ex.tensor_device[root]
        start = an.producer[root]
        end = max(max(an.last_use[m] for m in group), start)
        blocks.setdefault(kind, []).append(Block(start, end, max(nbytes[m] for m in group)))
        owners.setdefault(kind, []).append(("tensor", root))
    kernel_symbols = []
    for pos, ins in enumerate(ex.instructions):
        kernel = contents.kernels[ins.task_idx]
        kernel_symbols.append(tuple(env[s] for s in kernel.symbols))
        size = kernel.workspace.evaluate(env)
        if size < 0:
            raise InputError(f"kernel {kernel.name!r} workspace {kernel.workspace.source!r} is negative at {env}")
        if size > 0:
            blocks.setdefault(kernel.device, []).append(Block(pos, pos, size))
            owners.setdefault(kernel.device, []).append(("scratch", pos))

    scratch: list[tuple[str, int, int] | None] = [None] * len(ex.instructions)
    workspace_bytes: dict[str, int] = {}
    bounds: dict[str, int] = {}
    no_reuse: dict[str, int] = {}
    for kind, kind_blocks in blocks.items():
        align = alignment.get(kind, 64)
        plan: MemoryPlan = plan_offsets(kind_blocks, align)
        workspace_bytes[kind] = plan.total_bytes
        bounds[kind] = lower_bound(kind_blocks, align)
        no_reuse[kind] = sum(-(-max(b.nbytes, 1) // align) * align for b in kind_blocks)
        for (what, ref), offset, block in zip(owners[kind], plan.offsets, kind_blocks):
            if what == "tensor":
                for m in members[ref]:  # type: ignore[index]
                    placements[m] = Placement(WORKSPACE, offset, kind)
            else:
                scratch[ref] = (kind, offset, block.nbytes)  # type: ignore[index]

    return KeyPlan(
        key=key,
        env=env,
        shapes=tuple(shapes),
        nbytes=tuple(nbytes),
        placements=tuple(_placed(placements)),
        output_slots=tuple(output_slots),
        outputs=tuple(outputs),
        scratch=tuple(scratch),
        kernel_symbols=tuple(kernel_symbols),
        workspace_bytes=workspace_bytes,
        lower_bound_bytes=bounds,
        no_reuse_bytes=no_reuse,
    )


def _placed(placements: list[Placement | None]) -> list[Placement]:
    missing = [t for t, p in enumerate(placements) if p is None]
    if missing:  # every tensor is an input, weight, output or planned; anything else is a planner bug
        raise RuntimeError(f"internal error: the memory plan left tensors {missing} without storage")
    return placements  # type: ignore[return-value]
