"""What a run at one dispatch key needs, before any device is touched.

For a key (the symbol values) a ``KeyPlan`` gives every tensor's shape and size, where each tensor
lives (a graph input's buffer, a weight, a fresh per-run output buffer, or an offset in its kind's
workspace slot), each instruction's kernel scratch and symbol values, and the workspace size per
kind. A ``KeyPlan`` is immutable and shared by every thread; per-thread workspaces and prepared
launches are built from it (``prepared``).

``GraphPlanner`` holds everything about a graph's memory that does not depend on the key, worked
out once: which tensors share storage (in-place writes), which become output buffers, the blocks
of each workspace kind with their live ranges (from ``GraphAnalysis``), the distinct shape and
size expressions (one ``ExprBatch``), and the ``PlanLayout`` (where each tensor lives). Planning a
key then evaluates the expressions at once, computes block sizes, and assigns offsets
(``engine.runtime.memory``): by replaying the plan of a template key (``template_key``) when that
is within ``REPLAY_SLACK_PERCENT`` of the lower bound, else by a fresh best-fit. The offsets come
back as arrays over the layout, not as a Python object per tensor. With the compiled helpers
(``_planner.c``, ``engine/_exprtape.c``) a new key of the 1,000-instruction benchmark transformer
costs about 0.2 ms, the first key of a graph about 0.5 ms (``docs/memory.md`` §7; issue 3).

A key whose workspace plus fresh outputs on one device would exceed that device's ``MemoryLimit``
(``ENGINE_MAX_PLANNED_BYTES``; by default the machine's physical memory for host memory and
``DEVICE_PLANNED_BYTES`` for device memory) is refused by ``plan`` with an ``OutOfMemoryError``
naming the key, the device and the sizes, before anything is allocated for it (issue 12).
"""

from __future__ import annotations

import math
import operator
import os
import threading
from typing import Callable, Collection, Mapping, Sequence

import attrs
import numpy as np

from engine.bundle.contents import BundleContents
from engine.bundle.validate import ROLE_INPUT, ROLE_WEIGHT
from engine.device import Device
from engine.errors import EngineError, InputError, OutOfMemoryError, format_size
from engine.expr import Expr, ExprBatch, ExprError, parse_expr
from engine.runtime.memory import (Interference, ReplayTemplate, SizeError, live_peak, plan_array, segment_offsets,
                                   tie_ranks, total_bytes)

from engine.compiled import HELPERS  # a key's sizes in one compiled call (``_planner.c``) where built

__all__ = ["Placement", "PlanLayout", "KeyPlan", "OutputSlot", "GraphPlanner", "build_key_plan", "INPUT", "WEIGHT",
           "OUTPUT", "WORKSPACE", "REPLAY_SLACK_PERCENT", "template_key", "MemoryLimit", "memory_limits", "key_text",
           "device_text", "MAX_PLANNED_BYTES_ENV", "DEVICE_PLANNED_BYTES"]

INPUT, WEIGHT, OUTPUT, WORKSPACE = 0, 1, 2, 3

_MAX_BYTES = 2**62
#: A replayed plan is kept when its peak is at most this many percent above the key's lower bound;
#: otherwise best-fit plans the key, refining until it is within as much of the bound (or gives up),
#: and the lower of the two peaks wins.
REPLAY_SLACK_PERCENT = 2
_MISSING = object()

#: ``ENGINE_MAX_PLANNED_BYTES``: the most memory one key's plan may need on one device (its workspace
#: plus its fresh output buffers), in bytes. A key over it is refused when it is planned, before
#: anything is allocated, with an ``OutOfMemoryError`` naming the key, the device and the sizes.
MAX_PLANNED_BYTES_ENV = "ENGINE_MAX_PLANNED_BYTES"
#: The limit for devices with their own memory when the environment sets none (256 TiB): more than
#: any device has, so it only stops absurd plans early; the device's allocator refuses the rest.
DEVICE_PLANNED_BYTES = 2**48


@attrs.frozen
class MemoryLimit:
    """The most bytes one key's plan may need on ``device`` (``"cpu:0"``), and why that figure."""

    device: str
    nbytes: int
    source: str


