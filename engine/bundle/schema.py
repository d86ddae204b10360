"""The bundle's metadata as frozen attrs classes, with named constructors from JSON.

Names follow the reference runtime (``GraphMetaData``, ``GraphExecution``,
``GraphExecutionInstruction``, ``TensorSignature``). ``from_json`` structures untrusted JSON with
path-precise errors; ``to_json`` produces what the writer stores. Cross-member consistency (indices
in range, devices agreeing) is checked in ``engine.bundle.validate``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import attrs

from engine.bundle.jsonread import INT64_MAX, MAX_DECIMAL_DIGITS, JsonReader, clip, key_path, parse_decimal
from engine.device import KIND_PATTERN
from engine.dtypes import DTYPES, DType
from engine.expr import Expr, parse_expr

__all__ = [
    "TensorSignature",
    "GraphMetaData",
    "GraphExecutionInstruction",
    "GraphExecution",
    "BinaryMeta",
    "LaunchMeta",
    "CandidateMeta",
    "KernelMeta",
    "WeightEntry",
    "SYMBOL_PATTERN",
    "MAX_RANK",
    "MAX_TENSORS",
]

SYMBOL_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
ENTRY_PATTERN = SYMBOL_PATTERN
MAX_RANK = 32
MAX_TENSORS = 1_000_000
MAX_CANDIDATES = 256
MAX_SYMBOLS = 64
_RESERVED = {"ceil_div", "min", "max"}


def _kind(r: JsonReader, value: Any, path: str) -> str:
    r.str_(value, path)
    if not KIND_PATTERN.match(value):
        raise r.error(path, f"invalid device kind {clip(value)} (a lowercase identifier such as 'cpu' or 'cuda')")
    return value


def _dtype(r: JsonReader, value: Any, path: str) -> DType:
    r.str_(value, path)
    if value not in DTYPES:
        raise r.error(path, f"unknown dtype {clip(value)}; expected one of {', '.join(DTYPES)}")
    return DTYPES[value]


def _expr(r: JsonReader, value: Any, path: str) -> Expr:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise r.error(path, f"expected an integer or an expression string, got {type(value).__name__}")
    return parse_expr(value, member=r.member, path=path)


def _size(r: JsonReader, value: Any, path: str) -> Expr:
    """A shape entry, workspace or launch dimension: negative is the bundle's mistake when it is a
    constant, so it is refused here rather than at the first run (where it would read as the
    input's fault). Symbolic ones are checked at each key."""
    e = _expr(r, value, path)
    if e.is_constant and e.constant < 0:  # type: ignore[operator]
        raise r.error(path, f"expected a non-negative size, got {e.constant}")
    return e


def _symbol(r: JsonReader, value: Any, path: str) -> str:
    r.str_(value, path)
    if not SYMBOL_PATTERN.match(value) or value in _RESERVED:
        raise r.error(path, f"invalid symbol name {clip(value)}")
    return value


def _index_map(r: JsonReader, value: Any, path: str) -> dict[int, int]:
    """A share_map: keys are indices written as plain ASCII decimals, each index once."""
    r.obj(value, path)
    out: dict[int, int] = {}
    spelled: dict[int, str] = {}
    for key, target in value.items():
        sub = key_path(path, key)
        index = parse_decimal(key)
        if index is None:
            raise r.error(sub, f"key {clip(key)} is not an index: expected 1 to {MAX_DECIMAL_DIGITS} ASCII digits "
                               f"(0-9) below 2**63")
        if index in spelled:  # "1" and "01" are one index: keeping either would silently drop the other
            raise r.error(sub, f"key {clip(key)} repeats index {index} (also written {clip(spelled[index])})")
        spelled[index] = key
        out[index] = r.int_(target, sub)
    return out


def checked_nbytes(itemsize: int, shape: Sequence[int], limit: int = INT64_MAX) -> int | None:
    """``itemsize * prod(shape)``, or None once it passes ``limit``: the product of 32 untrusted
    dimensions can have hundreds of digits, which no size needs and no message should print."""
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total > limit:
            return None
    return total


def _expr_json(e: Expr) -> int | str:
    return e.constant if e.is_constant else e.source  # type: ignore[return-value]


@attrs.frozen
class TensorSignature:
    device: str
    dtype: DType
    shape: tuple[Expr, ...]

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "TensorSignature":
        r.obj(value, path, required=("device", "dtype", "shape"))
        shape = r.list_(value["shape"], f"{path}.shape", lambda v, p: _size(r, v, p), max_len=MAX_RANK)
        return cls(_kind(r, value["device"], f"{path}.device"), _dtype(r, value["dtype"], f"{path}.dtype"), shape)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype.name, "shape": [_expr_json(e) for e in self.shape]}

    @property
    def symbols(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for e in self.shape:
            out |= e.symbols
        return out

    def shape_str(self) -> str:
        return "[" + ", ".join(e.source for e in self.shape) + "]"


@attrs.frozen
class GraphMetaData:
    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    engine_version: str
    num_kernels: int
    graph_hash: str
    share_map: Mapping[int, int] = attrs.field(factory=dict)
    symbols: tuple[str, ...] = ()
    #: Optional names of the graph's inputs and outputs (extension; positional names otherwise).
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str = "$") -> "GraphMetaData":
        r.obj(value, path, required=("inputs", "outputs", "num_kernels"))
        sig = lambda v, p: TensorSignature.from_json(r, v, p)  # noqa: E731
        inputs = r.list_(value["inputs"], f"{path}.inputs", sig, max_len=MAX_TENSORS)
        outputs = r.list_(value["outputs"], f"{path}.outputs", sig, max_len=MAX_TENSORS)
        names_in = r.str_list(value.get("input_names", []), f"{path}.input_names")
        names_out = r.str_list(value.get("output_names", []), f"{path}.output_names")
        if names_in and len(names_in) != len(inputs):
            raise r.error(f"{path}.input_names", f"{len(names_in)} names for {len(inputs)} inputs")
        if names_out and len(names_out) != len(outputs):
            raise r.error(f"{path}.output_names", f"{len(names_out)} names for {len(outputs)} outputs")
        symbols = r.list_(value.get("symbols", []), f"{path}.symbols", lambda v, p: _symbol(r, v, p),
                          max_len=MAX_SYMBOLS)
        if len(set(symbols)) != len(symbols):
            raise r.error(f"{path}.symbols", f"duplicate symbol names in {list(symbols)}")
        return cls(
            inputs=inputs,
            outputs=outputs,
            engine_version=r.str_(value.get("engine_version", ""), f"{path}.engine_version"),
            num_kernels=r.int_(value["num_kernels"], f"{path}.num_kernels", maximum=MAX_TENSORS),
            graph_hash=r.str_(value.get("graph_hash", ""), f"{path}.graph_hash"),
            share_map=_index_map(r, value.get("share_map", {}), f"{path}.share_map"),
            symbols=symbols,
            input_names=names_in,
            output_names=names_out,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "engine_version": self.engine_version,
            "num_kernels": self.num_kernels,
            "graph_hash": self.graph_hash,
            "share_map": {str(k): v for k, v in sorted(self.share_map.items())},
            "symbols": list(self.symbols),
        }
        if self.input_names:
            out["input_names"] = list(self.input_names)
        if self.output_names:
            out["output_names"] = list(self.output_names)
        return out


