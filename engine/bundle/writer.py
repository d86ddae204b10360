"""The write side of a bundle: members streamed into the zip form or the directory form.

Sizes and sha256 are computed while the data streams out (one pass), members are taken as
references (bytes, mmap views, arrays, or sequences of chunks) and never copied whole, and the
manifest listing them is written last. The output is byte-reproducible: members in a fixed order
(sorted, ``weights.bin`` last so metadata sits at the front), fixed timestamps, no compression.

``weights.bin`` starts at a ``WEIGHTS_ALIGNMENT`` file offset, so readers can memory-map it straight
out of the zip. Alignment is done zipalign-style by padding the local header's extra field, and the
CRC-32 is patched into the local header afterwards, so there are no data descriptors.

This module writes into what it is given (a seekable file, an empty directory); making that
replace a bundle atomically is ``engine.bundle.save``'s job.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Union

from engine.bundle import manifest as manifest_rules
from engine.bundle.manifest import FORMAT_VERSION, MANIFEST_MEMBER, Manifest, ManifestEntry, check_name
from engine.bundle.reader import BundleArchive
from engine.bundle.zipformat import (CENTRAL_HEADER, CENTRAL_SIG, EOCD, EOCD64, EOCD64_LOCATOR, EOCD64_LOCATOR_SIG,
                                     EOCD64_SIG, EOCD_SIG, FLAG_UTF8, LOCAL_HEADER, LOCAL_SIG, ZIP64_EXTRA_ID)
from engine.errors import BundleError
from engine.safefiles import fsync_dir

__all__ = ["MemberData", "WEIGHTS_ALIGNMENT", "WEIGHTS_MEMBER", "write_order", "write_zip", "write_tree",
           "bundle_to_file", "bundle_to_bytes", "copy_members"]

WEIGHTS_ALIGNMENT = 4096
WEIGHTS_MEMBER = "weights.bin"

#: What a member may be given as: one bytes-like object (bytes, an mmap view, a C-contiguous array) or a
#: sequence of them, written in order as one member.
MemberData = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]

_ALIGN_EXTRA_ID = 0xD935  # the id Android's zipalign uses for its padding record
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes/offsets at or above this need zip64 records (tests lower it)
_DOS_DATE, _DOS_TIME = (0 << 9) | (1 << 5) | 1, 0  # 1980-01-01 00:00: byte-reproducible output
_MADE_BY_UNIX = 3 << 8
_UNIX_FILE_ATTRS = (stat.S_IFREG | 0o644) << 16
_CHUNK = 8 * 1024 * 1024  # streaming granularity for hashing and writing


# ---- members in -------------------------------------------------------------------------------
def _as_view(name: str, obj) -> memoryview:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"bundle member {name!r}: {type(obj).__name__} is not bytes-like") from None
    if not view.c_contiguous:
        raise TypeError(f"bundle member {name!r}: buffer is not C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _member_views(name: str, data) -> tuple[list[memoryview], int]:
    """A member's data as byte views (references, not copies) plus the total size.

    Chunk sequences are iterated here, once, right before the member is written.
    """
    if isinstance(data, (str, Mapping)):
        raise TypeError(f"bundle member {name!r}: expected bytes-like data or a sequence of chunks, "
                        f"got {type(data).__name__}")
    try:  # anything with the buffer protocol (bytes, mmap views, numpy arrays) is one chunk
        whole = memoryview(data)
    except TypeError:
        if not isinstance(data, Iterable):
            raise TypeError(f"bundle member {name!r}: expected bytes-like data or a sequence of chunks, "
                            f"got {type(data).__name__}") from None
        views = [_as_view(name, chunk) for chunk in data]
    else:
        views = [_as_view(name, whole)]
    return views, sum(v.nbytes for v in views)


def write_order(members: Mapping[str, MemberData], engine_version: str) -> list[str]:
    """Validate names; return the write order: sorted, weights.bin last (metadata at the front)."""
    if not isinstance(members, Mapping):
        raise TypeError("members must be a mapping of member name -> data")
    if not isinstance(engine_version, str):
        raise TypeError("engine_version must be a string")
    if len(members) > manifest_rules.MAX_MEMBERS:
        raise BundleError(f"too many members: {len(members)} > {manifest_rules.MAX_MEMBERS}")
    for name in members:
        check_name(name)
        if name == MANIFEST_MEMBER:
            raise BundleError("is written by the bundle writer; do not pass it as a member", member=name)
    taken = set(members) | {MANIFEST_MEMBER}
    for name in members:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in taken:
                raise BundleError(f"conflicts with member {'/'.join(parts[:i])!r} (file and directory)", member=name)
    order = sorted(n for n in members if n != WEIGHTS_MEMBER)
    return order + [WEIGHTS_MEMBER] if WEIGHTS_MEMBER in members else order


def _manifest_blob(manifest: Manifest) -> bytes:
    """``manifest.json``'s bytes, refused when over the limit the reader would refuse them at."""
    blob = manifest.to_json()
    if len(blob) > manifest_rules.MAX_MANIFEST_BYTES:
        raise BundleError(f"would be {len(blob)} bytes, over the {manifest_rules.MAX_MANIFEST_BYTES}-byte limit",
                          member=MANIFEST_MEMBER)
    return blob