def memory_limits(devices: Mapping[str, Device], host_kinds: Collection[str],
                  env: Mapping[str, str]) -> dict[str, MemoryLimit]:
    """Per kind, the planned-memory limit: ``ENGINE_MAX_PLANNED_BYTES`` when ``env`` sets it, else
    the machine's physical memory for kinds in host memory and ``DEVICE_PLANNED_BYTES`` for others.

    Without such a limit a workspace expression like ``batch * 10**12`` reaches the allocator (or,
    with overcommit, succeeds and fails later); with it the plan is refused first, by name.
    """
    raw = env.get(MAX_PLANNED_BYTES_ENV, "").strip()
    configured = _env_bytes(raw) if raw else None
    physical = physical_memory()
    limits = {}
    for kind, device in devices.items():
        label = device_text(device)
        if configured is not None:
            limits[kind] = MemoryLimit(label, configured, f"set by {MAX_PLANNED_BYTES_ENV}")
        elif kind in host_kinds and physical is not None:
            limits[kind] = MemoryLimit(label, physical, f"the machine's physical memory; {MAX_PLANNED_BYTES_ENV} "
                                                        f"overrides it")
        else:
            limits[kind] = MemoryLimit(label, DEVICE_PLANNED_BYTES, f"the default for device memory; "
                                                                    f"{MAX_PLANNED_BYTES_ENV} overrides it")
    return limits


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or ``None`` where the system does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def _env_bytes(raw: str) -> int:
    """``ENGINE_MAX_PLANNED_BYTES``'s value: ASCII digits, a positive size of at most 2**62 bytes."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19 and 0 < int(raw) <= _MAX_BYTES):
        raise InputError(f"{MAX_PLANNED_BYTES_ENV}={raw!r}: expected a number of bytes, written in ASCII digits, "
                         f"from 1 to 2**62")
    return int(raw)


def device_text(device: Device) -> str:
    """A device for messages, always with its index (``"cpu:0"``), as ``BackendBase.allocate`` writes it."""
    return f"{device.kind}:{device.index}"


def key_text(env: Mapping[str, int]) -> str:
    """A key for messages: ``"batch=8, seq=128"`` (``"the static shapes"`` without symbols)."""
    return ", ".join(f"{name}={value}" for name, value in env.items()) or "the static shapes"


def template_key(key: tuple[int, ...], *, other: bool = False) -> tuple[int, ...]:
    """The key whose plan is replayed for ``key``: every symbol rounded to the nearest power of two
    (``other=True``: to the power of two on the other side of it, the second choice).

    Within such a bucket every size changes by at most 2x per symbol, and the stacking order of
    the template's plan stays good: on the benchmark transformer (sizes linear and quadratic in
    seq) 40 of 40 random keys replayed within 2% of the lower bound this way when it was chosen,
    against 35 with one template per power of 8 and 2 with a single template for all keys. Where
    two sizes cross over inside the bucket (attention scores overtaking the MLP's activations near
    seq = 256 there), the other side's template is tried before best-fit. Templates depend only on
    the key, so a key's plan does not depend on which keys came before it.
    """
    out = []
    for v in key:
        if v <= 2 or v & (v - 1) == 0:
            out.append(v)
            continue
        low = 1 << (v.bit_length() - 1)
        nearest_low = v - low <= 2 * low - v
        out.append(low if nearest_low != other else 2 * low)
    return tuple(out)


#: Where a tensor's bytes are: ``(where, index, kind)`` with ``where`` INPUT/WEIGHT/OUTPUT (``index`` =
#: which one) or WORKSPACE (``index`` = byte offset in the workspace of kind ``kind``).
Placement = tuple[int, int, str]


@attrs.frozen
class OutputSlot:
    """One fresh buffer allocated per run (several graph outputs may share it in place)."""

    kind: str
    nbytes: int


@attrs.frozen
class PlanLayout:
    """Where each tensor and each kernel's scratch lives, the same at every key of a graph: a key plan
    adds only byte offsets (``KeyPlan.tensor_offsets``, ``KeyPlan.scratch_offsets``).

    Keeping the per-tensor facts here, once per graph, is what lets a new key be planned without
    building a Python object per tensor (issue 3: 1 ms per key for 1,000 instructions); consumers
    compute addresses with numpy (``prepared.resolve_static_addresses``).
    """

    #: Per tensor: INPUT, WEIGHT, OUTPUT or WORKSPACE.
    where: tuple[int, ...]
    #: Per tensor: which input, weight or output slot (-1 for WORKSPACE tensors).
    index: tuple[int, ...]
    #: Per tensor: the device kind of its storage.
    kind: tuple[str, ...]
    #: Per instruction: the kind whose workspace holds the kernel's scratch (None: it never has any).
    scratch_kind: tuple[str | None, ...]
    # Derived from the above (so left out of comparisons), as arrays for vectorised addressing.
    #: Per workspace kind: the tensors in its workspace (int64 array).
    workspace_tensors: Mapping[str, np.ndarray] = attrs.field(eq=False)
    #: The tensors that are weights, and which weight each is (int64 arrays).
    weight_tensors: np.ndarray = attrs.field(eq=False)
    weight_numbers: np.ndarray = attrs.field(eq=False)


def _array_eq(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def _frozen_array(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False  # a plan is shared by every thread
    return values


@attrs.frozen
class KeyPlan:
    key: tuple[int, ...]
    env: Mapping[str, int]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    layout: PlanLayout
    #: Per tensor: byte offset in its kind's workspace (WORKSPACE tensors; 0 for the others). int64, read-only.
    tensor_offsets: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=_array_eq), hash=False)
    output_slots: tuple[OutputSlot, ...]
    #: Per graph output: ("slot", output slot index) or ("input", graph input index) for share_map,
    #: or ("copy", output slot index) when an input is returned as an output without share_map.
    outputs: tuple[tuple[str, int], ...]
    #: Per instruction: the byte offset of the kernel's scratch in the workspace of
    #: ``layout.scratch_kind[pos]``, and its size (0: no scratch at this key, the kernel gets NULL).
    scratch_offsets: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=_array_eq), hash=False)
    scratch_nbytes: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=_array_eq), hash=False)
    #: Per instruction: values of the kernel's symbols, in the kernel's order.
    kernel_symbols: tuple[tuple[int, ...], ...]
    workspace_bytes: Mapping[str, int]
    lower_bound_bytes: Mapping[str, int]
    no_reuse_bytes: Mapping[str, int]
    #: Per kind, how its offsets were found: "replay" (of the template key's plan), "template" (the key
    #: is its own template key: that plan) or "best-fit".
    planned_by: Mapping[str, str] = attrs.field(factory=dict)
    #: Per kind whose workspace exceeds the device's largest allocation: the segment size (each
    #: segment is one allocation, and no block crosses a segment boundary).
    segment_bytes: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Per tensor, where its bytes are (for inspection; runs use ``layout`` and the offsets)."""
        layout = self.layout
        return tuple((w, off if w == WORKSPACE else i, k)
                     for w, i, k, off in zip(layout.where, layout.index, layout.kind, self.tensor_offsets.tolist()))

    @property
    def scratch(self) -> tuple[tuple[str, int, int] | None, ...]:
        """Per instruction, ``(kind, offset, nbytes)`` of the kernel's scratch, or None (for inspection)."""
        return tuple(None if n == 0 else (k, off, n) for k, off, n in  # type: ignore[misc]  # kind set where n > 0
                     zip(self.layout.scratch_kind, self.scratch_offsets.tolist(), self.scratch_nbytes.tolist()))


