"""Reading and writing whole bundles: members <-> validated metadata objects.

``read_bundle`` opens the container (``reader``), structures every metadata member
(``schema``), checks cross-member consistency (``validate``) and maps the weights blob without
copying it. ``bundle_members`` goes the other way for the writer. Neither touches a device.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import attrs
import numpy as np

from engine.bundle.dispatch_text import format_dispatch_table, parse_dispatch_table
from engine.bundle.foreign import check_not_a_model
from engine.bundle.jsonread import JsonReader, loads_member
from engine.bundle.npz import MAX_NPZ_BYTES, NPZ_MEMBER, ExpectedArray, read_npz
from engine.bundle.reader import BundleArchive
from engine.bundle.schema import GraphExecution, GraphMetaData, KernelMeta, WeightEntry
from engine.bundle.text import decode_utf8
from engine.bundle.validate import GraphAnalysis, analyze_graph
from engine.bundle.writer import WEIGHTS_MEMBER, MemberData
from engine.errors import BundleError

__all__ = ["BundleContents", "read_bundle", "bundle_members", "WEIGHT_ALIGNMENT", "weights_layout"]

WEIGHT_ALIGNMENT = 64
#: Largest kernel binary the reader accepts (a fat cubin is tens of MiB; 1 GiB is clearly hostile).
MAX_BINARY_BYTES = 2**30


@attrs.frozen(eq=False)
class BundleContents:
    archive: BundleArchive
    meta: GraphMetaData
    execution: GraphExecution
    kernels: tuple[KernelMeta, ...]
    #: Index of weights (``weights.json``); ``None`` when the bundle has none listed.
    weight_entries: tuple[WeightEntry, ...] | None
    #: Mapped ``weights.bin`` (or arrays from a reference ``weights.npz``); ``None`` if saved without weights.
    weight_blob: memoryview | None
    npz_weights: tuple[np.ndarray, ...] | None
    dispatch_rows: dict[tuple[int, ...], tuple[int, ...]]
    graph_string: str
    analysis: GraphAnalysis
    #: Kernel binaries by member name, read and hash-checked at load (before any plugin is asked).
    binaries: dict[str, bytes]

    @property
    def identity(self) -> str:
        return self.archive.identity

    @property
    def has_weights(self) -> bool:
        return not self.execution.weights_index or self.weight_blob is not None or self.npz_weights is not None

    def binary(self, kernel_index: int, path: str) -> bytes:
        """A kernel binary's bytes (hash-checked against the manifest when the bundle was read)."""
        return self.binaries[_binary_member(kernel_index, path)]

    def verify_weights(self) -> None:
        """Hash-check the weights' member against the manifest: reading a bundle does not (they can
        be large), so it is asked for where it matters. A mismatch is a ``BundleError`` naming it."""
        bad = self.archive.verify([n for n in (WEIGHTS_MEMBER, NPZ_MEMBER) if n in self.archive])
        if bad:
            raise BundleError("sha256 mismatch: the weights are corrupted or were modified", member=bad[0])


def _binary_member(kernel_index: int, path: str) -> str:
    return f"kernels/{kernel_index}/{path}"


def read_bundle(source: str | os.PathLike | bytes | bytearray | memoryview) -> BundleContents:
    check_not_a_model(source)  # an .onnx file: say how to convert it, not "not a zip archive"
    archive = BundleArchive.open(source)
    try:
        return _read(archive)
    except BaseException:
        archive.close()
        raise


def _json(archive: BundleArchive, member: str):
    if member not in archive:
        raise BundleError("required member is missing", member=member)
    data = archive.read(member)
    decode_utf8(data, member)  # strict UTF-8 first, so a UTF-16 member is called that, not a syntax error
    return loads_member(data, member)


