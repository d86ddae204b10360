"""Shared steps of the commands that open, load and feed a bundle.

The split between exit codes 2 and 1 is made here. What the person typed is checked before the
engine is asked for anything: the path exists and is a bundle, ``--device`` names a kind the
bundle uses and this machine has, ``--input`` files match the graph's signatures, ``--symbol``
names the graph's symbols. Those are usage errors (2). What goes wrong after that (a damaged
bundle, a kernel failure, a plugin that cannot serve a kind the bundle needs) is the engine's
error and a failed run (1).
"""

from __future__ import annotations

import itertools
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from engine.bundle.zipformat import ZIP_MAGIC
from engine.cli.args import InputSpec, UsageError, parse_input, parse_symbols

if TYPE_CHECKING:
    from engine.bundle.contents import BundleContents
    from engine.bundle.schema import GraphMetaData, TensorSignature
    from engine.device import Device
    from engine.plugins import Registry
    from engine.runtime.compiled_graph import CompiledGraph

__all__ = [
    "registry_of",
    "check_bundle_path",
    "read_contents",
    "resolve_device",
    "load_graph",
    "input_names",
    "output_names",
    "make_inputs",
    "random_array",
    "key_grid",
    "synchronize",
    "check_output_path",
    "check_input_memory",
    "largest_key",
    "bundle_size",
]

_NPY_MAGIC = b"\x93NUMPY"


def registry_of(args: Any) -> "Registry":
    """The plugin registry a command uses: the one ``main(registry=...)`` was given, else the default."""
    registry = getattr(args, "registry", None)
    if registry is not None:
        return registry
    from engine.plugins import default_registry

    return default_registry()


def check_bundle_path(path: str) -> Path:
    """The bundle path, or a ``UsageError`` when it does not exist or is plainly not a bundle."""
    from engine.bundle.foreign import check_not_a_model
    from engine.errors import UnconvertedModelError

    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path}: no such file or directory")
    try:
        check_not_a_model(path)
    except UnconvertedModelError as exc:
        raise UsageError(str(exc)) from None
    if p.is_dir():
        if not (p / "manifest.json").is_file():
            raise UsageError(f"{path}: not a bundle (a directory bundle has a manifest.json)")
        return p
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if head not in ZIP_MAGIC:
        raise UsageError(f"{path}: not a bundle (a .cgb bundle is a zip archive with a manifest.json)")
    try:
        with zipfile.ZipFile(p) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return p  # a damaged zip: the bundle reader says what is wrong with it (exit code 1)
    if "manifest.json" not in names:
        raise UsageError(f"{path}: not a bundle (a zip archive without manifest.json)")
    return p


def bundle_size(path: Path) -> int:
    """A bundle's size on disk in bytes: the ``.cgb`` file, or every file of a directory bundle.

    The one figure every command shows for "how big is this bundle" (``engine inspect``, ``engine
    demo``), always through ``format_bytes``: the same file reads the same everywhere.
    """
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def read_contents(path: Path) -> "BundleContents":
    """Read and validate the bundle without any plugin (metadata and binaries are hash-checked)."""
    from engine.bundle.contents import read_bundle

    return read_bundle(path)


def read_outline(path: Path) -> "_Outline":
    """The bundle's metadata, validated without any plugin; ``.kinds`` are the device kinds it runs on."""
    contents = read_contents(path)
    contents.archive.close()
    return _Outline(contents.meta, contents.analysis.kinds)


class _Outline:
    """What commands need to know before loading: the metadata and the device kinds."""

    __slots__ = ("meta", "kinds")

    def __init__(self, meta: "GraphMetaData", kinds: Sequence[str]):
        self.meta = meta
        self.kinds = tuple(kinds)


def open_graph(path: Path, device_text: str | None, kinds: Sequence[str], registry: "Registry") -> "CompiledGraph":
    """``--device`` checked (exit 2 when absent), then the graph loaded (engine errors: exit 1)."""
    return load_graph(path, resolve_device(device_text, kinds, registry), registry)


