"""Human-readable views of a graph: the ``str(graph)`` table and the memory report.

Both read the graph's ``GraphRuntime`` (contents, tasks, weights, devices, plans) and nothing of
``CompiledGraph``: the facade hands them what they show, so this module sits below it and
``compiled_graph`` is the only one of the two that imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence, Sized

import attrs

if TYPE_CHECKING:
    from engine.runtime.runtime import GraphRuntime

__all__ = ["graph_table", "memory_report", "SlotMemory", "MemoryReport", "format_bytes", "format_ms"]

def format_bytes(n: int) -> str:
    """``37.5 KiB``; exact below 1 KiB. The one byte formatter of the engine and its CLI."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def format_ms(value: float) -> str:
    """Milliseconds with four decimals below 10 ms (``0.0123``), fewer above: the one time formatter of
    the engine's tables and its CLI (``engine.cli.render.ms``)."""
    if value < 10:
        return f"{value:.4f}"
    if value < 1000:
        return f"{value:.2f}"
    return f"{value:.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def graph_table(runtime: "GraphRuntime", dispatch_table: Sized) -> str:
    """The ``str(graph)`` table: signatures, weights, kernels, symbols, the dispatch table's size and
    devices. The dispatch table is passed apart because it belongs to the graph's dispatcher, not to
    its runtime; only its number of keys is shown."""
    contents = runtime.contents
    meta = contents.meta
    rows = []
    in_names = meta.input_names or tuple(f"input_{i}" for i in range(len(meta.inputs)))
    out_names = meta.output_names or tuple(f"output_{i}" for i in range(len(meta.outputs)))
    for name, sig in zip(in_names, meta.inputs):
        rows.append(["input", name, sig.dtype.name, sig.shape_str(), sig.device])
    for name, sig in zip(out_names, meta.outputs):
        rows.append(["output", name, sig.dtype.name, sig.shape_str(), sig.device])
    weights = runtime.weights
    entries = contents.weight_entries or ()
    n_params = sum(_prod(e.shape) for e in entries)
    total = sum(e.nbytes for e in entries)
    status = "not loaded (call set_weights)" if weights is None else "loaded"
    lines = [
        _table(["kind", "name", "dtype", "shape", "device"], rows),
        "",
        f"weights: {len(contents.execution.weights_index)} tensors, {format_bytes(total)}, {status}",
        f"parameters: {n_params:,}",
        f"kernels: {meta.num_kernels} ({sum(len(t.candidates) for t in runtime.tasks)} candidates), "
        f"instructions: {len(contents.execution.instructions)}",
        f"symbols: {', '.join(meta.symbols) or '(static)'}; dispatch table: {len(dispatch_table)} keys",
        f"devices: {', '.join(str(d) for d in runtime.devices.devices.values())}",
    ]
    return "\n".join(lines)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@attrs.frozen
class SlotMemory:
    """Planned workspace bytes of one slot against the lower bound and a no-reuse plan."""

    slot: int
    kind: str
    planned_bytes: int
    lower_bound_bytes: int
    no_reuse_bytes: int

    @property
    def ratio(self) -> float:
        return self.planned_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


class MemoryReport(dict):
    """slot -> SlotMemory, printing as a table."""

    def __str__(self) -> str:
        rows = [[str(m.slot), m.kind, format_bytes(m.planned_bytes), format_bytes(m.lower_bound_bytes),
                 f"{m.ratio:.3f}", format_bytes(m.no_reuse_bytes)] for m in self.values()]
        return _table(["slot", "kind", "planned", "lower bound", "ratio", "no reuse"], rows)


def memory_report(symbol_names: Sequence[str], runtime: "GraphRuntime", symbols: Mapping[str, Any]) -> MemoryReport:
    missing = [s for s in symbol_names if s not in symbols]
    extra = [s for s in symbols if s not in symbol_names]
    if missing or extra:
        from engine.errors import InputError
        raise InputError(f"memory_report needs exactly the symbols {list(symbol_names)}; missing {missing}, "
                         f"unknown {extra}")
    key = tuple(int(symbols[s]) for s in symbol_names)
    plan = runtime.key_plan(key)  # the plan runs use, cached per key
    report = MemoryReport()
    for kind, backend in runtime.devices.backends.items():
        slot = backend.workspace_slot
        report[slot] = SlotMemory(slot, kind, plan.workspace_bytes.get(kind, 0), plan.lower_bound_bytes.get(kind, 0),
                                  plan.no_reuse_bytes.get(kind, 0))
    return report