# ---- the zip form -----------------------------------------------------------------------------
class _ZipWriter:
    """Minimal STORED-only zip writer with exact control over local extra fields.

    ``fp`` must be seekable: the CRC-32 is only known after streaming the data, so it is patched
    into the local header afterwards (no data descriptors, local and central records agree).
    """

    def __init__(self, fp: BinaryIO):
        self.fp, self.pos = fp, 0
        self.central: list[bytes] = []  # the central directory's records, written by finish()

    def _write(self, data) -> None:
        self.fp.write(data)
        self.pos += len(data)

    def add(self, name: str, views: list[memoryview], size: int, align: int = 1) -> str:
        name_b = name.encode("utf-8")
        flags = 0 if name.isascii() else FLAG_UTF8
        offset = self.pos
        big = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", ZIP64_EXTRA_ID, 16, size, size) if big else b""
        if align > 1:  # zipalign-style record: id, length, u16 alignment, zero padding
            unpadded = offset + LOCAL_HEADER.size + len(name_b) + len(extra) + 6
            pad = -unpadded % align
            extra += struct.pack("<HHH", _ALIGN_EXTRA_ID, 2 + pad, align) + bytes(pad)
        size32 = 0xFFFFFFFF if big else size
        version = 45 if big else 20
        self._write(LOCAL_HEADER.pack(LOCAL_SIG, version, flags, 0, _DOS_TIME, _DOS_DATE, 0,
                                      size32, size32, len(name_b), len(extra)) + name_b + extra)
        digest, crc, start = hashlib.sha256(), 0, self.pos
        for view in views:
            for i in range(0, view.nbytes, _CHUNK):
                block = view[i:i + _CHUNK]
                digest.update(block)
                crc = zlib.crc32(block, crc)
                self._write(block)
        if self.pos - start != size:
            raise RuntimeError(f"bundle member {name!r} changed size while being written")
        self.fp.seek(offset + 14)
        self.fp.write(struct.pack("<I", crc))
        self.fp.seek(self.pos)
        # Central record: zip64 extra carries whichever of usize, csize, offset overflow (in order).
        wide = [v for v in (size, size, offset) if v >= _ZIP64_LIMIT]
        cextra = struct.pack(f"<HH{len(wide)}Q", ZIP64_EXTRA_ID, 8 * len(wide), *wide) if wide else b""
        clamp = lambda v: 0xFFFFFFFF if v >= _ZIP64_LIMIT else v  # noqa: E731
        version = 45 if wide else 20
        self.central.append(CENTRAL_HEADER.pack(
            CENTRAL_SIG, _MADE_BY_UNIX | version, version, flags, 0, _DOS_TIME, _DOS_DATE, crc,
            clamp(size), clamp(size), len(name_b), len(cextra), 0, 0, 0, _UNIX_FILE_ATTRS, clamp(offset),
        ) + name_b + cextra)
        return digest.hexdigest()

    def finish(self) -> None:
        cd_offset, count = self.pos, len(self.central)
        cd = b"".join(self.central)
        self._write(cd)
        if cd_offset >= _ZIP64_LIMIT or len(cd) >= _ZIP64_LIMIT or count >= 0xFFFF:
            eocd64 = self.pos
            self._write(EOCD64.pack(EOCD64_SIG, EOCD64.size - 12, _MADE_BY_UNIX | 45, 45, 0, 0,
                                    count, count, len(cd), cd_offset))
            self._write(EOCD64_LOCATOR.pack(EOCD64_LOCATOR_SIG, 0, eocd64, 1))
        n16 = min(count, 0xFFFF)
        self._write(EOCD.pack(EOCD_SIG, 0, 0, n16, n16, min(len(cd), 0xFFFFFFFF),
                              min(cd_offset, 0xFFFFFFFF), 0))