def resolve_device(text: str | None, kinds: Sequence[str], registry: "Registry") -> "Device | None":
    """``--device`` checked against the bundle's kinds and this machine's devices (UsageError if absent)."""
    if text is None:
        return None
    from engine.device import Device
    from engine.errors import InputError
    from engine.plugins import KNOWN_DISTRIBUTIONS

    try:
        device = Device.parse(text)
    except InputError as exc:
        raise UsageError(f"--device {text!r}: {exc}") from None
    # First whether this machine knows the kind at all: "--device tpu" is about the missing plugin,
    # whatever the bundle holds; then whether the bundle has kernels for it.
    every = registry.devices()
    rows = [r for r in every if r.kind == device.kind]
    usable = [r for r in rows if r.available]
    here = ", ".join(dict.fromkeys(r.kind for r in every if r.available)) or "none"
    if not rows:
        hint = KNOWN_DISTRIBUTIONS.get(device.kind)
        install = f"install '{hint}'" if hint else f"install a plugin that provides {device.kind!r}"
        raise UsageError(f"--device {device}: no plugin provides device kind {device.kind!r} on this machine "
                         f"({install}; usable kinds here: {here}; 'engine devices' lists what is installed)")
    if device.kind not in kinds:
        raise UsageError(f"--device {device}: the bundle only runs on {', '.join(kinds)} (it has no kernels for "
                         f"{device.kind!r})")
    if not usable:
        raise UsageError(f"--device {device}: device kind {device.kind!r} is not usable here: {rows[0].reason} "
                         f"(usable kinds here: {here})")
    count = usable[0].device_count
    if device.index >= count:
        have = f"{device.kind}:0" if count == 1 else f"{device.kind}:0 to {device.kind}:{count - 1}"
        raise UsageError(f"--device {device}: no such device (this machine has {have})")
    return device


def load_graph(path: Path, device: "Device | None", registry: "Registry", *,
               verify_weights: bool = False) -> "CompiledGraph":
    """Load for running; engine errors (damaged bundle, missing plugin for a needed kind) mean exit 1."""
    import engine

    return engine.load_compiled_graph(path, device=None if device is None else str(device), registry=registry,
                                      verify_weights=verify_weights)


def input_names(meta: "GraphMetaData") -> tuple[str, ...]:
    return meta.input_names or tuple(f"input_{i}" for i in range(len(meta.inputs)))


def output_names(meta: "GraphMetaData") -> tuple[str, ...]:
    return meta.output_names or tuple(f"output_{i}" for i in range(len(meta.outputs)))


def _index_of(spec: InputSpec, names: Sequence[str]) -> int:
    if spec.name is None:
        if len(names) != 1:
            raise UsageError(f"--input {spec.text!r}: expected NAME=FILE.npy (the graph has {len(names)} inputs: "
                             f"{', '.join(names)})")
        return 0
    if spec.name in names:
        return names.index(spec.name)
    if spec.name.isascii() and spec.name.isdigit() and len(spec.name) <= 18 and int(spec.name) < len(names):
        return int(spec.name)
    raise UsageError(f"--input {spec.text!r}: the graph has no input {spec.name!r} (inputs: {', '.join(names)})")