@attrs.frozen
class GraphExecutionInstruction:
    task_idx: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    free: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "GraphExecutionInstruction":
        r.obj(value, path, required=("task_idx", "inputs", "outputs"))
        return cls(
            task_idx=r.int_(value["task_idx"], f"{path}.task_idx"),
            inputs=r.int_list(value["inputs"], f"{path}.inputs"),
            outputs=r.int_list(value["outputs"], f"{path}.outputs"),
            free=r.int_list(value.get("free", []), f"{path}.free"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"task_idx": self.task_idx, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "free": list(self.free)}


@attrs.frozen
class GraphExecution:
    weights_index: tuple[int, ...]
    inputs_index: tuple[int, ...]
    instructions: tuple[GraphExecutionInstruction, ...]
    outputs_index: tuple[int, ...]
    tensor_device: tuple[str, ...]
    tensor_signatures: tuple[TensorSignature, ...]

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str = "$") -> "GraphExecution":
        r.obj(value, path, required=("weights_index", "inputs_index", "instructions", "outputs_index",
                                     "tensor_device", "tensor_signatures"))
        return cls(
            weights_index=r.int_list(value["weights_index"], f"{path}.weights_index", max_len=MAX_TENSORS),
            inputs_index=r.int_list(value["inputs_index"], f"{path}.inputs_index", max_len=MAX_TENSORS),
            instructions=r.list_(value["instructions"], f"{path}.instructions",
                                 lambda v, p: GraphExecutionInstruction.from_json(r, v, p), max_len=MAX_TENSORS),
            outputs_index=r.int_list(value["outputs_index"], f"{path}.outputs_index", max_len=MAX_TENSORS),
            tensor_device=r.list_(value["tensor_device"], f"{path}.tensor_device", lambda v, p: _kind(r, v, p),
                                  max_len=MAX_TENSORS),
            tensor_signatures=r.list_(value["tensor_signatures"], f"{path}.tensor_signatures",
                                      lambda v, p: TensorSignature.from_json(r, v, p), max_len=MAX_TENSORS),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "weights_index": list(self.weights_index),
            "inputs_index": list(self.inputs_index),
            "instructions": [i.to_json() for i in self.instructions],
            "outputs_index": list(self.outputs_index),
            "tensor_device": list(self.tensor_device),
            "tensor_signatures": [s.to_json() for s in self.tensor_signatures],
        }


