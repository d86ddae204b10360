"""The read side of a bundle: ``BundleArchive`` over a zip file, a directory or zip bytes in memory.

This module knows nothing about what members mean; it only guarantees that what it hands out is
exactly what the manifest describes, however hostile the archive:

* Opening validates the whole structure before anything is handed out: member names (rules in
  ``engine.bundle.manifest``), the zip directory against the end records and every local header,
  entries tiling the file with no byte unaccounted for, the manifest, its listing and the sizes.
  Members are not hashed then: ``read()`` always hash-checks, ``map()`` never does (mapping weights
  stays O(1)), and ``verify()`` hash-checks on demand.
* Data offsets come from the *local* headers, never the central directory: the writer aligns
  ``weights.bin`` zipalign-style by padding the local header's extra field, so it can be
  memory-mapped straight out of the zip without extraction.
* Every defect (bad names, truncation, inconsistent zip directory, limits, hash mismatch) is a
  :class:`~engine.errors.BundleError` naming the member, never a raw zipfile/struct/OS error.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import stat
import struct
import threading
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO, Callable, Literal, Union

import attrs

from engine.bundle import manifest as manifest_rules
from engine.bundle.jsonread import clip
from engine.bundle.manifest import MANIFEST_MEMBER, Manifest, check_name, name_problem
from engine.bundle.zipformat import (EOCD, EOCD64, EOCD64_LOCATOR, FLAG_DESCRIPTOR, FLAG_UTF8, FLAGS_ENCRYPTION,
                                     LOCAL_HEADER, LOCAL_SIG, ZIP64_EXTRA_ID, ZIP_MAGIC)
from engine.errors import BundleError, BundleFileError, BundleNotFoundError

__all__ = ["BundleArchive", "MAX_METADATA_BYTES"]

MAX_METADATA_BYTES = 64 * 1024 * 1024  # default cap for BundleArchive.read()
_CHUNK = 8 * 1024 * 1024  # streaming granularity for hashing and verify()

#: ``read_at(offset, size)``: the bytes of the bundle there, positionally (short at the end of the file).
_ReadAt = Callable[[int, int], bytes]
#: What ``zipfile`` parses: the open bundle file, or a view of the bytes of one in memory.
_ZipSource = Union[BinaryIO, "_ViewFile"]


# ---- the archive ------------------------------------------------------------------------------
class _ViewFile(io.RawIOBase):
    """Read-only seekable file over a memoryview, so zipfile can parse in-memory bundles uncopied."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        base = (0, self._pos, len(self._view))[whence]
        if base + offset < 0:
            raise OSError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def readinto(self, buf):
        chunk = self._view[self._pos:self._pos + len(buf)]
        buf[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _pread(fd: int, size: int, offset: int) -> bytes:
    """Positional read (no shared file position, so concurrent readers are safe); short at EOF."""
    parts, got = [], 0
    while got < size:
        part = os.pread(fd, min(size - got, 1 << 30), offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _release_map(mm: mmap.mmap) -> None:
    """Unmap now if nobody holds a view; otherwise just drop our reference.

    Views handed out by map() keep the mmap object alive (buffer export), so it is unmapped when
    the last of them is garbage collected. This is what makes close() safe for outstanding views.
    """
    try:
        mm.close()
    except BufferError:
        pass


class BundleArchive:
    """Read side of a bundle (zip file, directory or in-memory zip bytes).

    Opening validates the whole structure (names, zip directory consistency, manifest, listing,
    sizes) but does not hash members: ``read()`` always hash-checks, ``map()`` never does (so that
    mapping weights stays O(1)), and ``verify()`` hash-checks on demand. Reads are thread-safe.
    """

    def __init__(self, *, form, path, manifest, members, fd=None, file=None, view=None):
        self.form: Literal["zip", "dir", "memory"] = form
        self.path: Path | None = path
        self.manifest: Manifest = manifest
        self.identity: str = manifest.identity
        self._members = members  # name -> (data offset, size) or, for "dir", (real path, size)
        self._file, self._fd, self._view = file, fd, view
        self._maps: dict[str, mmap.mmap] = {}  # "zip": {"": whole file}; "dir": one per member
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, source: str | os.PathLike | bytes | bytearray | memoryview) -> BundleArchive:
        if isinstance(source, (bytes, bytearray, memoryview)):
            view = memoryview(source).cast("B").toreadonly()
            manifest, members = _parse_zip(_ViewFile(view), lambda off, n: bytes(view[off:off + n]),
                                           len(view), "in-memory bundle")
            return cls(form="memory", path=None, manifest=manifest, members=members, view=view)
        path = Path(os.fspath(source))
        file = None
        try:
            if path.is_dir():
                manifest, files = _parse_dir(path)
                return cls(form="dir", path=path, manifest=manifest, members=files)
            file = open(path, "rb")
            fd = file.fileno()
            manifest, members = _parse_zip(file, lambda off, n: _pread(fd, n, off),
                                           os.fstat(fd).st_size, str(path))
            return cls(form="zip", path=path, manifest=manifest, members=members, fd=fd, file=file)
        except BaseException as e:
            if file is not None:
                file.close()
            if isinstance(e, OSError) and not isinstance(e, BundleError):
                kind = BundleNotFoundError if isinstance(e, FileNotFoundError) else BundleFileError
                raise kind(f"not a bundle: cannot read {str(path)!r}: {e.strerror or e}", errno=e.errno,
                           strerror=e.strerror, filename=str(path)) from e
            raise

    def __enter__(self) -> BundleArchive:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "<memory>"
        return f"<BundleArchive {self.form} {where} identity={self.identity[:12]} members={len(self._members)}>"

    def names(self) -> list[str]:
        return sorted(self.manifest.files)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.files

    def _locate(self, name: str):
        if self._closed:
            raise ValueError("I/O operation on a closed BundleArchive")
        try:
            return self._members[name]
        except (KeyError, TypeError):
            raise BundleError("no such member in this bundle", member=str(name)) from None

    def _chunks(self, name: str, chunk: int = _CHUNK):
        """Yield the member's bytes in order (at most ``chunk`` at a time), positionally."""
        where, size = self._locate(name)
        if self.form == "dir":
            with open(where, "rb") as f:
                while block := f.read(chunk):
                    yield block
            return
        for pos in range(where, where + size, chunk):
            n = min(chunk, where + size - pos)
            block = _pread(self._fd, n, pos) if self.form == "zip" else bytes(self._view[pos:pos + n])
            yield block
            if len(block) < n:
                return

    def read(self, name: str, *, max_size: int = MAX_METADATA_BYTES) -> bytes:
        """The member's bytes, always checked against the manifest's size and sha256."""
        _, size = self._locate(name)
        if size > max_size:
            raise BundleError(f"is {size} bytes, over the {max_size}-byte limit for metadata reads", member=name)
        try:
            data = b"".join(self._chunks(name, chunk=max(size, 1) + 1))
        except OSError as e:
            raise BundleError(f"cannot be read: {e}", member=name) from e
        if len(data) != size or hashlib.sha256(data).hexdigest() != self.manifest.files[name].sha256:
            raise BundleError("sha256 mismatch: the member is corrupted or was modified", member=name)
        return data

    def open_member(self, name: str, *, max_size: int) -> io.BufferedReader:
        """The member as a read-only seekable file, hash-checked first by streaming it.

        For a member that is itself an archive (``weights.npz``) and may be too large to ``read()``
        whole: it is parsed in place over ``map()``, after ``verify()`` vouched for its bytes.
        """
        _, size = self._locate(name)
        if size > max_size:
            raise BundleError(f"is {size} bytes, over the {max_size}-byte limit", member=name)
        if self.verify([name]):
            raise BundleError("sha256 mismatch: the member is corrupted or was modified", member=name)
        return io.BufferedReader(_ViewFile(self.map(name)))

    def map(self, name: str) -> memoryview:
        """Zero-copy read-only view of a member (NOT hash-checked; see verify()).

        The view stays valid after close(). If the underlying file is truncated by someone else
        while mapped, touching the view may crash the process (SIGBUS): bundles are immutable.
        """
        where, size = self._locate(name)
        if size == 0:
            return memoryview(b"")
        if self.form == "memory":
            return self._view[where:where + size]
        with self._lock:  # under the lock so that a concurrent close() cannot unmap it first
            if self._closed:
                raise ValueError("I/O operation on a closed BundleArchive")
            key = "" if self.form == "zip" else name
            mm = self._maps.get(key)
            if mm is None:
                try:
                    mm = self._maps[key] = self._map_file(name, where, size)
                except OSError as e:
                    raise BundleError(f"cannot be mapped: {e}", member=name) from e
            view = memoryview(mm)
        return view[where:where + size] if self.form == "zip" else view

    def _map_file(self, name: str, where, size: int) -> mmap.mmap:
        if self.form == "zip":  # one map of the whole archive, shared by all members
            return mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        with open(where, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise BundleError("file size changed since the bundle was opened", member=name)
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def data_offset(self, name: str) -> int | None:
        """Offset of the member's data in the zip file (from its local header); None unless form == "zip"."""
        where, _ = self._locate(name)
        return where if self.form == "zip" else None

    def verify(self, names: Iterable[str] | None = None) -> list[str]:
        """Hash-check members (streaming); return the names whose size or sha256 mismatch."""
        bad = []
        for name in self.names() if names is None else list(names):
            expected = self.manifest.files.get(name) if isinstance(name, str) else None
            if expected is None:
                raise BundleError("no such member in this bundle", member=str(name))
            digest, size = hashlib.sha256(), 0
            try:
                for block in self._chunks(name):
                    digest.update(block)
                    size += len(block)
            except OSError:  # e.g. a directory-form file removed behind our back
                size = -1
            if size != expected.size or digest.hexdigest() != expected.sha256:
                bad.append(name)
        return bad

    def close(self) -> None:
        """Release files and maps. Safe to call twice; views from map() remain valid."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for mm in self._maps.values():
                _release_map(mm)
            self._maps.clear()
            if self._file is not None:
                self._file.close()


# ---- the zip form: end records, directory, local headers (APPNOTE.TXT) -----------------------
@attrs.frozen
class _ZipEnd:
    """What the end-of-central-directory records say (zip64 values where present)."""

    entries: int
    cd_offset: int
    cd_size: int
    start: int  # offset of the first end record (the zip64 one where present): the directory ends here


def _unreadable(read_at: _ReadAt, total: int, where: str, reason: object) -> BundleError:
    """The error for a file that is not a readable zip: empty, cut short, or something else entirely."""
    if total == 0:
        return BundleError(f"not a bundle: {where} is empty")
    if read_at(0, 4) in ZIP_MAGIC:
        return BundleError(f"truncated bundle: {where} is cut short or its zip directory is damaged ({reason})")
    return BundleError(f"not a bundle: {where} is not a zip archive ({reason})")


def _read_zip_end(read_at: _ReadAt, total: int, where: str) -> _ZipEnd:
    """Find and check the end records, which must end the file exactly (§1.2).

    zipfile scans for the record and silently shifts every offset when the directory is not where
    the record says, so a file with bytes prepended, or two bundles concatenated, would open as
    the bundle inside it. Here the record's archive comment must reach the last byte and the
    directory must end exactly where the end records begin.
    """
    base = max(0, total - EOCD.size - 0xFFFF)
    tail = read_at(base, total - base)
    pos = len(tail) - EOCD.size
    stray = None
    while pos >= 0:
        pos = tail.rfind(b"PK\x05\x06", 0, pos + 4)
        if pos < 0:
            break
        _, disk, cd_disk, here, entries, cd_size, cd_offset, comment = EOCD.unpack_from(tail, pos)
        if pos + EOCD.size + comment == len(tail):
            break
        if stray is None and pos + EOCD.size + comment < len(tail) and cd_offset + cd_size == base + pos:
            stray = len(tail) - pos - EOCD.size - comment
        pos -= 1
    if pos < 0:
        if stray is not None:
            raise BundleError(f"not a bundle as written: {stray} bytes follow the zip end record of {where} "
                              "(data appended to the archive?)")
        raise _unreadable(read_at, total, where, "no end-of-central-directory record ends the file")
    if (disk, cd_disk) != (0, 0) or here != entries:
        raise BundleError(f"not a bundle: {where} is a multi-disk (split) zip archive")
    start = base + pos
    locator = start - EOCD64_LOCATOR.size
    if locator >= 0 and read_at(locator, 4) == b"PK\x06\x07":
        entries, cd_offset, cd_size, start = _read_zip64_end(read_at, locator, where)
    if cd_offset + cd_size != start:
        shift = start - cd_offset - cd_size
        what = (f"{shift} bytes precede the archive (bytes prepended to it, or several archives concatenated)"
                if shift > 0 else "the directory overlaps the end record (damaged archive)")
        raise BundleError(f"not a bundle as written: the zip directory of {where} should end at offset {start}, "
                          f"where the end record begins, but the record puts it at {cd_offset}..{cd_offset + cd_size}: "
                          f"{what}")
    return _ZipEnd(entries, cd_offset, cd_size, start)


def _read_zip64_end(read_at: _ReadAt, locator: int, where: str) -> tuple[int, int, int, int]:
    """(entries, directory offset, directory size, record offset) from the zip64 end record."""
    _, disk, record, disks = EOCD64_LOCATOR.unpack(read_at(locator, EOCD64_LOCATOR.size))
    raw = read_at(record, EOCD64.size) if 0 <= record <= locator - EOCD64.size else b""
    if len(raw) != EOCD64.size or raw[:4] != b"PK\x06\x06":
        raise BundleError(f"truncated bundle: the zip64 end locator of {where} points at offset {record}, "
                          "where there is no zip64 end record")
    _, size, _, _, rdisk, cd_disk, here, entries, cd_size, cd_offset = EOCD64.unpack(raw)
    if (disk, rdisk, cd_disk, disks) != (0, 0, 0, 1) or here != entries:
        raise BundleError(f"not a bundle: {where} is a multi-disk (split) zip archive")
    if record + 12 + size != locator:
        raise BundleError(f"not a bundle as written: the zip64 end record of {where} (offset {record}, {size + 12} "
                          f"bytes) does not end where its locator begins (offset {locator})")
    return entries, cd_offset, cd_size, record


def _zip_entries(fileobj: _ZipSource, read_at: _ReadAt, total: int, where: str, end: _ZipEnd) -> list[zipfile.ZipInfo]:
    """The central directory's entries (parsed by zipfile), checked against the end record."""
    limit = 2 * manifest_rules.MAX_MEMBERS + 1  # members, manifest.json and as many directory entries
    if end.entries > limit:
        raise BundleError(f"not a bundle: {where} has {end.entries} zip entries, over the limit of {limit} "
                          f"({manifest_rules.MAX_MEMBERS} members plus directory entries)")
    try:
        with zipfile.ZipFile(fileobj) as zf:
            infos, start_dir = zf.infolist(), zf.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, OSError,
            ValueError, struct.error, OverflowError) as e:
        raise _unreadable(read_at, total, where, e) from None
    if start_dir != end.cd_offset or len(infos) != end.entries:
        raise BundleError(f"not a bundle as written: the end record of {where} announces {end.entries} entries at "
                          f"offset {end.cd_offset}, the zip directory holds {len(infos)} at {start_dir}")
    return infos


def _split_entries(infos: list[zipfile.ZipInfo],
                   where: str) -> tuple[dict[str, zipfile.ZipInfo], list[zipfile.ZipInfo]]:
    """({file name: entry}, [directory entries]): each name once and safe, no name both a file and a directory.

    Names are the raw ones (zipfile's ``.filename`` is silently cut at NUL). Directory entries
    (names ending in ``/``) are ignored, but their names are checked like any other: they are what
    an unzip tool would create.
    """
    files: dict[str, zipfile.ZipInfo] = {}
    dirs: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.orig_filename
        is_dir = name.endswith("/")
        table = dirs if is_dir else files
        if name in table:
            raise BundleError("appears more than once in the zip directory", member=name)
        problem = name_problem(name[:-1] if is_dir else name)
        if problem is not None:
            raise BundleError(f"{problem}: {clip(name, 200)}", member=name)
        table[name] = info
        if len(files) > manifest_rules.MAX_MEMBERS + 1:
            raise BundleError(f"not a bundle: {where} has more than {manifest_rules.MAX_MEMBERS} members (the limit)")
    _check_tree(set(files), {name[:-1] for name in dirs})
    return files, list(dirs.values())


def _check_tree(files: set[str], dirs: set[str]) -> None:
    """No name is both a file and a directory (§1.1): ``a`` and ``a/b``, or ``a`` and ``a/``."""
    for name in sorted(files):
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in files:
                raise BundleError(f"conflicts with member {parent!r}: a name cannot be both a file and a directory",
                                  member=name)
        if name in dirs:
            raise BundleError(f"conflicts with the directory entry {name + '/'!r}: a name cannot be both a file and "
                              "a directory", member=name)


def _check_layout(spans: list[tuple[int, int, str]], cd_offset: int) -> None:
    """Entries tile the file from offset 0 to the zip directory: one byte, one member (§1.2).

    ``spans`` are (local header offset, end of data, name). A gap is data nobody accounted for:
    bytes prepended before the first entry, a data descriptor, or something hidden between members.
    """
    pos, prev = 0, None
    for start, end, name in sorted(spans):
        if start < pos:
            raise BundleError(f"overlaps member {prev!r} in the zip file", member=name)
        if start > pos:
            where = f"the end of member {prev!r}" if prev is not None else "the start of the file"
            raise BundleError(f"{start - pos} bytes between {where} and its local header belong to no member "
                              "(bytes prepended to the archive, or hidden between members)", member=name)
        pos, prev = end, name
    if pos != cd_offset:
        raise BundleError(f"{cd_offset - pos} bytes between its end and the zip directory belong to no member",
                          member=prev)


def _parse_zip(fileobj: _ZipSource, read_at: _ReadAt, total: int,
               where: str) -> tuple[Manifest, dict[str, tuple[int, int]]]:
    """Validate a zip bundle; return (manifest, {name: (data offset, size)})."""
    end = _read_zip_end(read_at, total, where)
    files, dirs = _split_entries(_zip_entries(fileobj, read_at, total, where, end), where)

    def locate(name: str, info: zipfile.ZipInfo) -> int:
        return _local_data_offset(name, info, read_at, end.cd_offset)

    if MANIFEST_MEMBER not in files:
        raise BundleError(f"missing from {where}: this zip archive is not an engine bundle", member=MANIFEST_MEMBER)
    minfo = files.pop(MANIFEST_MEMBER)
    if minfo.file_size > manifest_rules.MAX_MANIFEST_BYTES:
        raise BundleError(f"is {minfo.file_size} bytes, over the {manifest_rules.MAX_MANIFEST_BYTES}-byte limit",
                          member=MANIFEST_MEMBER)
    moff = locate(MANIFEST_MEMBER, minfo)
    # The version is read before anything else is judged, so a newer bundle gets "upgrade" (§16).
    manifest = Manifest.from_json(read_at(moff, minfo.file_size))
    members = {name: (locate(name, info), info.file_size) for name, info in files.items()}
    spans = [(minfo.header_offset, moff + minfo.file_size, MANIFEST_MEMBER)]
    spans += [(files[name].header_offset, off + size, name) for name, (off, size) in members.items()]
    spans += [(info.header_offset, locate(info.orig_filename, info) + info.file_size, info.orig_filename)
              for info in dirs]
    _check_layout(spans, end.cd_offset)
    _cross_check(manifest, {name: size for name, (_, size) in members.items()})
    return manifest, members


def _local_data_offset(name: str, info: zipfile.ZipInfo, read_at: _ReadAt, start_dir: int) -> int:
    """Check one entry's local header against the central directory; return its data offset."""
    _check_flags(name, info.flag_bits)
    if info.compress_type != zipfile.ZIP_STORED:
        raise BundleError(f"uses compression method {info.compress_type}; bundle members must be "
                          "stored uncompressed (ZIP_STORED)", member=name)
    if info.compress_size != info.file_size:
        raise BundleError("stored member has different compressed and uncompressed sizes", member=name)
    off = info.header_offset
    header = read_at(off, LOCAL_HEADER.size) if 0 <= off <= start_dir - LOCAL_HEADER.size else b""
    if len(header) != LOCAL_HEADER.size:
        raise BundleError("local header lies outside the archive (truncated bundle?)", member=name)
    sig, _, flags, method, _, _, _, csize, usize, nlen, elen = LOCAL_HEADER.unpack(header)
    if sig != LOCAL_SIG:
        raise BundleError("zip directory points at something that is not a local file header", member=name)
    _check_flags(name, flags)
    if method != zipfile.ZIP_STORED:
        raise BundleError(f"uses compression method {method}; bundle members must be stored "
                          "uncompressed (ZIP_STORED)", member=name)
    tail = read_at(off + LOCAL_HEADER.size, nlen + elen)
    if len(tail) != nlen + elen:
        raise BundleError("local header is truncated", member=name)
    try:
        local_name = tail[:nlen].decode("utf-8" if flags & FLAG_UTF8 else "cp437")
    except UnicodeDecodeError:
        local_name = None
    if local_name != name:
        raise BundleError(f"local header names {local_name!r}: the zip directory is inconsistent", member=name)
    if 0xFFFFFFFF in (csize, usize):
        usize, csize = _zip64_local_sizes(name, tail[nlen:], usize, csize)
    if (usize, csize) != (info.file_size, info.compress_size):
        raise BundleError(f"local header says {usize} bytes, the zip directory {info.file_size}", member=name)
    data = off + LOCAL_HEADER.size + nlen + elen
    if data + info.file_size > start_dir:
        raise BundleError("data runs past the start of the zip directory (truncated or overlapping)", member=name)
    return data


def _check_flags(name: str, flags: int) -> None:
    """Refuse encryption and data descriptors, from the central or the local header (§1.2)."""
    if flags & FLAGS_ENCRYPTION:
        raise BundleError("is encrypted; bundle members must be plain", member=name)
    if flags & FLAG_DESCRIPTOR:
        raise BundleError("uses a data descriptor (general purpose flag bit 3); bundle members must carry their "
                          "sizes and CRC in the local header", member=name)


def _zip64_local_sizes(name: str, extra: bytes, usize: int, csize: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + length]
        if hid == ZIP64_EXTRA_ID:
            values = [usize, csize]
            wanted = [i for i, v in enumerate(values) if v == 0xFFFFFFFF]
            if len(body) < 8 * len(wanted):
                break
            for k, i in enumerate(wanted):
                values[i] = struct.unpack_from("<Q", body, 8 * k)[0]
            return values[0], values[1]
        pos += 4 + length
    raise BundleError("local header lacks the zip64 sizes it announces", member=name)


# ---- both forms -------------------------------------------------------------------------------
def _cross_check(manifest: Manifest, actual: Mapping[str, int]) -> None:
    """What is there (``{name: size}``, manifest.json aside) is exactly what the manifest lists."""
    for name in sorted(actual):
        if name not in manifest.files:
            raise BundleError("is in the bundle but not listed in manifest.json", member=name)
    for name, entry in manifest.files.items():
        if name not in actual:
            raise BundleError("is listed in manifest.json but missing from the bundle", member=name)
        if actual[name] != entry.size:
            raise BundleError(f"is {actual[name]} bytes but manifest.json says {entry.size}", member=name)


# ---- the directory form -----------------------------------------------------------------------
def _parse_dir(path: Path) -> tuple[Manifest, dict[str, tuple[str, int]]]:
    """Validate a directory bundle; return (manifest, {name: (real path, size)})."""
    root = os.path.realpath(path)
    files: dict[str, tuple[str, int]] = {}
    pending = [("", root)]
    seen, limit = 0, 2 * manifest_rules.MAX_MEMBERS + 1  # files and directories, as for the zip form's entries
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as it:
            for entry in it:
                name = prefix + entry.name
                seen += 1
                if seen > limit:
                    raise BundleError(f"not a bundle: {str(path)!r} holds more than {limit} files and directories "
                                      f"(the limit: {manifest_rules.MAX_MEMBERS} members plus directories)")
                check_name(name)
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([root, target]) != root or target == root:
                        raise BundleError("is a symlink that resolves outside the bundle directory", member=name)
                    try:
                        st = os.stat(target)
                    except OSError:
                        raise BundleError("is a dangling symlink", member=name) from None
                    if not stat.S_ISREG(st.st_mode):
                        raise BundleError("is a symlink to something that is not a regular file", member=name)
                    files[name] = (target, st.st_size)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append((name + "/", entry.path))
                elif entry.is_file(follow_symlinks=False):
                    files[name] = (entry.path, entry.stat(follow_symlinks=False).st_size)
                else:
                    raise BundleError("is not a regular file", member=name)
                if len(files) > manifest_rules.MAX_MEMBERS + 1:
                    raise BundleError(f"not a bundle: {str(path)!r} has more than {manifest_rules.MAX_MEMBERS} members "
                                      "(the limit)")
    if MANIFEST_MEMBER not in files:
        raise BundleError(f"missing from directory {str(path)!r}: not an engine bundle", member=MANIFEST_MEMBER)
    mpath, msize = files.pop(MANIFEST_MEMBER)
    if msize > manifest_rules.MAX_MANIFEST_BYTES:
        raise BundleError(f"is {msize} bytes, over the {manifest_rules.MAX_MANIFEST_BYTES}-byte limit",
                          member=MANIFEST_MEMBER)
    with open(mpath, "rb") as f:
        manifest = Manifest.from_json(f.read(manifest_rules.MAX_MANIFEST_BYTES + 1))
    _cross_check(manifest, {name: size for name, (_, size) in files.items()})
    return manifest, files