def _load_array(spec: InputSpec, name: str) -> np.ndarray:
    p = Path(spec.path)
    if not p.is_file():
        raise UsageError(f"--input {spec.text!r}: {spec.path}: no such file")
    where = f"--input {spec.text!r}: {spec.path}"
    try:
        with open(p, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise UsageError(f"{where}: cannot read: {exc.strerror or exc}") from None
    if not head.startswith((_NPY_MAGIC, *ZIP_MAGIC)):
        # numpy would call any other file "pickled data" and suggest allow_pickle: never for inputs.
        raise UsageError(f"{where}: not a .npy file (no numpy header); save each input with np.save(path, array)")
    try:
        value = np.load(p, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # an object array: Python objects, not numbers
            raise UsageError(f"{where}: holds Python objects (dtype object), not numbers; save a numeric array "
                             f"of the input's dtype with np.save(path, array)") from None
        raise UsageError(f"{where}: cannot read it as a .npy array: {exc}") from None
    except (OSError, EOFError) as exc:
        raise UsageError(f"{where}: cannot read it as a .npy array: {exc}") from None
    if not isinstance(value, np.ndarray):  # an .npz archive
        value.close()
        raise UsageError(f"--input {spec.text!r}: {spec.path} is an .npz archive; give one .npy file per input")
    return value


def _bind_from_array(name: str, spec_text: str, sig: "TensorSignature", array: np.ndarray,
                     bound: dict[str, int], sources: dict[str, str]) -> None:
    """Check an input file against the signature and bind its symbols (UsageError on a mismatch)."""
    where = f"--input {spec_text!r}"
    if array.dtype != sig.dtype.numpy:
        raise UsageError(f"{where}: the array is {array.dtype}, input {name!r} is {sig.dtype.name}; convert it "
                         f"(np.save(path, a.astype('{sig.dtype.name}')))")
    if array.ndim != len(sig.shape):
        raise UsageError(f"{where}: the array has shape {list(array.shape)}, input {name!r} is "
                         f"{sig.dtype.name}{sig.shape_str()} ({len(sig.shape)} dimensions)")
    for d, (e, n) in enumerate(zip(sig.shape, array.shape)):
        if e.is_constant:
            if e.constant != n:
                raise UsageError(f"{where}: dimension {d} is {n}, input {name!r} is {sig.dtype.name}{sig.shape_str()}")
        elif e.source in bound and bound[e.source] != n:
            raise UsageError(f"{where}: dimension {d} gives {e.source}={n}, but {sources[e.source]} gives "
                             f"{e.source}={bound[e.source]}")
        elif e.source not in bound:
            bound[e.source] = int(n)
            sources[e.source] = where


def _symbol_culprit(env: dict[str, int], symbols: Sequence[str], sources: dict[str, str] | None) -> str:
    """What the person typed that set these symbols: ``--symbol batch=1000000000000``."""
    parts = []
    for s in symbols:
        where = (sources or {}).get(s, f"--symbol {s}")
        parts.append(f"{where}={env[s]}" if where == f"--symbol {s}" else f"{s}={env[s]} (from {where})")
    return ", ".join(parts) or "the static shapes"


def check_input_memory(meta: "GraphMetaData", env: dict[str, int], *, indices: Sequence[int] | None = None,
                       sources: dict[str, str] | None = None) -> None:
    """Before numpy allocates the inputs this command makes (``--random``, or zeros for tuning): their
    exact sizes, in Python integers, against this machine's memory.

    Without it a typo like ``--symbol batch=1000000000000`` reaches numpy as a ``MemoryError`` or an
    "array is too big" ``ValueError`` (reported as internal errors), and a value whose sizes overflow
    int64 is blamed on the bundle's expressions. Raises ``InputError`` (exit 1) naming the symbol
    values as typed, the input, the bytes needed and the memory available.
    """
    import math
    import os

    from engine.device import Device
    from engine.errors import InputError, format_size
    from engine.expr import ExprError, evaluate_all
    from engine.runtime.plan import memory_limits

    names = input_names(meta)
    chosen = range(len(meta.inputs)) if indices is None else indices
    needs: list[tuple[int, str, "TensorSignature"]] = []
    for i in chosen:
        sig = meta.inputs[i]
        culprit = _symbol_culprit(env, [s for s in meta.symbols if s in sig.symbols], sources)
        try:
            shape = evaluate_all(sig.shape, env)
        except ExprError:
            raise InputError(f"{culprit}: input {names[i]!r} ({sig.dtype.name}{sig.shape_str()}) would have a "
                             f"dimension beyond int64 at this value; give a smaller value") from None
        if any(d < 0 for d in shape):
            raise InputError(f"{culprit}: input {names[i]!r} ({sig.dtype.name}{sig.shape_str()}) would have a "
                             f"negative dimension {list(shape)}")
        needs.append((math.prod(shape) * sig.dtype.nbytes, names[i], sig))
    if not needs:
        return
    limit = memory_limits({"cpu": Device.parse("cpu")}, {"cpu"}, os.environ)["cpu"]
    total = sum(n for n, _, _ in needs)
    if total <= limit.nbytes:
        return
    nbytes, name, sig = max(needs, key=lambda t: t[0])
    culprit = _symbol_culprit(env, [s for s in meta.symbols if s in sig.symbols], sources)
    size = f"{nbytes} bytes ({format_size(nbytes)})" if nbytes < 2**80 else "more than 2**80 bytes"
    others = f"; {format_size(total)} for all {len(needs)} inputs" if len(needs) > 1 else ""
    raise InputError(f"{culprit}: input {name!r} ({sig.dtype.name}{sig.shape_str()}) would need {size}{others}, "
                     f"more than this machine's memory allows ({format_size(limit.nbytes)}: {limit.source}); "
                     f"give a smaller value")


def largest_key(values: dict[str, list[int]], symbols: Sequence[str]) -> dict[str, int]:
    """The key of a grid with every symbol at its largest value (its inputs are the largest)."""
    return {s: max(values[s]) for s in symbols if s in values}


def random_array(sig: "TensorSignature", env: dict[str, int], rng: np.random.Generator) -> np.ndarray:
    """Random data of the signature's dtype and shape: normal floats, small integers, fair booleans."""
    from engine.expr import evaluate_all

    shape = evaluate_all(sig.shape, env)
    np_dtype = sig.dtype.numpy
    kind = sig.dtype.name
    if kind == "bool":
        return rng.random(shape) < 0.5
    if kind.startswith(("int", "uint")):
        return rng.integers(0, 8, size=shape).astype(np_dtype)
    return rng.standard_normal(shape, dtype=np.float32).astype(np_dtype)


def make_inputs(graph: "CompiledGraph", input_texts: Sequence[str] | None, symbol_texts: Sequence[str] | None, *,
                random: bool, seed: int, registry: "Registry") -> tuple[list[Any], dict[str, int], list[str]]:
    """The inputs of one run: ``--input`` files, the rest random with ``--random``.

    Returns the inputs (on their devices), the symbol values of the run, and how each input was made.
    """
    meta = graph.meta
    names = input_names(meta)
    given: dict[int, tuple[InputSpec, np.ndarray]] = {}
    for text in input_texts or ():
        spec = parse_input(text)
        i = _index_of(spec, names)
        if i in given:
            raise UsageError(f"--input {names[i]!r} is given twice")
        given[i] = (spec, _load_array(spec, names[i]))
    symbols = {k: v[0] for k, v in parse_symbols(symbol_texts, meta.symbols, required=False, single=True).items()}
    sources = {k: f"--symbol {k}" for k in symbols}
    for i, (spec, array) in sorted(given.items()):
        _bind_from_array(names[i], spec.text, meta.inputs[i], array, symbols, sources)
    missing_inputs = [names[i] for i in range(len(names)) if i not in given]
    if missing_inputs and not random:
        raise UsageError(f"no data for input{'s' if len(missing_inputs) > 1 else ''} "
                         f"{', '.join(repr(n) for n in missing_inputs)}: give --input NAME=FILE.npy, or --random "
                         f"(with --symbol for the shapes)")
    need = sorted({s for i in range(len(names)) if i not in given for s in meta.inputs[i].symbols})
    unbound = [s for s in need if s not in symbols]
    if unbound:
        raise UsageError(f"--random needs a value for symbol{'s' if len(unbound) > 1 else ''} "
                         f"{', '.join(repr(s) for s in unbound)}: add "
                         + " ".join(f"--symbol {s}=N" for s in unbound))
    check_input_memory(meta, symbols, indices=[i for i in range(len(names)) if i not in given], sources=sources)
    rng = np.random.default_rng(seed)
    arrays: list[np.ndarray] = []
    made: list[str] = []
    for i, sig in enumerate(meta.inputs):
        if i in given:
            arrays.append(np.ascontiguousarray(given[i][1]))
            made.append(given[i][0].path)
        else:
            arrays.append(random_array(sig, symbols, rng))
            made.append("random")
    key = {s: symbols[s] for s in meta.symbols if s in symbols}
    return place_inputs(graph, arrays, registry), key, made


def place_inputs(graph: "CompiledGraph", arrays: Sequence[np.ndarray], registry: "Registry") -> list[Any]:
    """Host arrays moved to their inputs' devices (numpy arrays stay as they are for the CPU)."""
    import engine

    devices = graph.devices
    out: list[Any] = []
    for sig, array in zip(graph.meta.inputs, arrays):
        device = devices[sig.device]
        out.append(array if sig.device == "cpu" else engine.asarray(array, device=str(device), registry=registry))
    return out


def key_grid(values: dict[str, list[int]], symbols: Sequence[str]) -> list[dict[str, int]]:
    """Every combination of the symbol values, in the graph's symbol order (one empty key if static)."""
    axes = [values[s] for s in symbols]
    return [dict(zip(symbols, combo)) for combo in itertools.product(*axes)]


def synchronize(graph: "CompiledGraph", registry: "Registry") -> None:
    """Wait for queued work on every device the graph uses (no-op on the CPU)."""
    for kind, device in graph.devices.items():
        registry.backend(kind).synchronize(device.index)


def check_output_path(path: str, *, option: str) -> Path:
    """A file path we are about to write: its directory must exist (UsageError otherwise)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {str(parent)!r} does not exist")
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: directory {str(parent)!r} is not writable")
    return p
