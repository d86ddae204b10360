"""Turning a (mutated) set of members into a bundle on disk or in memory, including invalid ones.

The engine's own writer refuses what the fuzzer needs to produce (duplicate entries, bad names,
compressed members), so this module has its own zip writer with every field under control, and
writes the directory form with special files (FIFOs, symlinks, directories) where asked. It never
opens a special file itself: only the engine under test does.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ZipEntry", "Draft", "write_zip", "manifest_doc", "materialise"]

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_DOS_DATE = (0 << 9) | (1 << 5) | 1
_UNIX_FILE = (0o100644 << 16)
_WEIGHTS_ALIGN = 4096


@attrs.define
class ZipEntry:
    """One zip record; the defaults give what the engine's writer would write."""

    name: bytes
    data: bytes
    method: int = 0
    flags: int = 0
    #: Name written in the local header when it should differ from the central one.
    local_name: bytes | None = None
    #: Data descriptor style: zero CRC and sizes in the local header.
    descriptor: bool = False
    #: Write only a central record pointing at the local header of entry ``alias_of``.
    alias_of: int | None = None
    align: int = 1


def _payload(entry: ZipEntry) -> bytes:
    if entry.method == 8:
        c = zlib.compressobj(6, zlib.DEFLATED, -15)
        return c.compress(entry.data) + c.flush()
    return entry.data


def _write_local(out: bytearray, entry: ZipEntry) -> tuple[int, tuple[int, int, int]]:
    """Append the local header and data of ``entry``; return its offset and (crc, stored, size)."""
    body = _payload(entry)
    crc = zlib.crc32(entry.data)
    local_name = entry.local_name if entry.local_name is not None else entry.name
    offset = len(out)
    extra = b""
    if entry.align > 1:
        unpadded = offset + _LOCAL.size + len(local_name) + 6
        pad = -unpadded % entry.align
        extra = struct.pack("<HHH", 0xD935, 2 + pad, entry.align) + bytes(pad)
    sizes = (0, 0, 0) if entry.descriptor else (crc, len(body), len(entry.data))
    flags = entry.flags | (0x08 if entry.descriptor else 0)
    out += _LOCAL.pack(0x04034B50, 20, flags, entry.method, 0, _DOS_DATE, *sizes, len(local_name), len(extra))
    out += local_name + extra + body
    if entry.descriptor:
        out += struct.pack("<IIII", 0x08074B50, crc, len(body), len(entry.data))
    return offset, (crc, len(body), len(entry.data))


def write_zip(entries: list[ZipEntry], *, comment: bytes = b"") -> bytes:
    """A zip archive of ``entries`` in order, STORED unless an entry says otherwise."""
    out = bytearray()
    offsets: dict[int, int] = {}
    records: dict[int, tuple[int, int, int]] = {}  # index -> (crc, stored size, size)
    for i, entry in enumerate(entries):
        if entry.alias_of is None:
            offsets[i], records[i] = _write_local(out, entry)
    central = []
    for i, entry in enumerate(entries):
        target = i if entry.alias_of is None else entry.alias_of
        if target in offsets:
            central.append((entry, offsets[target], *records[target]))
    cd_start = len(out)
    for entry, offset, crc, csize, usize in central:
        flags = entry.flags | (0x08 if entry.descriptor else 0)
        out += _CENTRAL.pack(0x02014B50, (3 << 8) | 20, 20, flags, entry.method, 0, _DOS_DATE, crc, csize, usize,
                             len(entry.name), 0, 0, 0, 0, _UNIX_FILE, offset) + entry.name
    count = len(central)
    out += _EOCD.pack(0x06054B50, 0, 0, count, count, len(out) - cd_start, cd_start, len(comment)) + comment
    return bytes(out)


def manifest_doc(members: dict[str, bytes]) -> dict[str, Any]:
    """The manifest the engine's writer would write for ``members`` (sizes and sha256 re-computed)."""
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
             for name, data in sorted(members.items())}
    return {"engine_version": "0.1.0", "files": files, "format": "engine.bundle", "format_version": 1}


@attrs.define
class Draft:
    """A bundle being mutated: members, then the listing, the manifest, the container, raw bytes."""

    form: str  # "zip", "memory" or "dir"
    members: dict[str, bytes]
    #: The manifest's document (set when the listing phase starts; JSON mutations may edit it).
    manifest: dict[str, Any] | None = None
    #: The manifest's bytes (set after the manifest phase; encoding mutations replace them).
    manifest_bytes: bytes | None = None
    #: Zip records in write order (the container phase may edit them); built from members.
    entries: list[ZipEntry] | None = None
    comment: bytes = b""
    #: Directory form: name -> ("fifo",) | ("symlink", target) | ("dir",) instead of a file.
    specials: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    #: Members left out of the manifest (the listing phase drops them).
    unlisted: set[str] = attrs.field(factory=set)
    raw: bytes | None = None

    def zip_entries(self) -> list[ZipEntry]:
        """Records in the engine writer's order: sorted, weights.bin last (aligned), manifest last."""
        names = sorted(n for n in self.members if n != "weights.bin")
        if "weights.bin" in self.members:
            names.append("weights.bin")
        entries = [ZipEntry(n.encode("utf-8", "surrogatepass"), self.members[n],
                            flags=0 if n.isascii() else 0x0800, align=_WEIGHTS_ALIGN if n == "weights.bin" else 1)
                   for n in names]
        assert self.manifest_bytes is not None
        entries.append(ZipEntry(b"manifest.json", self.manifest_bytes))
        return entries


def materialise(draft: Draft, workdir: Path) -> str | bytes:
    """What ``load_compiled_graph`` gets: a zip path, zip bytes, or a directory path."""
    if draft.form == "dir":
        return str(_write_dir(draft, workdir / "bundle"))
    data = draft.raw if draft.raw is not None else write_zip(draft.entries or draft.zip_entries(),
                                                             comment=draft.comment)
    if draft.form == "memory":
        return data
    path = workdir / "bundle.cgb"
    path.write_bytes(data)
    return str(path)


def _inside(root: Path, name: str) -> Path:
    """``root/name``, refusing names the file system would put elsewhere (``/abs``, ``..``, ``a//b``):
    the directory form cannot hold them, and the fuzzer must never write outside its work dir."""
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        raise ValueError(f"member name {name!r} cannot be written in the directory form")
    return root / name


def _write_dir(draft: Draft, root: Path) -> Path:
    root.mkdir()
    files = dict(draft.members)
    assert draft.manifest_bytes is not None
    files["manifest.json"] = draft.manifest_bytes
    for name, data in files.items():
        if name in draft.specials:
            continue
        path = _inside(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for name, special in draft.specials.items():
        path = _inside(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            path.unlink()
        if special[0] == "fifo":
            os.mkfifo(path)
        elif special[0] == "symlink":
            os.symlink(special[1], path)
        elif special[0] == "dir":
            path.mkdir(exist_ok=True)
            (path / "inner").write_bytes(b"x")
    return root
