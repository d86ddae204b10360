"""``GraphBuilder``: declare inputs, weights, kernels and calls; get a bundle and a ``CompiledGraph``.

The builder writes exactly what a compiler would: tensor indices in the reference order (inputs,
weights, kernel outputs in plan order), ``free`` lists from liveness, one compiled task per distinct
kernel signature. Sources are compiled through the owning plugin's ``compile`` and shipped beside
their binaries, so a machine of another architecture can still rebuild them at load.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import attrs
import numpy as np

from engine.bundle.contents import bundle_members, read_bundle
from engine.bundle.schema import (BinaryMeta, CandidateMeta, GraphExecution, GraphExecutionInstruction,
                                  GraphMetaData, KernelMeta, LaunchMeta, TensorSignature)
from engine.bundle.writer import bundle_to_bytes
from engine.dtypes import dtype as to_dtype
from engine.errors import InputError
from engine.expr import parse_expr
from engine.plugins import Registry, default_registry

if TYPE_CHECKING:
    from engine.runtime.compiled_graph import CompiledGraph

__all__ = ["GraphBuilder", "KernelDef", "Value"]

_SOURCE_FORMATS = {"c": "c-source", "cuda": "cuda-source", "hip": "hip-source"}
_SOURCE_SUFFIX = {"c": ".c", "cuda": ".cu", "hip": ".hip", "opencl": ".cl"}


@attrs.frozen
class Value:
    """A tensor of the graph being built (an input, a weight, or a kernel output)."""

    index: int
    signature: TensorSignature
    builder_id: int = attrs.field(repr=False)

    @property
    def shape(self) -> tuple[str, ...]:
        return tuple(e.source for e in self.signature.shape)

    @property
    def dtype(self) -> str:
        return self.signature.dtype.name


@attrs.frozen
class KernelDef:
    """A kernel's code: a source (compiled at build) or prebuilt binaries, and its candidate entries."""

    name: str
    device: str
    entries: tuple[str, ...]
    language: str | None
    source: str | None
    binaries: tuple[Mapping[str, Any], ...]
    options: Mapping[str, Any]
    launch: tuple[Mapping[str, Any] | None, ...]
    #: Entries compiled from a source of their own: entry -> (source, compile options).
    entry_code: Mapping[str, tuple[str, Mapping[str, Any]]] = attrs.field(factory=dict)


def _sig(dtype: Any, shape: Sequence[int | str], device: str) -> TensorSignature:
    return TensorSignature(device, to_dtype(dtype), tuple(parse_expr(d) for d in shape))