def write_zip(fp: BinaryIO, members: Mapping[str, MemberData], order: list[str], engine_version: str) -> Manifest:
    """Stream ``members`` (in ``order``, from ``write_order``) and then the manifest into ``fp`` as a zip.

    ``fp`` must be seekable and positioned at its start; it is neither flushed nor fsynced here.
    """
    writer, files = _ZipWriter(fp), {}
    for name in order:
        views, size = _member_views(name, members[name])
        align = WEIGHTS_ALIGNMENT if name == WEIGHTS_MEMBER else 1
        files[name] = ManifestEntry(size, writer.add(name, views, size, align))
    manifest = Manifest(format_version=(FORMAT_VERSION, 0), engine_version=engine_version, files=files)
    blob = _manifest_blob(manifest)
    writer.add(MANIFEST_MEMBER, [memoryview(blob)], len(blob))
    writer.finish()
    return manifest


# ---- the directory form -----------------------------------------------------------------------
def _write_file(path: Path, views: list[memoryview]) -> str:
    """Create ``path`` (never over an existing file), write ``views`` into it, fsync; its sha256."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    with open(fd, "wb") as f:
        for view in views:
            for i in range(0, view.nbytes, _CHUNK):
                block = view[i:i + _CHUNK]
                digest.update(block)
                f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def write_tree(root: Path, members: Mapping[str, MemberData], order: list[str], engine_version: str) -> Manifest:
    """Write ``members`` (in ``order``) and then the manifest as files under the empty directory ``root``.

    Every file and every directory of the tree is fsynced; ``root``'s own entry in its parent is not.
    """
    files, dirs = {}, {root}
    for name in order:
        path = root.joinpath(*name.split("/"))
        if path.parent not in dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            dirs.update(path.parents)
        views, size = _member_views(name, members[name])
        files[name] = ManifestEntry(size, _write_file(path, views))
    manifest = Manifest(format_version=(FORMAT_VERSION, 0), engine_version=engine_version, files=files)
    _write_file(root / MANIFEST_MEMBER, [memoryview(_manifest_blob(manifest))])
    for d in dirs:
        if d == root or root in d.parents:
            fsync_dir(d)
    return manifest


# ---- in memory, and re-saving -----------------------------------------------------------------
def bundle_to_file(fp: BinaryIO, members: Mapping[str, MemberData], *, engine_version: str) -> Manifest:
    """The zip form written into ``fp`` from its current position (byte-identical to what
    write_bundle writes for the same members); nothing about replacing a file, no fsync."""
    return write_zip(fp, members, write_order(members, engine_version), engine_version)


def bundle_to_bytes(members: Mapping[str, MemberData], *, engine_version: str) -> bytes:
    """The zip form in memory (byte-identical to what write_bundle writes for the same members)."""
    buf = io.BytesIO()
    bundle_to_file(buf, members, engine_version=engine_version)
    return buf.getvalue()


def copy_members(archive: BundleArchive, replace: Mapping[str, MemberData | None]) -> dict[str, MemberData]:
    """Every member of ``archive`` as zero-copy maps, with ``replace`` applied (None drops a member).

    Meant for re-saving (e.g. a new dispatch_table.txt) without loading weights into memory. The
    maps are not hash-checked; call ``archive.verify()`` first to avoid re-blessing corrupted data
    (the new manifest records the hashes of whatever bytes are written).
    """
    out: dict[str, MemberData] = {name: archive.map(name) for name in archive.names() if name not in replace}
    for name, data in replace.items():
        if data is not None:
            out[name] = data
    return out