@attrs.frozen
class BinaryMeta:
    format: str
    target: str
    path: str

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "BinaryMeta":
        r.obj(value, path, required=("format", "target", "path"))
        fmt = r.str_(value["format"], f"{path}.format")
        if not fmt or len(fmt) > 64:
            raise r.error(f"{path}.format", f"invalid binary format {clip(fmt)}")
        return cls(fmt, r.str_(value["target"], f"{path}.target"), r.str_(value["path"], f"{path}.path"))

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "target": self.target, "path": self.path}


@attrs.frozen
class LaunchMeta:
    grid: tuple[Expr, Expr, Expr]
    block: tuple[Expr, Expr, Expr]
    shared_memory: Expr

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "LaunchMeta":
        r.obj(value, path, required=("grid", "block"))

        def dims(key: str) -> tuple[Expr, Expr, Expr]:
            if len(r.expect(value[key], list, f"{path}.{key}")) != 3:  # counted before any is parsed
                raise r.error(f"{path}.{key}", f"expected 3 dimensions, got {len(value[key])}")
            return r.list_(value[key], f"{path}.{key}", lambda v, p: _size(r, v, p))  # type: ignore[return-value]

        return cls(dims("grid"), dims("block"), _size(r, value.get("shared_memory", 0), f"{path}.shared_memory"))

    def to_json(self) -> dict[str, Any]:
        return {"grid": [_expr_json(e) for e in self.grid], "block": [_expr_json(e) for e in self.block],
                "shared_memory": _expr_json(self.shared_memory)}


