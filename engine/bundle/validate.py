"""Cross-member consistency of a bundle, and the facts the runtime derives from it.

Structure (types, required keys) is checked when JSON is read (``schema``); this module checks
that the members agree with each other: indices in range and in the reference's order, signatures
of kernels matching their tensors, devices agreeing, symbols bound, ``free`` lists honest, in-place
aliasing sane. It returns a ``GraphAnalysis`` (roles, producers, last uses, alias roots) which the
memory planner and the interpreter use, so they never re-derive or re-check any of it.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from engine.bundle.jsonread import clip
from engine.bundle.schema import (GraphExecution, GraphMetaData, KernelMeta, TensorSignature, WeightEntry,
                                  checked_nbytes)
from engine.errors import BundleError

__all__ = ["GraphAnalysis", "analyze_graph", "ROLE_INPUT", "ROLE_WEIGHT", "ROLE_INTERMEDIATE", "MAX_TENSOR_BYTES"]

ROLE_INPUT, ROLE_WEIGHT, ROLE_INTERMEDIATE = "input", "weight", "intermediate"
META, EXEC = "meta.json", "graph_execution.json"
#: Largest tensor, in bytes: the memory planner's limit at every key (sizes past it are refused at
#: run time). A tensor whose shape is all constants is measured against it at load instead, so that
#: the bundle -- not the caller's input -- is named.
MAX_TENSOR_BYTES = 2**62


@attrs.frozen
class GraphAnalysis:
    """Derived, validated facts about the plan, indexed by tensor index."""

    roles: tuple[str, ...]
    producer: tuple[int, ...]          # instruction index defining the tensor; -1 for inputs and weights
    last_use: tuple[int, ...]          # last instruction reading or writing it; len(instructions) if a graph output
    alias_root: tuple[int, ...]        # tensor whose storage it uses (itself unless written in place)
    graph_outputs: frozenset[int]
    kinds: tuple[str, ...]             # every device kind the plan touches, sorted


def _same(a: TensorSignature, b: TensorSignature) -> bool:
    return a.dtype == b.dtype and tuple(e.source for e in a.shape) == tuple(e.source for e in b.shape)


def analyze_graph(meta: GraphMetaData, ex: GraphExecution, kernels: Sequence[KernelMeta],
                  weights: Sequence[WeightEntry] | None) -> GraphAnalysis:
    """Validate the plan; raise ``BundleError`` naming the member and JSON path of the first problem."""
    n = len(ex.tensor_signatures)
    if len(ex.tensor_device) != n:
        raise BundleError(f"{len(ex.tensor_device)} devices for {n} tensor signatures", member=EXEC,
                          path="$.tensor_device")
    for t, (sig, kind) in enumerate(zip(ex.tensor_signatures, ex.tensor_device)):
        if sig.device != kind:
            raise BundleError(f"signature device {clip(sig.device)} disagrees with tensor_device {clip(kind)}",
                              member=EXEC, path=f"$.tensor_signatures[{t}].device")
    if len(kernels) != meta.num_kernels:
        raise BundleError(f"num_kernels is {meta.num_kernels} but {len(kernels)} kernels were read", member=META,
                          path="$.num_kernels")

    n_in, n_w = len(ex.inputs_index), len(ex.weights_index)
    if len(meta.inputs) != n_in:
        raise BundleError(f"meta.json lists {len(meta.inputs)} inputs, inputs_index {n_in}", member=EXEC,
                          path="$.inputs_index")
    for i, t in enumerate(ex.inputs_index):
        if t != i:
            raise BundleError(f"graph inputs must be tensors 0..{n_in - 1} in order, got {t}", member=EXEC,
                              path=f"$.inputs_index[{i}]")
    for j, t in enumerate(ex.weights_index):
        if t != n_in + j:
            raise BundleError(f"weights must follow the inputs as tensors {n_in}..{n_in + n_w - 1}, got {t}",
                              member=EXEC, path=f"$.weights_index[{j}]")
    if n < n_in + n_w:
        raise BundleError(f"{n} tensor signatures for {n_in} inputs and {n_w} weights", member=EXEC,
                          path="$.tensor_signatures")

    symbols = set(meta.symbols)
    bound: set[str] = set()
    for i, sig in enumerate(meta.inputs):
        if not _same(sig, ex.tensor_signatures[i]) or sig.device != ex.tensor_device[i]:
            raise BundleError(f"input {i} signature {_sig_text(sig)} on {sig.device} differs "
                              f"from tensor_signatures[{i}]", member=META, path=f"$.inputs[{i}]")
        for d, e in enumerate(sig.shape):
            if e.is_constant:
                continue
            if e.source not in symbols:
                raise BundleError(f"input shape entries must be integers or symbol names from $.symbols, got "
                                  f"{clip(e.source)}", member=META, path=f"$.inputs[{i}].shape[{d}]")
            bound.add(e.source)
    unbound = [s for s in meta.symbols if s not in bound]
    if unbound:
        raise BundleError(f"symbols {unbound} are not bound by any input's shape", member=META, path="$.symbols")
    for t, sig in enumerate(ex.tensor_signatures):
        used = sig.symbols
        if not used:
            _check_constant_size(sig, f"$.tensor_signatures[{t}].shape")
        elif not used <= symbols:
            raise BundleError(f"uses symbols {sorted(used - symbols)} not declared in meta.json $.symbols",
                              member=EXEC, path=f"$.tensor_signatures[{t}].shape")

    roles = [ROLE_INPUT] * n_in + [ROLE_WEIGHT] * n_w + [ROLE_INTERMEDIATE] * (n - n_in - n_w)
    producer = [-1] * n
    last_use = [-1] * n
    alias_root = list(range(n))
    next_fresh = n_in + n_w
    kinds = set(ex.tensor_device)

    for k, kernel in enumerate(kernels):
        member = f"kernels/{k}/meta.json"
        kinds.add(kernel.device)
        extra = set(kernel.symbols) - symbols
        if extra:
            raise BundleError(f"kernel symbols {sorted(extra)} are not graph symbols", member=member, path="$.symbols")
        used = set(kernel.workspace.symbols)  # type: ignore[assignment]  # a set of its own from here on
        for c, cand in enumerate(kernel.candidates):
            if cand.launch is not None:
                for e in (*cand.launch.grid, *cand.launch.block, cand.launch.shared_memory):
                    if not e.symbols <= set(kernel.symbols):
                        raise BundleError(f"launch expression {clip(e.source)} uses symbols outside the kernel's "
                                          f"$.symbols {list(kernel.symbols)}", member=member,
                                          path=f"$.candidates[{c}].launch")
        if not used <= symbols:
            raise BundleError(f"workspace uses undeclared symbols {sorted(used - symbols)}", member=member,
                              path="$.workspace")
        if kernel.workspace.is_constant and kernel.workspace.constant > MAX_TENSOR_BYTES:  # type: ignore[operator]
            raise BundleError(f"a workspace of {kernel.workspace.constant} bytes is over the limit of 2**62",
                              member=member, path="$.workspace")
        for o, i in kernel.share_map.items():
            if o >= len(kernel.outputs) or i >= len(kernel.inputs):
                raise BundleError(f"share_map {o} -> {i} is out of range ({len(kernel.outputs)} outputs, "
                                  f"{len(kernel.inputs)} inputs)", member=member, path="$.share_map")
            if not _same(kernel.outputs[o], kernel.inputs[i]):
                raise BundleError(f"output {o} writes in place into input {i} but their signatures differ",
                                  member=member, path="$.share_map")
        if kernel.builtin == "copy":
            if len(kernel.inputs) != 1 or len(kernel.outputs) != 1 or not _same(kernel.inputs[0], kernel.outputs[0]):
                raise BundleError("builtin 'copy' takes one input and one output of the same dtype and shape",
                                  member=member, path="$.inputs" if len(kernel.inputs) != 1 else "$.outputs")

    freed: set[int] = set()
    for pos, ins in enumerate(ex.instructions):
        path = f"$.instructions[{pos}]"
        if ins.task_idx >= len(kernels):
            raise BundleError(f"task_idx {ins.task_idx} is out of range ({len(kernels)} kernels)", member=EXEC,
                              path=f"{path}.task_idx")
        kernel = kernels[ins.task_idx]
        if len(ins.inputs) != len(kernel.inputs) or len(ins.outputs) != len(kernel.outputs):
            raise BundleError(f"kernel {clip(kernel.name)} takes {len(kernel.inputs)} inputs and {len(kernel.outputs)} "
                              f"outputs, the instruction gives {len(ins.inputs)} and {len(ins.outputs)}",
                              member=EXEC, path=path)
        for a, t in enumerate(ins.inputs):
            where = f"{path}.inputs[{a}]"
            if t >= n:
                raise BundleError(f"tensor {t} is out of range ({n} tensors)", member=EXEC, path=where)
            if roles[t] == ROLE_INTERMEDIATE and producer[t] < 0:
                raise BundleError(f"tensor {t} is read before any instruction produces it", member=EXEC, path=where)
            _check_sig(kernel, kernel.inputs[a], ex, t, where, copy_side="in")
            last_use[t] = pos
        for a, t in enumerate(ins.outputs):
            where = f"{path}.outputs[{a}]"
            if t != next_fresh:
                raise BundleError(f"kernel outputs must be numbered in plan order: expected tensor {next_fresh}, "
                                  f"got {t}", member=EXEC, path=where)
            if t >= n:
                raise BundleError(f"tensor {t} is out of range ({n} tensors)", member=EXEC, path=where)
            next_fresh += 1
            _check_sig(kernel, kernel.outputs[a], ex, t, where, copy_side="out")
            producer[t] = pos
            last_use[t] = pos
        for o, i in kernel.share_map.items():
            src = ins.inputs[i]
            root = alias_root[src]
            if roles[root] == ROLE_WEIGHT:
                raise BundleError(f"kernel {clip(kernel.name)} writes in place into weight tensor {root}; weights are "
                                  f"read-only", member=EXEC, path=path)
            alias_root[ins.outputs[o]] = root
        for f, t in enumerate(ins.free):
            where = f"{path}.free[{f}]"
            if t >= n or (roles[t] == ROLE_INTERMEDIATE and producer[t] < 0):
                raise BundleError(f"frees tensor {t}, which does not exist yet", member=EXEC, path=where)
            if t in freed:
                raise BundleError(f"frees tensor {t} twice", member=EXEC, path=where)
            if roles[t] == ROLE_WEIGHT:
                raise BundleError(f"frees weight tensor {t}; weights live as long as the graph", member=EXEC,
                                  path=where)
            freed.add(t)
    if next_fresh != n:
        raise BundleError(f"{n} tensor signatures but the instructions produce only tensors up to {next_fresh - 1}",
                          member=EXEC, path="$.tensor_signatures")

    end = len(ex.instructions)
    if len(meta.outputs) != len(ex.outputs_index):
        raise BundleError(f"meta.json lists {len(meta.outputs)} outputs, outputs_index {len(ex.outputs_index)}",
                          member=EXEC, path="$.outputs_index")
    for k, t in enumerate(ex.outputs_index):
        where = f"$.outputs_index[{k}]"
        if t >= n:
            raise BundleError(f"tensor {t} is out of range ({n} tensors)", member=EXEC, path=where)
        if roles[t] == ROLE_WEIGHT:
            raise BundleError(f"graph output {k} is weight tensor {t}; weights cannot be outputs", member=EXEC,
                              path=where)
        if t in freed:
            raise BundleError(f"graph output {k} (tensor {t}) is freed by an instruction", member=EXEC, path=where)
        if not _same(meta.outputs[k], ex.tensor_signatures[t]) or meta.outputs[k].device != ex.tensor_device[t]:
            raise BundleError(f"output {k} signature differs from tensor_signatures[{t}]", member=META,
                              path=f"$.outputs[{k}]")
        last_use[t] = end
    outputs = frozenset(ex.outputs_index)

    # Only now are last uses final: check every free against them (per tensor, DESIGN §3).
    for pos, ins in enumerate(ex.instructions):
        for f, t in enumerate(ins.free):
            if last_use[t] > pos:
                raise BundleError(f"frees tensor {t} at instruction {pos} but instruction {last_use[t]} still uses it",
                                  member=EXEC, path=f"$.instructions[{pos}].free[{f}]")

    # In-place writes into graph inputs surface as graph outputs: share_map must say so, both ways.
    for k, t in enumerate(ex.outputs_index):
        root = alias_root[t]
        declared = meta.share_map.get(k)
        if roles[root] == ROLE_INPUT and t != root and declared != root:
            raise BundleError(f"graph output {k} is written in place into input {root} but share_map does not "
                              f"declare {k} -> {root}", member=META, path="$.share_map")
        if declared is not None and (declared >= n_in or root != declared):
            raise BundleError(f"share_map declares output {k} -> input {declared} but the plan does not write it "
                              f"in place there", member=META, path=f"$.share_map[{k!r}]")

    if weights is not None:
        if len(weights) != n_w:
            raise BundleError(f"{len(weights)} weight entries for {n_w} weights in weights_index",
                              member="weights.json", path="$")
        for j, (entry, t) in enumerate(zip(weights, ex.weights_index)):
            sig = ex.tensor_signatures[t]
            shape = tuple(e.constant for e in sig.shape)
            if entry.dtype != sig.dtype or entry.shape != shape:
                raise BundleError(f"weight {clip(entry.name)} is {entry.dtype.name}{list(entry.shape)} but tensor {t} "
                                  f"is {_sig_text(sig)}", member="weights.json", path=f"$[{j}]")
            if entry.offset % 64:
                raise BundleError(f"weight {clip(entry.name)} offset {entry.offset} is not 64-byte aligned",
                                  member="weights.json", path=f"$[{j}].offset")
    for t in ex.weights_index:
        if not all(e.is_constant for e in ex.tensor_signatures[t].shape):
            raise BundleError(f"weight tensor {t} has a symbolic shape", member=EXEC, path=f"$.tensor_signatures[{t}]")

    return GraphAnalysis(tuple(roles), tuple(producer), tuple(last_use), tuple(alias_root), outputs,
                         tuple(sorted(kinds)))


def _sig_text(sig: TensorSignature) -> str:
    """``float32[batch, 64]`` for a message, cut short: 32 expressions of 4096 characters fit a
    signature, and a message stays one readable line."""
    text = f"{sig.dtype.name}{sig.shape_str()}"
    return text if len(text) <= 120 else text[:100] + f"...] ({len(sig.shape)} dimensions)"


def _check_constant_size(sig: TensorSignature, path: str) -> None:
    """A shape of constants only must fit the planner's per-tensor limit (``MAX_TENSOR_BYTES``)."""
    dims = [e.constant for e in sig.shape]
    if checked_nbytes(sig.dtype.nbytes, dims, MAX_TENSOR_BYTES) is not None:  # type: ignore[arg-type]
        return
    raise BundleError(f"a {_sig_text(sig)} tensor needs more than 2**62 bytes, the limit for one "
                      f"tensor", member=EXEC, path=path)


def _check_sig(kernel: KernelMeta, ksig: TensorSignature, ex: GraphExecution, t: int, where: str,
               copy_side: str) -> None:
    tsig = ex.tensor_signatures[t]
    if not _same(ksig, tsig):
        raise BundleError(f"kernel {clip(kernel.name)} expects {_sig_text(ksig)}, tensor {t} is "
                          f"{_sig_text(tsig)}", member=EXEC, path=where)
    if ksig.device != ex.tensor_device[t]:
        raise BundleError(f"kernel {clip(kernel.name)} expects this tensor on {ksig.device}, tensor {t} lives on "
                          f"{ex.tensor_device[t]}", member=EXEC, path=where)
    if kernel.builtin is None and ksig.device != kernel.device:
        raise BundleError(f"kernel {clip(kernel.name)} runs on {kernel.device} but its {copy_side}put signature is on "
                          f"{ksig.device}", member=EXEC, path=where)
