"""Bundle format v1, the byte-level container: members, manifest, limits and atomic saving.

A bundle is either a zip archive (suffix ``.cgb``, every member ZIP_STORED) or a directory with
the same tree. This module knows nothing about what members mean; it only guarantees that what it
hands out is exactly what the manifest describes:

* ``manifest.json`` lists every other member with its size and sha256. Unlisted or missing members
  are refused, so a bundle cannot smuggle in files nobody accounted for.
* The **identity** (cache key) is the sha256 of the canonical JSON of the ``files`` entries, except
  ``dispatch_table.txt``: re-tuning dispatch must not invalidate caches keyed on the compiled graph.
* ``weights.bin`` starts at a 4096-aligned file offset, so it can be memory-mapped straight out of
  the zip without extraction. Alignment is done zipalign-style by padding the local header's extra
  field; readers therefore take data offsets from the *local* header, never the central directory.
* Every defect (bad names, truncation, inconsistent zip directory, limits, hash mismatch) is a
  :class:`~engine.errors.BundleError` naming the member, never a raw zipfile/struct/OS error.

Saving is atomic (temp file or temp tree beside the target, fsync, rename), so a crash or an
exception mid-write never leaves a half-written bundle where a good one was.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import types
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Union

import attrs

from engine.errors import BundleError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MEMBERS",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "WEIGHTS_ALIGNMENT",
    "MemberData",
    "ManifestEntry",
    "Manifest",
    "BundleArchive",
    "write_bundle",
    "bundle_to_bytes",
    "copy_members",
]

FORMAT_NAME = "engine.bundle"
FORMAT_VERSION = 1
MAX_MEMBERS = 10_000  # members listed in the manifest (manifest.json itself not counted)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_METADATA_BYTES = 64 * 1024 * 1024  # default cap for BundleArchive.read()
WEIGHTS_ALIGNMENT = 4096

MANIFEST_MEMBER = "manifest.json"
WEIGHTS_MEMBER = "weights.bin"
_IDENTITY_EXCLUDED = frozenset({"dispatch_table.txt"})

MemberData = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]

# ---- zip structures (APPNOTE.TXT) -------------------------------------------------------------
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes + name + extra
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes + name + extra + comment
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<IIQI")
_LOCAL_SIG, _CENTRAL_SIG, _EOCD_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_EOCD64_SIG, _EOCD64_LOCATOR_SIG = 0x06064B50, 0x07064B50
_ZIP64_EXTRA_ID = 0x0001
_ALIGN_EXTRA_ID = 0xD935  # the id Android's zipalign uses for its padding record
_FLAG_ENCRYPTED, _FLAG_UTF8 = 0x0001, 0x0800
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes/offsets at or above this need zip64 records (tests lower it)
_DOS_DATE, _DOS_TIME = (0 << 9) | (1 << 5) | 1, 0  # 1980-01-01 00:00: byte-reproducible output
_MADE_BY_UNIX = 3 << 8
_UNIX_FILE_ATTRS = (stat.S_IFREG | 0o644) << 16

_CHUNK = 8 * 1024 * 1024  # streaming granularity for hashing, writing and verify()
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")
_VERSION_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?")


# ---- names ------------------------------------------------------------------------------------
def _name_problem(name: object) -> str | None:
    """Why ``name`` is not a safe relative POSIX member name, or None if it is.

    The rules are strict (no ``.``/``..``/empty components, no backslashes, no drive letters) so
    that one member name can mean only one file, both inside a zip and in the directory form.
    """
    if not isinstance(name, str) or not name:
        return "member names must be non-empty strings"
    if "\x00" in name:
        return "member name contains a NUL character"
    if "\\" in name:
        return "member name contains a backslash (names are POSIX paths with '/')"
    if name.startswith("/"):
        return "member name is absolute"
    if _DRIVE_RE.match(name):
        return "member name starts with a drive letter"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return f"member name has a {part!r} path component" if part else "member name has an empty component"
    return None


def _check_name(name: str) -> None:
    problem = _name_problem(name)
    if problem is not None:
        raise BundleError(f"{problem}: {name!r}", member=name if isinstance(name, str) else repr(name))


# ---- manifest ---------------------------------------------------------------------------------
def _check_entry_size(_inst, _attr, value):
    if type(value) is not int or value < 0:
        raise ValueError(f"size must be a non-negative int, got {value!r}")


def _check_entry_sha(_inst, _attr, value):
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise ValueError(f"sha256 must be 64 lowercase hex digits, got {value!r}")


@attrs.frozen
class ManifestEntry:
    """Size and sha256 (lowercase hex) of one member."""

    size: int = attrs.field(validator=_check_entry_size)
    sha256: str = attrs.field(validator=_check_entry_sha)


def _freeze_files(files: Mapping[str, ManifestEntry]) -> Mapping[str, ManifestEntry]:
    for name, entry in files.items():
        if not isinstance(entry, ManifestEntry):
            raise TypeError(f"manifest entry for {name!r} must be a ManifestEntry")
    return types.MappingProxyType(dict(sorted(files.items())))


def _no_duplicate_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r} in a JSON object")
        obj[key] = value
    return obj


@attrs.frozen
class Manifest:
    """The parsed ``manifest.json``. ``format_version`` is ``(major, minor)``."""

    format_version: tuple[int, int] = attrs.field(converter=tuple)
    engine_version: str
    files: Mapping[str, ManifestEntry] = attrs.field(converter=_freeze_files, hash=False)
    identity: str = attrs.field(init=False)

    @identity.default
    def _compute_identity(self) -> str:
        # Canonical JSON: sorted keys, no whitespace, UTF-8 (non-ASCII names are not escaped).
        entries = {
            name: {"sha256": e.sha256, "size": e.size}
            for name, e in self.files.items()
            if name not in _IDENTITY_EXCLUDED
        }
        canon = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | str) -> Manifest:
        """Parse and validate; every shape error names ``manifest.json`` and the JSON path.

        Unknown keys are ignored so that minor format versions can add fields; the version is
        checked before anything else so that a newer bundle gets the "upgrade" message rather
        than a confusing shape error.
        """
        m = MANIFEST_MEMBER
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BundleError(f"is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit", member=m)
        try:
            doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise BundleError(f"is not valid JSON: {e}", member=m) from None
        if not isinstance(doc, dict):
            raise BundleError("must be a JSON object", member=m, path="$")
        if doc.get("format") != FORMAT_NAME:
            raise BundleError(
                f"expected {FORMAT_NAME!r}, got {doc.get('format')!r}: not an engine bundle",
                member=m, path="$.format",
            )
        version = _parse_format_version(doc.get("format_version"))
        engine_version = doc.get("engine_version")
        if not isinstance(engine_version, str):
            raise BundleError(f"must be a string, got {engine_version!r}", member=m, path="$.engine_version")
        files = doc.get("files")
        if not isinstance(files, dict):
            raise BundleError("must be an object mapping member names to {size, sha256}", member=m, path="$.files")
        if len(files) > MAX_MEMBERS:
            raise BundleError(f"lists {len(files)} members, over the limit of {MAX_MEMBERS}", member=m, path="$.files")
        entries = {}
        for name, entry in files.items():
            where = f"$.files[{name!r}]"
            problem = _name_problem(name)
            if problem is None and name == MANIFEST_MEMBER:
                problem = "manifest.json cannot list itself"
            if problem is not None:
                raise BundleError(problem, member=m, path=where)
            if not isinstance(entry, dict):
                raise BundleError("must be an object with 'size' and 'sha256'", member=m, path=where)
            size, sha = entry.get("size"), entry.get("sha256")
            if type(size) is not int or size < 0:
                raise BundleError(f"must be a non-negative integer, got {size!r}", member=m, path=where + ".size")
            if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
                raise BundleError(f"must be 64 lowercase hex digits, got {sha!r}", member=m, path=where + ".sha256")
            entries[name] = ManifestEntry(size, sha)
        return cls(format_version=version, engine_version=engine_version, files=entries)

    def to_json(self) -> bytes:
        major, minor = self.format_version
        doc = {
            "format": FORMAT_NAME,
            "format_version": major if minor == 0 else f"{major}.{minor}",
            "engine_version": self.engine_version,
            "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in self.files.items()},
        }
        return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _parse_format_version(raw: object) -> tuple[int, int]:
    where = "$.format_version"
    match = _VERSION_RE.fullmatch(raw) if isinstance(raw, str) else None
    if type(raw) is int:
        major, minor = raw, 0
    elif match:
        major, minor = int(match.group(1)), int(match.group(2) or 0)
    else:
        raise BundleError(f"must be an integer or a 'major.minor' string, got {raw!r}",
                          member=MANIFEST_MEMBER, path=where)
    if major > FORMAT_VERSION:
        raise BundleError(
            f"bundle format_version {raw} is newer than this engine supports ({FORMAT_VERSION}): upgrade engine",
            member=MANIFEST_MEMBER, path=where,
        )
    if major < FORMAT_VERSION:
        raise BundleError(f"bundle format_version {raw} is not supported (this engine reads {FORMAT_VERSION})",
                          member=MANIFEST_MEMBER, path=where)
    return (major, minor)


# ---- reading ----------------------------------------------------------------------------------
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
                manifest, members = _parse_dir(path)
                return cls(form="dir", path=path, manifest=manifest, members=members)
            file = open(path, "rb")
            fd = file.fileno()
            manifest, members = _parse_zip(file, lambda off, n: _pread(fd, n, off),
                                           os.fstat(fd).st_size, str(path))
            return cls(form="zip", path=path, manifest=manifest, members=members, fd=fd, file=file)
        except BaseException as e:
            if file is not None:
                file.close()
            if isinstance(e, OSError):
                raise BundleError(f"not a bundle: cannot read {str(path)!r}: {e.strerror or e}") from e
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


def _parse_zip(fileobj, read_at, total: int, where: str):
    """Validate a zip bundle; return (manifest, {name: (data offset, size)})."""
    try:
        with zipfile.ZipFile(fileobj) as zf:
            infos, start_dir = zf.infolist(), zf.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, OSError,
            ValueError, struct.error, OverflowError) as e:
        if total == 0:
            raise BundleError(f"not a bundle: {where} is empty") from None
        if read_at(0, 4) in (b"PK\x03\x04", b"PK\x05\x06"):
            raise BundleError(f"truncated bundle: {where} is cut short or its zip directory is damaged ({e})") from None
        raise BundleError(f"not a bundle: {where} is not a zip archive ({e})") from None

    entries: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.orig_filename  # zipfile's .filename is silently cut at NUL; check the raw name
        if name.endswith("/"):
            continue  # directory entries carry no data
        if name in entries:
            raise BundleError("appears more than once in the zip directory", member=name)
        entries[name] = info
        if len(entries) > MAX_MEMBERS + 1:
            raise BundleError(f"not a bundle: {where} has more than {MAX_MEMBERS} members (the limit)")

    def locate(name: str, info: zipfile.ZipInfo) -> int:
        return _local_data_offset(name, info, read_at, start_dir)

    if MANIFEST_MEMBER not in entries:
        raise BundleError(f"missing from {where}: this zip archive is not an engine bundle", member=MANIFEST_MEMBER)
    minfo = entries.pop(MANIFEST_MEMBER)
    if minfo.file_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"is {minfo.file_size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
                          member=MANIFEST_MEMBER)
    moff = locate(MANIFEST_MEMBER, minfo)
    manifest = Manifest.from_json(read_at(moff, minfo.file_size))
    for name in entries:
        _check_name(name)
    members = {name: (locate(name, info), info.file_size) for name, info in entries.items()}
    # Member byte ranges (local header through data) must not overlap: one byte, one member.
    spans = [(minfo.header_offset, moff + minfo.file_size, MANIFEST_MEMBER)]
    spans += [(entries[name].header_offset, off + size, name) for name, (off, size) in members.items()]
    spans.sort()
    for (_, end, prev), (start, _, name) in zip(spans, spans[1:]):
        if start < end:
            raise BundleError(f"overlaps member {prev!r} in the zip file", member=name)
    _cross_check(manifest, {name: size for name, (_, size) in members.items()})
    return manifest, members


def _local_data_offset(name: str, info: zipfile.ZipInfo, read_at, start_dir: int) -> int:
    """Check one entry's local header against the central directory; return its data offset."""
    if info.flag_bits & _FLAG_ENCRYPTED:
        raise BundleError("is encrypted; bundle members must be plain", member=name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise BundleError(f"uses compression method {info.compress_type}; bundle members must be "
                          "stored uncompressed (ZIP_STORED)", member=name)
    if info.compress_size != info.file_size:
        raise BundleError("stored member has different compressed and uncompressed sizes", member=name)
    off = info.header_offset
    header = read_at(off, _LOCAL.size) if 0 <= off <= start_dir - _LOCAL.size else b""
    if len(header) != _LOCAL.size:
        raise BundleError("local header lies outside the archive (truncated bundle?)", member=name)
    sig, _, flags, method, _, _, _, csize, usize, nlen, elen = _LOCAL.unpack(header)
    if sig != _LOCAL_SIG:
        raise BundleError("zip directory points at something that is not a local file header", member=name)
    if method != zipfile.ZIP_STORED:
        raise BundleError(f"uses compression method {method}; bundle members must be stored "
                          "uncompressed (ZIP_STORED)", member=name)
    tail = read_at(off + _LOCAL.size, nlen + elen)
    if len(tail) != nlen + elen:
        raise BundleError("local header is truncated", member=name)
    try:
        local_name = tail[:nlen].decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
    except UnicodeDecodeError:
        local_name = None
    if local_name != name:
        raise BundleError(f"local header names {local_name!r}: the zip directory is inconsistent", member=name)
    if 0xFFFFFFFF in (csize, usize):
        usize, csize = _zip64_local_sizes(name, tail[nlen:], usize, csize)
    if (usize, csize) != (info.file_size, info.compress_size):
        raise BundleError(f"local header says {usize} bytes, the zip directory {info.file_size}", member=name)
    data = off + _LOCAL.size + nlen + elen
    if data + info.file_size > start_dir:
        raise BundleError("data runs past the start of the zip directory (truncated or overlapping)", member=name)
    return data


def _zip64_local_sizes(name: str, extra: bytes, usize: int, csize: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + length]
        if hid == _ZIP64_EXTRA_ID:
            values = [usize, csize]
            wanted = [i for i, v in enumerate(values) if v == 0xFFFFFFFF]
            if len(body) < 8 * len(wanted):
                break
            for k, i in enumerate(wanted):
                values[i] = struct.unpack_from("<Q", body, 8 * k)[0]
            return values[0], values[1]
        pos += 4 + length
    raise BundleError("local header lacks the zip64 sizes it announces", member=name)


def _cross_check(manifest: Manifest, actual: Mapping[str, int]) -> None:
    for name in sorted(actual):
        if name not in manifest.files:
            raise BundleError("is in the bundle but not listed in manifest.json", member=name)
    for name, entry in manifest.files.items():
        if name not in actual:
            raise BundleError("is listed in manifest.json but missing from the bundle", member=name)
        if actual[name] != entry.size:
            raise BundleError(f"is {actual[name]} bytes but manifest.json says {entry.size}", member=name)


def _parse_dir(path: Path):
    """Validate a directory bundle; return (manifest, {name: (real path, size)})."""
    root = os.path.realpath(path)
    files: dict[str, tuple[str, int]] = {}
    pending = [("", root)]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as it:
            for entry in it:
                name = prefix + entry.name
                _check_name(name)
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
                if len(files) > MAX_MEMBERS + 1:
                    raise BundleError(f"not a bundle: {str(path)!r} has more than {MAX_MEMBERS} members (the limit)")
    if MANIFEST_MEMBER not in files:
        raise BundleError(f"missing from directory {str(path)!r}: not an engine bundle", member=MANIFEST_MEMBER)
    mpath, msize = files.pop(MANIFEST_MEMBER)
    if msize > MAX_MANIFEST_BYTES:
        raise BundleError(f"is {msize} bytes, over the {MAX_MANIFEST_BYTES}-byte limit", member=MANIFEST_MEMBER)
    with open(mpath, "rb") as f:
        manifest = Manifest.from_json(f.read(MAX_MANIFEST_BYTES + 1))
    _cross_check(manifest, {name: size for name, (_, size) in files.items()})
    return manifest, files


# ---- writing ----------------------------------------------------------------------------------
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


def _plan(members: Mapping[str, MemberData], engine_version: str) -> list[str]:
    """Validate names; return the write order: sorted, weights.bin last (metadata at the front)."""
    if not isinstance(members, Mapping):
        raise TypeError("members must be a mapping of member name -> data")
    if not isinstance(engine_version, str):
        raise TypeError("engine_version must be a string")
    if len(members) > MAX_MEMBERS:
        raise BundleError(f"too many members: {len(members)} > {MAX_MEMBERS}")
    for name in members:
        _check_name(name)
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
    blob = manifest.to_json()
    if len(blob) > MAX_MANIFEST_BYTES:
        raise BundleError(f"would be {len(blob)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
                          member=MANIFEST_MEMBER)
    return blob


class _ZipWriter:
    """Minimal STORED-only zip writer with exact control over local extra fields.

    ``fp`` must be seekable: the CRC-32 is only known after streaming the data, so it is patched
    into the local header afterwards (no data descriptors, local and central records agree).
    """

    def __init__(self, fp):
        self.fp, self.pos, self.central = fp, 0, []

    def _write(self, data) -> None:
        self.fp.write(data)
        self.pos += len(data)

    def add(self, name: str, views: list[memoryview], size: int, align: int = 1) -> str:
        name_b = name.encode("utf-8")
        flags = 0 if name.isascii() else _FLAG_UTF8
        offset = self.pos
        big = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size) if big else b""
        if align > 1:  # zipalign-style record: id, length, u16 alignment, zero padding
            unpadded = offset + _LOCAL.size + len(name_b) + len(extra) + 6
            pad = -unpadded % align
            extra += struct.pack("<HHH", _ALIGN_EXTRA_ID, 2 + pad, align) + bytes(pad)
        size32 = 0xFFFFFFFF if big else size
        version = 45 if big else 20
        self._write(_LOCAL.pack(_LOCAL_SIG, version, flags, 0, _DOS_TIME, _DOS_DATE, 0,
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
        cextra = struct.pack(f"<HH{len(wide)}Q", _ZIP64_EXTRA_ID, 8 * len(wide), *wide) if wide else b""
        clamp = lambda v: 0xFFFFFFFF if v >= _ZIP64_LIMIT else v  # noqa: E731
        version = 45 if wide else 20
        self.central.append(_CENTRAL.pack(
            _CENTRAL_SIG, _MADE_BY_UNIX | version, version, flags, 0, _DOS_TIME, _DOS_DATE, crc,
            clamp(size), clamp(size), len(name_b), len(cextra), 0, 0, 0, _UNIX_FILE_ATTRS, clamp(offset),
        ) + name_b + cextra)
        return digest.hexdigest()

    def finish(self) -> None:
        cd_offset, count = self.pos, len(self.central)
        cd = b"".join(self.central)
        self._write(cd)
        if cd_offset >= _ZIP64_LIMIT or len(cd) >= _ZIP64_LIMIT or count >= 0xFFFF:
            eocd64 = self.pos
            self._write(_EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, _MADE_BY_UNIX | 45, 45, 0, 0,
                                     count, count, len(cd), cd_offset))
            self._write(_EOCD64_LOCATOR.pack(_EOCD64_LOCATOR_SIG, 0, eocd64, 1))
        n16 = min(count, 0xFFFF)
        self._write(_EOCD.pack(_EOCD_SIG, 0, 0, n16, n16, min(len(cd), 0xFFFFFFFF),
                               min(cd_offset, 0xFFFFFFFF), 0))


def _write_zip(fp, members: Mapping[str, MemberData], order: list[str], engine_version: str) -> Manifest:
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


def _write_file(path: Path, views: list[memoryview]) -> str:
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


def _write_tree(root: Path, members: Mapping[str, MemberData], order: list[str], engine_version: str) -> Manifest:
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
            _fsync_dir(d)
    return manifest


def _fsync_dir(path: Path) -> None:
    """Persist a directory entry (rename/create). Best effort: not possible on every platform."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _swap_in(tmp: Path, target: Path, tag: str) -> None:
    """Move the finished ``tmp`` to ``target``.

    Files replacing files use one atomic ``os.replace``. A directory cannot be atomically replaced
    portably, so it is swapped: rename the old target aside, rename the new one in, delete the old.
    Between the two renames (a few microseconds) ``target`` does not exist; a reader opening it
    then gets "not a bundle" and a crash then leaves the old bundle at ``.<name>.old-<random>``.
    """
    if os.path.lexists(target) and (tmp.is_dir() or (target.is_dir() and not target.is_symlink())):
        old = target.with_name(f".{target.name}.old-{tag}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        _remove(old)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)


def write_bundle(target: str | os.PathLike, members: Mapping[str, MemberData], *, engine_version: str,
                 form: Literal["zip", "dir"] = "zip") -> Manifest:
    """Write a bundle atomically and return its manifest.

    Sizes and sha256 are computed while streaming the data (one pass). The bundle is built in
    ``.<name>.tmp-<random>`` beside ``target`` and fsynced before it replaces ``target``; on any
    exception the temp file/tree is removed and an existing ``target`` is left untouched. Replacing
    a bundle that is currently open (e.g. re-saving via copy_members) is safe: open maps keep
    referring to the old file's data.
    """
    if form not in ("zip", "dir"):
        raise ValueError(f"form must be 'zip' or 'dir', got {form!r}")
    order = _plan(members, engine_version)
    target = Path(os.fspath(target))
    tag = secrets.token_hex(8)
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    try:
        if form == "zip":
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            with open(fd, "wb") as f:
                manifest = _write_zip(f, members, order, engine_version)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.mkdir(tmp)
            manifest = _write_tree(tmp, members, order, engine_version)
        _swap_in(tmp, target, tag)
    except BaseException:
        if os.path.lexists(tmp):
            _remove(tmp)
        raise
    return manifest


def bundle_to_bytes(members: Mapping[str, MemberData], *, engine_version: str) -> bytes:
    """The zip form in memory (byte-identical to what write_bundle writes for the same members)."""
    order = _plan(members, engine_version)
    buf = io.BytesIO()
    _write_zip(buf, members, order, engine_version)
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