@attrs.frozen
class CandidateMeta:
    entry: str
    binaries: tuple[BinaryMeta, ...]
    launch: LaunchMeta | None = None

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "CandidateMeta":
        r.obj(value, path, required=("entry", "binaries"))
        entry = r.str_(value["entry"], f"{path}.entry")
        if not ENTRY_PATTERN.match(entry):
            raise r.error(f"{path}.entry", f"invalid entry symbol {clip(entry)}")
        binaries = r.list_(value["binaries"], f"{path}.binaries", lambda v, p: BinaryMeta.from_json(r, v, p),
                           max_len=64)
        if not binaries:
            raise r.error(f"{path}.binaries", "a candidate needs at least one binary")
        launch = value.get("launch")
        return cls(entry, binaries, None if launch is None else LaunchMeta.from_json(r, launch, f"{path}.launch"))

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "binaries": [b.to_json() for b in self.binaries],
                "launch": None if self.launch is None else self.launch.to_json()}


@attrs.frozen
class KernelMeta:
    name: str
    device: str
    symbols: tuple[str, ...]
    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    share_map: Mapping[int, int]
    workspace: Expr
    candidates: tuple[CandidateMeta, ...]
    builtin: str | None = None

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str = "$") -> "KernelMeta":
        r.obj(value, path, required=("name", "device", "inputs", "outputs"))
        sig = lambda v, p: TensorSignature.from_json(r, v, p)  # noqa: E731
        builtin = value.get("builtin")
        if builtin is not None and r.str_(builtin, f"{path}.builtin") != "copy":
            raise r.error(f"{path}.builtin", f"unknown builtin {clip(builtin)}; this engine knows 'copy'")
        candidates = r.list_(value.get("candidates", []), f"{path}.candidates",
                             lambda v, p: CandidateMeta.from_json(r, v, p), max_len=MAX_CANDIDATES)
        if builtin is None and not candidates:
            raise r.error(f"{path}.candidates", "a kernel needs at least one candidate (or builtin 'copy')")
        if builtin is not None and candidates:
            raise r.error(f"{path}.candidates", "a builtin task has no candidates")
        symbols = r.list_(value.get("symbols", []), f"{path}.symbols", lambda v, p: _symbol(r, v, p),
                          max_len=MAX_SYMBOLS)
        return cls(
            name=r.str_(value["name"], f"{path}.name"),
            device=_kind(r, value["device"], f"{path}.device"),
            symbols=symbols,
            inputs=r.list_(value["inputs"], f"{path}.inputs", sig, max_len=4096),
            outputs=r.list_(value["outputs"], f"{path}.outputs", sig, max_len=4096),
            share_map=_index_map(r, value.get("share_map", {}), f"{path}.share_map"),
            workspace=_size(r, value.get("workspace", 0), f"{path}.workspace"),
            candidates=candidates,
            builtin=builtin,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "device": self.device,
            "symbols": list(self.symbols),
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "share_map": {str(k): v for k, v in sorted(self.share_map.items())},
            "workspace": _expr_json(self.workspace),
            "candidates": [c.to_json() for c in self.candidates],
        }
        if self.builtin is not None:
            out["builtin"] = self.builtin
        return out


@attrs.frozen
class WeightEntry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @classmethod
    def from_json(cls, r: JsonReader, value: Any, path: str) -> "WeightEntry":
        r.obj(value, path, required=("name", "dtype", "shape", "offset", "nbytes"))
        entry = cls(
            name=r.str_(value["name"], f"{path}.name"),
            dtype=_dtype(r, value["dtype"], f"{path}.dtype"),
            shape=r.int_list(value["shape"], f"{path}.shape", max_len=MAX_RANK),
            offset=r.int_(value["offset"], f"{path}.offset"),
            nbytes=r.int_(value["nbytes"], f"{path}.nbytes"),
        )
        expected = checked_nbytes(entry.dtype.nbytes, entry.shape)
        if expected != entry.nbytes:
            size = f"{expected} bytes" if expected is not None else "more than 2**63-1 bytes"
            raise r.error(f"{path}.nbytes", f"{entry.nbytes} bytes does not match shape {list(entry.shape)} "
                                            f"of {entry.dtype.name} ({size})")
        return entry

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes}