class GraphBuilder:
    """Accumulates a graph; ``build()`` compiles and returns a loaded ``CompiledGraph``."""

    def __init__(self, name: str = "graph", *, registry: Registry | None = None):
        self.name = name
        self._registry = registry
        self._inputs: list[tuple[str, TensorSignature]] = []
        self._weights: list[tuple[str, np.ndarray, str]] = []
        self._calls: list[tuple[KernelDef, list[Value], list[TensorSignature], dict[str, Any]]] = []
        self._outputs: list[tuple[str, Value]] = []
        self._symbols: list[str] = []
        self._frozen_io = False

    @property
    def registry(self) -> Registry:
        return self._registry if self._registry is not None else default_registry()

    # -- declarations --------------------------------------------------------------------------
    def input(self, name: str, dtype: Any, shape: Sequence[int | str], device: str = "cpu") -> Value:
        """A graph input; string dimensions are symbols bound from this input at run time."""
        if self._weights or self._calls:
            raise InputError("declare every input before weights and calls (tensor indices put inputs first)")
        for d in shape:
            if isinstance(d, str):
                if not re.fullmatch(r"[A-Za-z_]\w*", d):
                    raise InputError(f"input {name!r}: dimension {d!r} must be an integer or a symbol name")
                if d not in self._symbols:
                    self._symbols.append(d)
        sig = _sig(dtype, shape, device)
        self._inputs.append((name, sig))
        return Value(len(self._inputs) - 1, sig, id(self))

    def weight(self, name: str, array: Any, device: str = "cpu") -> Value:
        """A constant tensor stored in the bundle (numpy array or anything ``np.asarray`` takes)."""
        if self._calls:
            raise InputError("declare every weight before calls (tensor indices put weights before outputs)")
        arr = np.ascontiguousarray(np.asarray(array))
        sig = _sig(arr.dtype, arr.shape, device)
        self._weights.append((name, arr, device))
        return Value(len(self._inputs) + len(self._weights) - 1, sig, id(self))

    def kernel(self, name: str, *, device: str = "cpu", entries: Sequence[str], source: str | None = None,
               language: str | None = None, binaries: Sequence[Mapping[str, Any]] = (),
               options: Mapping[str, Any] | None = None,
               launch: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
               entry_code: Mapping[str, tuple[str, Mapping[str, Any] | None]] | None = None) -> KernelDef:
        """Define a kernel with one candidate per entry. Give ``source`` (+ ``language``) or ``binaries``
        (dicts with format, target, path, data); ``launch`` is one dict for all candidates or a list.

        ``entry_code`` gives some entries a source of their own (``entry: (source, options)``, same
        language): they get their own binaries, so a candidate that needs something optional (a
        library from a wheel) does not make the kernel's other candidates need it too.
        """
        if not entries:
            raise InputError(f"kernel {name!r}: at least one entry (candidate) is required")
        own = {str(e): (code[0], dict(code[1] or {})) for e, code in (entry_code or {}).items()}
        if (source is None and not own) == (not binaries) or (binaries and own):
            raise InputError(f"kernel {name!r}: give either source= (and/or entry_code=) or binaries=")
        stray = sorted(set(own) - set(entries))
        if stray:
            raise InputError(f"kernel {name!r}: entry_code names {stray}, which are not among its entries {list(entries)}")
        if source is None and own and any(e not in own for e in entries):
            raise InputError(f"kernel {name!r}: entries {[e for e in entries if e not in own]} have no code: "
                             "give source= or an entry_code for each")
        if (source is not None or own) and language is None:
            language = "c"
        launches = tuple(launch) if isinstance(launch, (list, tuple)) else (launch,) * len(entries)
        if len(launches) != len(entries):
            raise InputError(f"kernel {name!r}: {len(launches)} launch configurations for {len(entries)} entries")
        return KernelDef(name, device, tuple(entries), language, source, tuple(binaries), dict(options or {}),
                         launches, own)  # type: ignore[arg-type]  # launches: one mapping (or None) per entry

    def call(self, kernel: KernelDef, inputs: Sequence[Value], outputs: Sequence[tuple[Any, Sequence[int | str]]],
             *, symbols: Sequence[str] = (), workspace: int | str = 0,
             share_map: Mapping[int, int] | None = None) -> list[Value]:
        """Call ``kernel`` on ``inputs``; ``outputs`` are (dtype, shape) pairs on the kernel's device."""
        for v in inputs:
            if v.builder_id != id(self):
                raise InputError(f"call to {kernel.name!r}: a value from another builder was passed")
        for s in symbols:
            if s not in self._symbols:
                raise InputError(f"call to {kernel.name!r}: unknown symbol {s!r} (graph symbols: {self._symbols})")
        sigs = [_sig(dt, shape, kernel.device) for dt, shape in outputs]
        start = len(self._inputs) + len(self._weights) + sum(len(c[2]) for c in self._calls)
        self._calls.append((kernel, list(inputs), sigs, {"symbols": tuple(symbols), "workspace": workspace,
                                                          "share_map": dict(share_map or {})}))
        return [Value(start + i, s, id(self)) for i, s in enumerate(sigs)]

    def copy(self, value: Value, device: str) -> Value:
        """A builtin cross-device copy of ``value`` to ``device`` (a kind)."""
        kdef = KernelDef(f"copy_{value.signature.device}_to_{device}", device, (), None, None, (), {}, ())
        sig = TensorSignature(device, value.signature.dtype, value.signature.shape)
        start = len(self._inputs) + len(self._weights) + sum(len(c[2]) for c in self._calls)
        self._calls.append((kdef, [value], [sig], {"symbols": (), "workspace": 0, "share_map": {}, "copy": True}))
        return Value(start, sig, id(self))

    def output(self, value: Value, name: str | None = None) -> None:
        self._outputs.append((name or f"output_{len(self._outputs)}", value))

    # -- building ------------------------------------------------------------------------------
    def members(self) -> dict[str, Any]:
        """Every bundle member (compiling sources through their plugins)."""
        if not self._outputs:
            raise InputError("the graph has no outputs: call output(value)")
        kernels: list[KernelMeta] = []
        binaries: dict[str, Any] = {}
        task_of: dict[str, int] = {}
        compiled: dict[Any, tuple[list[BinaryMeta], list[tuple[str, Any]]]] = {}
        instructions: list[tuple[int, list[int], list[int]]] = []
        tensor_sigs = [s for _, s in self._inputs] + [_sig(a.dtype, a.shape, d) for _, a, d in self._weights]
        for kdef, ins, outs, opts in self._calls:
            in_sigs = tuple(v.signature for v in ins)
            if opts.get("copy"):
                meta = KernelMeta(kdef.name, kdef.device, (), in_sigs, tuple(outs), {}, parse_expr(0), (), "copy")
            else:
                cands = self._candidates(kdef, compiled)
                meta = KernelMeta(kdef.name, kdef.device, opts["symbols"], in_sigs, tuple(outs), opts["share_map"],
                                  parse_expr(opts["workspace"]), tuple(c for c, _ in cands))
            key = json.dumps(meta.to_json(), sort_keys=True) + str(id(kdef))
            if key not in task_of:
                task_of[key] = len(kernels)
                kernels.append(meta)
                if not opts.get("copy"):
                    for _, files in self._candidates(kdef, compiled):
                        for path, data in files:
                            binaries[f"kernels/{task_of[key]}/{path}"] = data
            first = len(tensor_sigs)
            tensor_sigs.extend(outs)
            instructions.append((task_of[key], [v.index for v in ins], list(range(first, first + len(outs)))))
        return self._assemble(kernels, binaries, instructions, tensor_sigs)

    def _candidates(self, kdef: KernelDef, cache: dict[Any, Any]) -> list[tuple[CandidateMeta, list[tuple[str, Any]]]]:
        out = []
        for entry, launch in zip(kdef.entries, kdef.launch):
            lm = None
            if launch is not None:
                lm = LaunchMeta(tuple(parse_expr(v) for v in launch["grid"]),  # type: ignore[arg-type]
                                tuple(parse_expr(v) for v in launch["block"]),  # type: ignore[arg-type]
                                parse_expr(launch.get("shared_memory", 0)))
            if entry in kdef.entry_code:
                source, options = kdef.entry_code[entry]
                key: Any = (id(kdef), entry)
                if key not in cache:
                    cache[key] = self._compiled(kdef, source, options, f"{kdef.name}.{entry}")
            else:
                key = id(kdef)
                if key not in cache:
                    cache[key] = (self._compiled(kdef, kdef.source, kdef.options, kdef.name) if kdef.source is not None
                                  else self._given(kdef))
            metas, files = cache[key]
            out.append((CandidateMeta(entry, tuple(metas), lm), files))
        return out

    def _compiled(self, kdef: KernelDef, source: str, options: Mapping[str, Any],
                  stem: str) -> tuple[list[BinaryMeta], list[tuple[str, Any]]]:
        """``source`` built by the kernel's plugin, shipped beside its binaries under ``stem``."""
        files: list[tuple[str, Any]] = []
        metas: list[BinaryMeta] = []
        backend = self.registry.backend(kdef.device)
        for i, b in enumerate(backend.compile(source, kdef.language or "c", options)):
            path = f"{stem}{_suffix(b.format, b.path)}"
            if any(m.path == path for m in metas):  # e.g. two cubins for two archs: name the target
                path = f"{stem}.{_file_part(b.target)}{_suffix(b.format, b.path)}"
            if any(m.path == path for m in metas):
                path = f"{stem}.{i}{_suffix(b.format, b.path)}"
            metas.append(BinaryMeta(b.format, b.target, path))
            files.append((path, bytes(b.data)))
        fmt = _SOURCE_FORMATS.get(kdef.language or "c", f"{kdef.language}-source")
        if not any(m.format == fmt for m in metas):  # ship the source unless compile() did
            src_path = f"{stem}{_SOURCE_SUFFIX.get(kdef.language or 'c', '.src')}"
            metas.append(BinaryMeta(fmt, "any", src_path))
            files.append((src_path, source.encode("utf-8")))
        return metas, files

    @staticmethod
    def _given(kdef: KernelDef) -> tuple[list[BinaryMeta], list[tuple[str, Any]]]:
        files: list[tuple[str, Any]] = []
        metas: list[BinaryMeta] = []
        for i, given in enumerate(kdef.binaries):
            path = str(given.get("path") or f"{kdef.name}.{i}.bin")
            metas.append(BinaryMeta(str(given["format"]), str(given.get("target", "any")), path))
            files.append((path, bytes(given["data"])))
        return metas, files

    def _assemble(self, kernels: list[KernelMeta], binaries: dict[str, Any],
                  instructions: list[tuple[int, list[int], list[int]]],
                  tensor_sigs: list[TensorSignature]) -> dict[str, Any]:
        outputs = [v.index for _, v in self._outputs]
        last_use: dict[int, int] = {}
        for pos, (_, ins, outs) in enumerate(instructions):
            for t in (*ins, *outs):
                last_use[t] = pos
        n_fixed = len(self._inputs) + len(self._weights)
        frees: list[list[int]] = [[] for _ in instructions]
        for t, pos in last_use.items():
            if t >= n_fixed and t not in outputs:
                frees[pos].append(t)
        execution = GraphExecution(
            weights_index=tuple(range(len(self._inputs), n_fixed)),
            inputs_index=tuple(range(len(self._inputs))),
            instructions=tuple(GraphExecutionInstruction(k, tuple(i), tuple(o), tuple(sorted(f)))
                               for (k, i, o), f in zip(instructions, frees)),
            outputs_index=tuple(outputs),
            tensor_device=tuple(s.device for s in tensor_sigs),
            tensor_signatures=tuple(tensor_sigs),
        )
        share_map = self._graph_share_map(kernels, instructions)
        graph_json = json.dumps([execution.to_json(), [k.to_json() for k in kernels]], sort_keys=True)
        meta = GraphMetaData(
            inputs=tuple(s for _, s in self._inputs),
            outputs=tuple(tensor_sigs[t] for t in outputs),
            engine_version=_engine_version(),
            num_kernels=len(kernels),
            graph_hash=hashlib.sha256(graph_json.encode()).hexdigest()[:16],
            share_map=share_map,
            symbols=tuple(self._symbols),
            input_names=tuple(n for n, _ in self._inputs),
            output_names=tuple(n for n, _ in self._outputs),
        )
        return bundle_members(meta=meta, execution=execution, kernels=kernels, binaries=binaries,
                              weights=[(n, a) for n, a, _ in self._weights],
                              graph_string=self._graph_string(kernels, instructions, tensor_sigs))

    def _graph_share_map(self, kernels: list[KernelMeta], instructions: list[tuple[int, list[int], list[int]]]) -> dict[int, int]:
        root: dict[int, int] = {}
        for k, ins, outs in instructions:
            for o, i in kernels[k].share_map.items():
                root[outs[o]] = root.get(ins[i], ins[i])
        return {pos: root[v.index] for pos, (_, v) in enumerate(self._outputs)
                if v.index in root and root[v.index] < len(self._inputs)}

    def _graph_string(self, kernels: list[KernelMeta], instructions: list[tuple[int, list[int], list[int]]],
                      sigs: list[TensorSignature]) -> str:
        def t(i: int) -> str:
            return f"%{i}:{sigs[i].dtype.name}{sigs[i].shape_str()}"

        lines = [f"graph {self.name}({', '.join(f'{n}={t(i)}' for i, (n, _) in enumerate(self._inputs))})"]
        for j, (name, _, _) in enumerate(self._weights):
            lines.append(f"  weight {name} = {t(len(self._inputs) + j)}")
        for k, ins, outs in instructions:
            lines.append(f"  {', '.join(t(o) for o in outs)} = {kernels[k].name}({', '.join(f'%{i}' for i in ins)})")
        lines.append(f"  return {', '.join(f'{n}=%{v.index}' for n, v in self._outputs)}")
        return "\n".join(lines) + "\n"

    def to_bytes(self) -> bytes:
        return bundle_to_bytes(self.members(), engine_version=_engine_version())

    def build(self, device: str | None = None) -> "CompiledGraph":
        """Compile everything and return the loaded ``CompiledGraph``."""
        from engine.runtime.compiled_graph import CompiledGraph

        return CompiledGraph(read_bundle(self.to_bytes()), device=device, registry=self._registry)

    def save(self, path: str | Path, *, form: Literal["zip", "dir"] = "zip", overwrite: bool = False) -> None:
        """Write the bundle atomically. An existing ``path`` is replaced only when it is a bundle (or an
        empty directory); anything else raises ``SaveTargetError`` unless ``overwrite``."""
        from engine.bundle.save import write_bundle

        write_bundle(Path(path), self.members(), engine_version=_engine_version(), form=form, overwrite=overwrite)


def _file_part(target: str) -> str:
    """``target`` as part of a member name (``sm_90`` stays; anything unusual becomes ``_``)."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in target) or "any"


def _suffix(fmt: str, path: str) -> str:
    suffix = Path(path).suffix
    return suffix or {"elf-so": ".so", "cubin": ".cubin", "ptx": ".ptx", "hsaco": ".hsaco"}.get(fmt, ".bin")


def _engine_version() -> str:
    from engine.runtime.compiled_graph import ENGINE_VERSION

    return ENGINE_VERSION