def _read(archive: BundleArchive) -> BundleContents:
    meta = GraphMetaData.from_json(JsonReader("meta.json"), _json(archive, "meta.json"))
    execution = GraphExecution.from_json(JsonReader("graph_execution.json"), _json(archive, "graph_execution.json"))
    kernels = []
    binaries: dict[str, bytes] = {}
    for k in range(meta.num_kernels):
        member = f"kernels/{k}/meta.json"
        kernel = KernelMeta.from_json(JsonReader(member), _json(archive, member))
        for c, cand in enumerate(kernel.candidates):
            for b, binary in enumerate(cand.binaries):
                name = _binary_member(k, binary.path)
                if name not in archive:
                    raise BundleError(f"binary {binary.path!r} is not in the bundle (expected member {name!r})",
                                      member=member, path=f"$.candidates[{c}].binaries[{b}].path")
                if name not in binaries:
                    binaries[name] = archive.read(name, max_size=MAX_BINARY_BYTES)
        kernels.append(kernel)

    entries: tuple[WeightEntry, ...] | None = None
    if "weights.json" in archive:
        r = JsonReader("weights.json")
        entries = r.list_(_json(archive, "weights.json"), "$", lambda v, p: WeightEntry.from_json(r, v, p))
    elif execution.weights_index and "weights.npz" not in archive:
        raise BundleError("the graph has weights but the bundle has no weights.json index", member="weights.json")

    blob: memoryview | None = None
    npz: tuple[np.ndarray, ...] | None = None
    if "weights.bin" in archive:
        blob = archive.map("weights.bin")
        if len(blob) == 0:
            blob = None
        elif entries is not None:
            for j, e in enumerate(entries):
                if e.offset + e.nbytes > len(blob):
                    raise BundleError(f"weight {e.name!r} ends at byte {e.offset + e.nbytes}, past the end of "
                                      f"weights.bin ({len(blob)} bytes)", member="weights.json", path=f"$[{j}]")
    elif NPZ_MEMBER in archive:
        with archive.open_member(NPZ_MEMBER, max_size=MAX_NPZ_BYTES) as file:
            npz = read_npz(file, _npz_expectations(execution))

    analysis = analyze_graph(meta, execution, kernels, entries)

    rows: dict[tuple[int, ...], tuple[int, ...]] = {}
    if "dispatch_table.txt" in archive:
        text = decode_utf8(archive.read("dispatch_table.txt"), "dispatch_table.txt")
        rows = parse_dispatch_table(text, symbols=meta.symbols,
                                    candidates_per_task=[len(k.candidates) for k in kernels])
    graph_string = ""
    if "graph_string.txt" in archive:
        graph_string = decode_utf8(archive.read("graph_string.txt"), "graph_string.txt")
    return BundleContents(archive, meta, execution, tuple(kernels), entries, blob, npz, rows, graph_string, analysis,
                          binaries)


def _npz_expectations(execution: GraphExecution) -> list[ExpectedArray | None]:
    """What each ``arr_<j>`` of ``weights.npz`` must be, so that it is judged by its header before
    anything is inflated. ``None`` where the plan cannot say yet (an index out of range, a symbolic
    shape): the consistency checks that follow report those."""
    out: list[ExpectedArray | None] = []
    for t in execution.weights_index:
        sig = execution.tensor_signatures[t] if 0 <= t < len(execution.tensor_signatures) else None
        shape = tuple(e.constant for e in sig.shape) if sig is not None else (None,)
        if sig is None or None in shape:
            out.append(None)
        else:
            out.append(ExpectedArray(sig.dtype.numpy, shape, t))  # type: ignore[arg-type]  # no None left
    return out


def weights_layout(arrays: Sequence[tuple[str, np.ndarray]]) -> tuple[list[WeightEntry], list[MemberData], int]:
    """Entries and chunks of ``weights.bin``: each weight at a 64-byte aligned offset, zero padding between."""
    from engine.dtypes import from_numpy_dtype

    entries: list[WeightEntry] = []
    chunks: list[MemberData] = []
    offset = 0
    for name, array in arrays:
        pad = -offset % WEIGHT_ALIGNMENT
        if pad:
            chunks.append(bytes(pad))
            offset += pad
        # Viewed as bytes through numpy: ml_dtypes arrays (bfloat16, float8) do not export a buffer format.
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # a memoryview of the bytes
        entries.append(WeightEntry(name, from_numpy_dtype(array.dtype), tuple(array.shape), offset, data.nbytes))
        chunks.append(data)
        offset += data.nbytes
    return entries, chunks, offset


def _dumps(value: object) -> bytes:
    return json.dumps(value, indent=1, sort_keys=False).encode("utf-8")


def bundle_members(
    *,
    meta: GraphMetaData,
    execution: GraphExecution,
    kernels: Sequence[KernelMeta],
    binaries: dict[str, MemberData],
    weights: Sequence[tuple[str, np.ndarray]] | None,
    weight_entries: Sequence[WeightEntry] | None = None,
    dispatch_rows: dict[tuple[int, ...], tuple[int, ...]] | None = None,
    graph_string: str = "",
) -> dict[str, MemberData]:
    """Every member except the manifest. ``binaries`` maps ``kernels/<i>/<path>`` to bytes.

    ``weights=None`` saves the index only (``weight_entries`` must then be given), for
    ``save_weights=False``: the loader then expects ``set_weights``.
    """
    members: dict[str, MemberData] = {
        "meta.json": _dumps(meta.to_json()),
        "graph_execution.json": _dumps(execution.to_json()),
        "graph_string.txt": graph_string.encode("utf-8"),
    }
    for k, kernel in enumerate(kernels):
        members[f"kernels/{k}/meta.json"] = _dumps(kernel.to_json())
    members.update(binaries)
    if weights is not None:
        entries, chunks, _ = weights_layout(weights)
        if entries:
            members["weights.json"] = _dumps([e.to_json() for e in entries])
            members["weights.bin"] = chunks  # type: ignore[assignment]  # the writer takes a list of chunks
    elif weight_entries:
        members["weights.json"] = _dumps([e.to_json() for e in weight_entries])
    if dispatch_rows:
        members["dispatch_table.txt"] = format_dispatch_table(meta.symbols, dispatch_rows).encode("utf-8")
    return members