def build_key_plan(contents: BundleContents, key: tuple[int, ...], alignment: Mapping[str, int]) -> KeyPlan:
    """One plan, without keeping the graph's planner (``CompiledGraph`` keeps one per graph)."""
    return GraphPlanner(contents, alignment).plan(key)


def _picker(indices: Sequence[int]) -> Callable[[Sequence[object]], tuple]:
    """``values -> tuple(values[i] for i in indices)`` at C speed."""
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    if len(indices) == 1:
        (i,) = indices
        return lambda values: (values[i],)
    return lambda values: ()


class _KindBlocks:
    """The workspace blocks of one kind: intermediate tensor groups first, then kernel scratch."""

    __slots__ = ("kind", "alignment", "starts", "ends", "starts_list", "ends_list", "size_src", "n_tensors",
                 "scratch_pos", "templates", "graph", "ties", "tensors", "tensor_blocks")

    def __init__(self, kind: str, alignment: int):
        self.kind = kind
        self.alignment = alignment
        self.starts_list: list[int] = []
        self.ends_list: list[int] = []
        self.size_src: list[int] | np.ndarray = []  # index into the key's size vector
        self.n_tensors = 0
        self.scratch_pos: list[int] | np.ndarray = []
        #: Templates by template key (``template_key``); None where that key cannot be planned.
        self.templates: dict[tuple[int, ...], _Template | None] = {}

    def freeze(self, tensors: Sequence[int], tensor_blocks: Sequence[int]) -> None:
        """Fix the blocks; ``tensors`` (in this kind's workspace) live in blocks ``tensor_blocks``."""
        self.tensors = np.array(tensors, np.int64)
        self.tensor_blocks = np.array(tensor_blocks, np.int64)
        self.scratch_pos = np.array(self.scratch_pos, np.int64)
        self.starts = np.array(self.starts_list, np.int64)
        self.ends = np.array(self.ends_list, np.int64)
        self.size_src = np.array(self.size_src, np.int64)
        # Key-independent structure for ``memory.fit``: which blocks interfere, and the order among
        # blocks that share a size expression (equal at every key).
        self.graph = Interference(self.starts, self.ends)
        self.ties = tie_ranks(self.starts, self.ends, self.size_src)


class _Template:
    """A template key's plan of one kind (sizes with empty blocks as one unit), and that plan
    recorded for replay, made on the first key that replays it."""

    __slots__ = ("offsets", "sizes", "replayer")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray):
        self.offsets = offsets
        self.sizes = sizes
        self.replayer: ReplayTemplate | None = None


class GraphPlanner:
    """A graph's key-independent memory facts, and ``plan(key)`` for any key (thread-safe)."""

    def __init__(self, contents: BundleContents, alignment: Mapping[str, int],
                 segment_bytes: Mapping[str, int] | None = None, limits: Mapping[str, MemoryLimit] | None = None):
        meta, ex, an = contents.meta, contents.execution, contents.analysis
        #: Per kind with an allocation cap (``Backend.max_allocation``): no block may cross a
        #: multiple of it, so that the workspace can be allocated one segment at a time.
        self.segment_bytes = dict(segment_bytes or {})
        #: Per kind, the most its workspace and outputs may need at one key (``memory_limits``).
        self.limits = dict(limits or {})
        self.symbols = meta.symbols
        n = len(ex.tensor_signatures)

        # Distinct expressions, shapes (tuples of expression ids) and sizes (shape, item size).
        exprs: list[Expr] = []
        expr_id: dict[str, int] = {}

        def eid(e: Expr) -> int:
            k = expr_id.get(e.source)
            if k is None:
                k = expr_id[e.source] = len(exprs)
                exprs.append(e)
            return k

        shape_id: dict[tuple[int, ...], int] = {}
        size_id: dict[tuple[int, int], int] = {}
        self.shape_exprs: list[tuple[int, ...]] = []
        self.shape_first: list[int] = []       # a tensor of each distinct shape, for error messages
        self.size_keys: list[tuple[int, int]] = []
        self.tensor_shape: list[int] = []
        self.tensor_size: list[int] = []
        for t, sig in enumerate(ex.tensor_signatures):
            ids = tuple(eid(e) for e in sig.shape)
            s = shape_id.get(ids)
            if s is None:
                s = shape_id[ids] = len(self.shape_exprs)
                self.shape_exprs.append(ids)
                self.shape_first.append(t)
            z = size_id.get((s, sig.dtype.nbytes))
            if z is None:
                z = size_id[(s, sig.dtype.nbytes)] = len(self.size_keys)
                self.size_keys.append((s, sig.dtype.nbytes))
            self.tensor_shape.append(s)
            self.tensor_size.append(z)
        kernels = contents.kernels
        self.kernel_names = tuple(k.name for k in kernels)
        self.kernel_ws_source = tuple(k.workspace.source for k in kernels)
        self.kernel_ws = np.array([eid(k.workspace) for k in kernels], np.int64)
        self.instr_task = [ins.task_idx for ins in ex.instructions]
        # Kernel symbol values per instruction: one tuple per distinct list of symbol positions.
        sym_lists: dict[tuple[int, ...], int] = {}
        task_syms = [sym_lists.setdefault(tuple(meta.symbols.index(s) for s in k.symbols), len(sym_lists))
                     for k in kernels]
        self.sym_lists = list(sym_lists)
        self.instr_syms = [task_syms[t] for t in self.instr_task]

        # Every expression, then a constant 1, evaluated at once per key (shared subexpressions once,
        # constants read from the batch's seed). The sizes are products over a matrix of expression
        # ids padded with the id of that constant 1.
        self.exprs = exprs
        self.batch = ExprBatch([*exprs, parse_expr(1)], self.symbols)
        one = len(exprs)
        rank = max((len(ids) for ids in self.shape_exprs), default=0)
        self.size_dims = np.array([list(self.shape_exprs[sh]) + [one] * (rank - len(self.shape_exprs[sh]))
                                   for sh, _ in self.size_keys], np.int64).reshape(len(self.size_keys), rank)
        self.size_items = np.array([item for _, item in self.size_keys], np.int64)
        self.max_item = max((item for _, item in self.size_keys), default=1)
        self.size_dims_flat = np.ascontiguousarray(self.size_dims.ravel())
        self.shape_getters = [_picker(ids) for ids in self.shape_exprs]

        # Storage groups (a tensor and everything written in place over it) and where they live.
        members: dict[int, list[int]] = {}
        for t, root in enumerate(an.alias_root):
            members.setdefault(root, []).append(t)
        pool_id: dict[Placement, int] = {}

        def static(p: Placement) -> int:
            return pool_id.setdefault(p, len(pool_id))

        where: list[int | None] = [None] * n
        for i in range(len(ex.inputs_index)):
            where[i] = static((INPUT, i, ex.tensor_device[i]))
        for j, t in enumerate(ex.weights_index):
            where[t] = static((WEIGHT, j, ex.tensor_device[t]))
        for root, group in members.items():  # kernels writing in place into a graph input use its buffer
            if an.roles[root] == ROLE_INPUT:
                for m in group:
                    where[m] = where[root]

        self.output_slots: list[tuple[str, tuple[int, ...]]] = []  # kind, tensors whose largest size it takes
        slot_of_root: dict[int, int] = {}
        outputs: list[tuple[str, int]] = []
        for k, t in enumerate(ex.outputs_index):
            root = an.alias_root[t]
            if an.roles[root] == ROLE_INPUT:
                if t != root or meta.share_map.get(k) == root:
                    outputs.append(("input", root))
                else:  # an input returned unchanged: outputs are fresh storage, so copy it
                    self.output_slots.append((ex.tensor_device[t], (t,)))
                    outputs.append(("copy", len(self.output_slots) - 1))
                continue
            if root not in slot_of_root:
                self.output_slots.append((ex.tensor_device[root], tuple(members[root])))
                slot_of_root[root] = len(self.output_slots) - 1
                placed = static((OUTPUT, slot_of_root[root], ex.tensor_device[root]))
                for m in members[root]:
                    where[m] = placed
            outputs.append(("slot", slot_of_root[root]))
        self.outputs = tuple(outputs)

        # Remaining groups and kernel scratch are blocks of their kind's workspace.
        n_sizes = len(self.size_keys)
        self.kinds: dict[str, _KindBlocks] = {}
        block_of: dict[int, tuple[str, int]] = {}
        for root, group in members.items():
            if an.roles[root] in (ROLE_INPUT, ROLE_WEIGHT) or where[root] is not None:
                continue
            kind = ex.tensor_device[root]
            if any(self.tensor_size[m] != self.tensor_size[root] for m in group):
                # validate.py makes in-place outputs match their input's signature exactly.
                raise RuntimeError(f"internal error: tensors {group} share storage but differ in size")
            kb = self._kind(kind, alignment)
            start = an.producer[root]
            block_of[root] = (kind, len(kb.starts_list))
            kb.starts_list.append(start)
            kb.ends_list.append(max(max(an.last_use[m] for m in group), start))
            kb.size_src.append(self.tensor_size[root])  # type: ignore[union-attr]
        for kb in self.kinds.values():
            kb.n_tensors = len(kb.starts_list)
        for pos, ins in enumerate(ex.instructions):
            kernel = kernels[ins.task_idx]
            if kernel.workspace.is_constant and kernel.workspace.constant == 0:
                continue
            kb = self._kind(kernel.device, alignment)
            kb.starts_list.append(pos)
            kb.ends_list.append(pos)
            kb.size_src.append(n_sizes + ins.task_idx)  # type: ignore[union-attr]
            kb.scratch_pos.append(pos)  # type: ignore[union-attr]  # a list until freeze()
        # Where every tensor lives (the same at every key), and each kind's tensors with their blocks.
        self.kind_order = tuple(sorted(self.kinds))
        static_places = list(pool_id)
        where_t, index_t, kind_t = [], [], []
        in_kind: dict[str, tuple[list[int], list[int]]] = {kind: ([], []) for kind in self.kind_order}
        for t in range(n):
            w = where[t]
            if w is None:
                kind, b = block_of[an.alias_root[t]]
                where_t.append(WORKSPACE)
                index_t.append(-1)
                kind_t.append(kind)
                in_kind[kind][0].append(t)
                in_kind[kind][1].append(b)
            else:
                w_code, w_index, w_kind = static_places[w]
                where_t.append(w_code)
                index_t.append(w_index)
                kind_t.append(w_kind)
        for kind, (tensors, blocks) in in_kind.items():
            self.kinds[kind].freeze(tensors, blocks)
        scratch_kind: list[str | None] = [None] * len(ex.instructions)
        for kind in self.kind_order:
            for pos in self.kinds[kind].scratch_pos.tolist():  # type: ignore[union-attr]  # an array after freeze()
                scratch_kind[pos] = kind
        weights = [(t, i) for t, (w, i) in enumerate(zip(where_t, index_t)) if w == WEIGHT]
        self.layout = PlanLayout(
            where=tuple(where_t), index=tuple(index_t), kind=tuple(kind_t), scratch_kind=tuple(scratch_kind),
            workspace_tensors={kind: _frozen_array(self.kinds[kind].tensors) for kind in self.kind_order},
            weight_tensors=_frozen_array(np.array([t for t, _ in weights], np.int64)),
            weight_numbers=_frozen_array(np.array([i for _, i in weights], np.int64)))
        self.n_tensors = n
        self.n_instructions = len(ex.instructions)
        self.pick_shapes = _picker(self.tensor_shape)
        self.pick_sizes = _picker(self.tensor_size)
        self.pick_symbols = _picker(self.instr_syms)
        self._lock = threading.Lock()

    def _kind(self, kind: str, alignment: Mapping[str, int]) -> _KindBlocks:
        kb = self.kinds.get(kind)
        if kb is None:
            kb = self.kinds[kind] = _KindBlocks(kind, alignment.get(kind, 64))
        return kb

    # -- per key ---------------------------------------------------------------------------------
    def _evaluate(self, key: tuple[int, ...]) -> tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray]:
        """Evaluate every distinct expression once: env, the value of each expression (int64), the
        distinct tensor sizes, and the size vector that blocks index (``_KindBlocks.size_src``)."""
        env = dict(zip(self.symbols, key))
        for name, value in env.items():
            if not 0 <= value <= _MAX_BYTES:  # a shape no memory holds: refused before any arithmetic
                raise InputError(f"symbol {name!r} = {value if value < 10**30 else 'a huge value'} is out of "
                                 f"range: symbol values must lie in [0, 2**62]")
        try:
            array = self.batch.evaluate_array(key)
        except ExprError as exc:  # an expression of the bundle overflows at this key: the key is at fault
            raise InputError(f"at {env}: {exc}") from None
        native = HELPERS.planner
        if native is not None:
            vector = np.empty(len(self.size_items) + len(self.kernel_ws), np.int64)
            if native.key_sizes(array, self.size_dims_flat, self.size_dims.shape[1], self.size_items,
                                 self.kernel_ws, vector):
                return env, array, vector[:len(self.size_items)], vector
            # a negative dimension, a size over 2**62 or a bad workspace: numpy below says which
        vals = array.tolist()
        dims = array[self.size_dims]
        if dims.size and int(dims.min()) < 0:
            s = self.size_keys[int(np.flatnonzero((dims < 0).any(axis=1))[0])][0]
            raise InputError(f"tensor {self.shape_first[s]} would have a negative dimension "
                             f"{self.shape_getters[s](vals)} at {env}")
        # int64 products may wrap. When the largest dimension to the largest rank cannot pass 2**62
        # bytes none does; otherwise the float products (exact enough here) find the sizes over it.
        if dims.size and int(dims.max()) ** self.size_dims.shape[1] * self.max_item > _MAX_BYTES:
            over = (dims.astype(np.float64).prod(axis=1) * self.size_items) > _MAX_BYTES * 0.999
            for z in np.flatnonzero(over).tolist():
                shape_index, itemsize = self.size_keys[z]
                shape = self.shape_getters[shape_index](vals)
                if itemsize * math.prod(shape) > _MAX_BYTES:
                    t = self.tensor_size.index(z)
                    raise InputError(f"tensor {t} of shape {shape} at {env} is too large")
        sizes = dims.prod(axis=1) * self.size_items
        workspaces = array[self.kernel_ws]
        if workspaces.size and (int(workspaces.min()) < 0 or int(workspaces.max()) > _MAX_BYTES):
            bad = (workspaces < 0) | (workspaces > _MAX_BYTES)
            k = int(np.flatnonzero(bad)[0])
            what = "negative" if workspaces[k] < 0 else "too large"
            raise InputError(f"kernel {self.kernel_names[k]!r} workspace {self.kernel_ws_source[k]!r} is {what} "
                             f"at {env}")
        # Per key, one vector of sizes: the distinct tensor sizes, then each kernel's workspace.
        return env, array, sizes, np.concatenate([sizes, workspaces])

    @staticmethod
    def _kind_sizes(kb: _KindBlocks, size_vector: np.ndarray, *,
                    pad: bool = False) -> tuple[np.ndarray, np.ndarray, int, int]:
        """One kind's blocks at a key: raw and aligned sizes (``pad``: empty blocks as the smallest
        size, for templates), their total and lower bound. InputError past 2**62 bytes in all."""
        n = len(kb.size_src)
        native = HELPERS.planner
        if native is not None:
            raw, aligned = np.empty(n, np.int64), np.empty(n, np.int64)
            try:
                total, bound = native.kind_sizes(size_vector, kb.size_src, kb.alignment, kb.starts, kb.ends, raw,
                                                 aligned, pad)
            except native.SizeError:
                raise InputError(f"the {kb.kind} workspace would need more than 2**62 bytes") from None
            return raw, aligned, total, bound
        raw = size_vector[kb.size_src]
        aligned = _aligned(raw, kb.alignment)
        if pad:
            positive = aligned[aligned > 0]
            aligned = np.where(aligned > 0, aligned, int(positive.min()) if positive.size else 1)
        total = total_bytes(aligned)
        if total > _MAX_BYTES:
            raise InputError(f"the {kb.kind} workspace would need more than 2**62 bytes")
        return raw, aligned, total, live_peak(kb.starts, kb.ends, aligned)

    def _template(self, kb: _KindBlocks, tkey: tuple[int, ...]) -> _Template | None:
        """The kind's template at template key ``tkey`` (its best-fit plan), planned once."""
        template = kb.templates.get(tkey, _MISSING)
        if template is not _MISSING:
            return template  # type: ignore[return-value]
        with self._lock:
            template = kb.templates.get(tkey, _MISSING)
            if template is _MISSING:
                try:
                    # Empty blocks count as the smallest size so that the template orders them too:
                    # a block empty at the template key may be large at another.
                    _, padded, _, bound = self._kind_sizes(kb, self._evaluate(tkey)[3], pad=True)
                    offsets, _ = plan_array(kb.starts, kb.ends, padded, bound, _good_enough(bound),
                                            graph=kb.graph, ties=kb.ties)
                    template = _Template(offsets, padded)
                except (EngineError, ArithmeticError):
                    template = None  # the template key is not a valid key: plan these keys afresh
                kb.templates[tkey] = template
        return template  # type: ignore[return-value]

    def _replayer(self, kb: _KindBlocks, template: _Template) -> ReplayTemplate:
        """The template's plan recorded for replay (``ReplayTemplate``), on its first replay."""
        replayer = template.replayer
        if replayer is None:
            with self._lock:
                replayer = template.replayer
                if replayer is None:
                    replayer = template.replayer = ReplayTemplate(kb.starts, kb.ends, template.offsets, template.sizes,
                                                                  kb.graph)
        return replayer

    def _assign(self, kb: _KindBlocks, key: tuple[int, ...], aligned: np.ndarray,
                bound: int) -> tuple[np.ndarray, int, str]:
        """Offsets, peak and how they were found, for one kind's blocks at ``key``."""
        if not self.symbols:  # a static graph has one key: plan it as well as we can
            fresh, peak = plan_array(kb.starts, kb.ends, aligned, bound, graph=kb.graph, ties=kb.ties)
            return fresh, peak, "best-fit"
        good_enough = _good_enough(bound)
        best: tuple[np.ndarray, int, str] | None = None
        nearest = template_key(key)
        for tkey in (nearest, template_key(key, other=True)):
            if tkey == nearest and best is not None:
                break  # no other side: every symbol is a power of two (or at most 2)
            template = self._template(kb, tkey)
            if template is None:
                continue
            if tkey == key:  # the template key itself: the template's plan (empty blocks at 0)
                offsets = np.where(aligned > 0, template.offsets, 0)
                peak = int((offsets + aligned).max(initial=0))
                how = "template"
            else:
                offsets, peak = self._replayer(kb, template).replay(aligned)
                how = "replay"
            if best is None or peak < best[1]:
                best = (offsets, peak, how)
            if peak <= good_enough:
                return best
        fresh, peak = plan_array(kb.starts, kb.ends, aligned, bound, good_enough, graph=kb.graph, ties=kb.ties)
        if best is None or peak < best[1]:
            best = (fresh, peak, "best-fit")
        return best

    def plan(self, key: tuple[int, ...]) -> KeyPlan:
        env, values, sizes, size_vector = self._evaluate(key)
        tensor_offsets = np.zeros(self.n_tensors, np.int64)
        scratch_offsets = np.zeros(self.n_instructions, np.int64)
        scratch_nbytes = np.zeros(self.n_instructions, np.int64)
        workspace_bytes: dict[str, int] = {}
        bounds: dict[str, int] = {}
        no_reuse: dict[str, int] = {}
        planned_by: dict[str, str] = {}
        for kind in self.kind_order:
            kb = self.kinds[kind]
            try:
                raw, aligned, total, bound = self._kind_sizes(kb, size_vector)
            except InputError as e:
                raise InputError(f"{e} at {env}") from None
            offsets, peak, how = self._assign(kb, key, aligned, bound)
            segment = self.segment_bytes.get(kind)
            if segment is not None and peak > segment:
                try:
                    offsets, peak = segment_offsets(offsets, aligned, segment)
                except SizeError as e:
                    raise InputError(f"{kind} workspace at {env}: {e}") from None
                how += " in segments"
            planned_by[kind] = how
            workspace_bytes[kind] = peak
            bounds[kind] = bound
            no_reuse[kind] = total
            native = HELPERS.planner
            if native is not None:
                native.scatter(offsets, raw, kb.n_tensors, kb.tensors, kb.tensor_blocks, kb.scratch_pos,
                               tensor_offsets, scratch_offsets, scratch_nbytes)
            else:
                tensor_offsets[kb.tensors] = offsets[kb.tensor_blocks]
                scratch_offsets[kb.scratch_pos] = offsets[kb.n_tensors:]
                scratch_nbytes[kb.scratch_pos] = raw[kb.n_tensors:]

        vals = values.tolist()
        shapes = [get(vals) for get in self.shape_getters]
        nbytes = self.pick_sizes(sizes.tolist())
        output_slots = tuple(OutputSlot(kind, max(nbytes[t] for t in tensors)) for kind, tensors in self.output_slots)
        if self.limits:
            self._check_limits(env, workspace_bytes, output_slots)
        symbol_values = [tuple([key[i] for i in pos]) for pos in self.sym_lists]
        return KeyPlan(
            key=key,
            env=env,
            shapes=self.pick_shapes(shapes),
            nbytes=nbytes,
            layout=self.layout,
            tensor_offsets=_frozen_array(tensor_offsets),
            output_slots=output_slots,
            outputs=self.outputs,
            scratch_offsets=_frozen_array(scratch_offsets),
            scratch_nbytes=_frozen_array(scratch_nbytes),
            kernel_symbols=self.pick_symbols(symbol_values),
            workspace_bytes=workspace_bytes,
            lower_bound_bytes=bounds,
            no_reuse_bytes=no_reuse,
            planned_by=planned_by,
            segment_bytes={k: v for k, v in self.segment_bytes.items() if workspace_bytes.get(k, 0) > v},
        )

    def _check_limits(self, env: Mapping[str, int], workspace_bytes: Mapping[str, int],
                      output_slots: Sequence[OutputSlot]) -> None:
        """Refuse a key whose workspace and outputs on one device exceed its ``MemoryLimit``, before
        anything is allocated for it."""
        for kind, limit in self.limits.items():
            workspace = workspace_bytes.get(kind, 0)
            outputs = [slot.nbytes for slot in output_slots if slot.kind == kind]
            total = workspace + sum(outputs)
            if total > limit.nbytes:
                buffers = f"{len(outputs)} output buffer{'' if len(outputs) == 1 else 's'}"
                purpose = (f"the plan at {key_text(env)} (its {kind} workspace {format_size(workspace)} + {buffers} "
                           f"{format_size(sum(outputs))})")
                raise OutOfMemoryError(total, limit.device, f"over the planned-memory limit of "
                                       f"{format_size(limit.nbytes)} ({limit.nbytes} bytes, {limit.source})", purpose)


def _good_enough(bound: int) -> int:
    return bound + bound * REPLAY_SLACK_PERCENT // 100


def _aligned(sizes: np.ndarray, alignment: int) -> np.ndarray:
    return (sizes + (alignment - 1)) // alignment * alignment
