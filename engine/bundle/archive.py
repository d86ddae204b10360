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

Saving is atomic (temp file or temp tree beside the target, fsync, rename or atomic exchange), so a
crash or an exception mid-write never leaves a half-written bundle, or none, where a good one was.
A save killed outright can strand its temporary; the next save to the same target removes it.
"""

from __future__ import annotations

import ctypes
import errno
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
import sys
import threading
import types
import unicodedata
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import attrs

from engine.bundle.jsonread import INT64_MAX, INT64_MIN, clip
from engine.bundle.text import utf8_problem
from engine.bundle.target import check_replaceable
from engine.errors import BundleError, BundleFileError, BundleNotFoundError, SaveError, SaveTargetError
from engine.safefiles import FLOCK, fsync_dir, lock_fd

#: How a zip archive (a file bundle) starts: a local file header, or the end record of an empty one.
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")

__all__ = [
    "ZIP_MAGIC",
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
    "check_save_target",
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
def _as_tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple`` as an attrs converter mypy can type (``converter=tuple`` leaves its parameter generic)."""
    return tuple(value)


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
_VERSION_RE = re.compile(r"([0-9]{1,9})(?:\.([0-9]{1,9}))?")  # ASCII digits, bounded: int() never sees more

# Reading: what a zip entry may carry (§1.2). Bit 3 means sizes and CRC follow the data in a
# descriptor instead of the local header; bits 0, 6 and 13 are the encryption variants.
_FLAG_DESCRIPTOR = 0x0008
_FLAGS_ENCRYPTION = _FLAG_ENCRYPTED | 0x0040 | 0x2000
# Characters no member name may hold (by Unicode category): controls (a newline would forge log
# lines), lone surrogates (not UTF-8: a non-UTF-8 file name in the directory form), line breaks.
_UNSAFE_NAME_CHARS = {"Cc": "a control character", "Cs": "a lone surrogate (not UTF-8)",
                      "Zl": "a line separator", "Zp": "a paragraph separator"}


# ---- names ------------------------------------------------------------------------------------
def _name_problem(name: object) -> str | None:
    """Why ``name`` is not a safe relative POSIX member name, or None if it is.

    The rules are strict (no ``.``/``..``/empty components, no backslashes, no drive letters) so
    that one member name can mean only one file, both inside a zip and in the directory form; no
    control characters, line breaks or lone surrogates, so that a name prints on one line and is
    UTF-8 in both forms.
    """
    if not isinstance(name, str) or not name:
        return "member names must be non-empty strings"
    if "\x00" in name:
        return "member name contains a NUL character"
    unsafe = _unsafe_char(name)
    if unsafe is not None:
        return unsafe
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


def _unsafe_char(name: str) -> str | None:
    """The first character of ``name`` no member name may hold, described, or None."""
    if name.isprintable():  # the common case; everything refused below is non-printable
        return None
    for ch in name:
        what = _UNSAFE_NAME_CHARS.get(unicodedata.category(ch))
        if what is not None:
            return f"member name contains {what} (U+{ord(ch):04X})"
    return None


def _check_name(name: str) -> None:
    problem = _name_problem(name)
    if problem is not None:
        shown = clip(name, 200) if isinstance(name, str) else repr(name)
        raise BundleError(f"{problem}: {shown}", member=name if isinstance(name, str) else shown)


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
            raise ValueError(f"duplicate key {clip(key)} in a JSON object")
        obj[key] = value
    return obj


def _no_constants(name: str):
    raise ValueError(f"non-standard JSON constant {name} (JSON members may not hold NaN or Infinity)")


class _BigInteger:
    """A JSON integer outside int64, kept as its text: no manifest field accepts it, and no huge
    ``int`` is ever built from it (Python refuses to convert more than 4300 digits, with a bare
    ValueError). Unknown keys may hold one harmlessly."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"integer {clip(self.text)}"


def _bounded_int(text: str) -> int | _BigInteger:
    # json's tokens are -?(0|[1-9][0-9]*) in ASCII: 20 characters hold any int64 and are cheap to convert.
    if len(text) <= 20:
        value = int(text)
        if INT64_MIN <= value <= INT64_MAX:
            return value
    return _BigInteger(text)


def _shown(value: object) -> str:
    """A JSON value for a one-line message: strings quoted and clipped, containers by kind."""
    if isinstance(value, str):
        return clip(value)
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else repr(value)


def _manifest_doc(raw: bytes) -> object:
    """``manifest.json`` parsed as strict JSON: UTF-8 only (``json.loads`` given bytes would also
    take UTF-16/32 and a byte-order mark), no duplicate keys, no NaN, integers bounded."""
    problem = utf8_problem(raw)
    if problem is not None:
        raise BundleError(f"is not valid JSON: {problem}", member=MANIFEST_MEMBER)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_no_constants, parse_int=_bounded_int)
    except RecursionError:
        raise BundleError("is not valid JSON: nested too deeply", member=MANIFEST_MEMBER) from None
    except ValueError as e:  # JSONDecodeError, and the hooks above
        raise BundleError(f"is not valid JSON: {e}", member=MANIFEST_MEMBER) from None


@attrs.frozen
class Manifest:
    """The parsed ``manifest.json``. ``format_version`` is ``(major, minor)``."""

    format_version: tuple[int, int] = attrs.field(converter=_as_tuple)
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
        raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BundleError(f"is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit", member=m)
        doc = _manifest_doc(raw)
        if not isinstance(doc, dict):
            raise BundleError("must be a JSON object", member=m, path="$")
        if doc.get("format") != FORMAT_NAME:
            raise BundleError(
                f"expected {FORMAT_NAME!r}, got {_shown(doc.get('format'))}: not an engine bundle",
                member=m, path="$.format",
            )
        version = _parse_format_version(doc.get("format_version"))
        engine_version = doc.get("engine_version")
        if not isinstance(engine_version, str):
            raise BundleError(f"must be a string, got {_shown(engine_version)}", member=m, path="$.engine_version")
        files = doc.get("files")
        if not isinstance(files, dict):
            raise BundleError("must be an object mapping member names to {size, sha256}", member=m, path="$.files")
        if len(files) > MAX_MEMBERS:
            raise BundleError(f"lists {len(files)} members, over the limit of {MAX_MEMBERS}", member=m, path="$.files")
        entries = {}
        for name, entry in files.items():
            where = f"$.files[{clip(name, 200)}]"
            problem = _name_problem(name)
            if problem is None and name == MANIFEST_MEMBER:
                problem = "manifest.json cannot list itself"
            if problem is not None:
                raise BundleError(problem, member=m, path=where)
            if not isinstance(entry, dict):
                raise BundleError("must be an object with 'size' and 'sha256'", member=m, path=where)
            size, sha = entry.get("size"), entry.get("sha256")
            if type(size) is not int or size < 0:
                raise BundleError(f"must be a non-negative integer (at most 2**63-1), got {_shown(size)}",
                                  member=m, path=where + ".size")
            if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
                raise BundleError(f"must be 64 lowercase hex digits, got {_shown(sha)}", member=m,
                                  path=where + ".sha256")
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
    """``(major, minor)`` from ``1``, ``"1"`` or ``"1.3"``.

    Strings must be ASCII digits, at most 9 per part: ``int()`` would also take other scripts'
    digits, underscores and signs, and raises a bare ValueError past 4300 digits.
    """
    where = "$.format_version"
    match = _VERSION_RE.fullmatch(raw) if isinstance(raw, str) else None
    if type(raw) is int:  # bounded to int64 by the manifest's JSON reader
        major, minor = raw, 0
    elif match:
        major, minor = int(match.group(1)), int(match.group(2) or 0)
    else:
        raise BundleError(f"must be an integer or a 'major.minor' string of ASCII digits, got {_shown(raw)}",
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


@attrs.frozen
class _ZipEnd:
    """What the end-of-central-directory records say (zip64 values where present)."""

    entries: int
    cd_offset: int
    cd_size: int
    start: int  # offset of the first end record (the zip64 one where present): the directory ends here


def _unreadable(read_at, total: int, where: str, reason: object) -> BundleError:
    """The error for a file that is not a readable zip: empty, cut short, or something else entirely."""
    if total == 0:
        return BundleError(f"not a bundle: {where} is empty")
    if read_at(0, 4) in ZIP_MAGIC:
        return BundleError(f"truncated bundle: {where} is cut short or its zip directory is damaged ({reason})")
    return BundleError(f"not a bundle: {where} is not a zip archive ({reason})")


def _read_zip_end(read_at, total: int, where: str) -> _ZipEnd:
    """Find and check the end records, which must end the file exactly (§1.2).

    zipfile scans for the record and silently shifts every offset when the directory is not where
    the record says, so a file with bytes prepended, or two bundles concatenated, would open as
    the bundle inside it. Here the record's archive comment must reach the last byte and the
    directory must end exactly where the end records begin.
    """
    base = max(0, total - _EOCD.size - 0xFFFF)
    tail = read_at(base, total - base)
    pos = len(tail) - _EOCD.size
    stray = None
    while pos >= 0:
        pos = tail.rfind(b"PK\x05\x06", 0, pos + 4)
        if pos < 0:
            break
        _, disk, cd_disk, here, entries, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, pos)
        if pos + _EOCD.size + comment == len(tail):
            break
        if stray is None and pos + _EOCD.size + comment < len(tail) and cd_offset + cd_size == base + pos:
            stray = len(tail) - pos - _EOCD.size - comment
        pos -= 1
    if pos < 0:
        if stray is not None:
            raise BundleError(f"not a bundle as written: {stray} bytes follow the zip end record of {where} "
                              "(data appended to the archive?)")
        raise _unreadable(read_at, total, where, "no end-of-central-directory record ends the file")
    if (disk, cd_disk) != (0, 0) or here != entries:
        raise BundleError(f"not a bundle: {where} is a multi-disk (split) zip archive")
    start = base + pos
    locator = start - _EOCD64_LOCATOR.size
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


def _read_zip64_end(read_at, locator: int, where: str) -> tuple[int, int, int, int]:
    """(entries, directory offset, directory size, record offset) from the zip64 end record."""
    _, disk, record, disks = _EOCD64_LOCATOR.unpack(read_at(locator, _EOCD64_LOCATOR.size))
    raw = read_at(record, _EOCD64.size) if 0 <= record <= locator - _EOCD64.size else b""
    if len(raw) != _EOCD64.size or raw[:4] != b"PK\x06\x06":
        raise BundleError(f"truncated bundle: the zip64 end locator of {where} points at offset {record}, "
                          "where there is no zip64 end record")
    _, size, _, _, rdisk, cd_disk, here, entries, cd_size, cd_offset = _EOCD64.unpack(raw)
    if (disk, rdisk, cd_disk, disks) != (0, 0, 0, 1) or here != entries:
        raise BundleError(f"not a bundle: {where} is a multi-disk (split) zip archive")
    if record + 12 + size != locator:
        raise BundleError(f"not a bundle as written: the zip64 end record of {where} (offset {record}, {size + 12} "
                          f"bytes) does not end where its locator begins (offset {locator})")
    return entries, cd_offset, cd_size, record


def _zip_entries(fileobj, read_at, total: int, where: str, end: _ZipEnd) -> list[zipfile.ZipInfo]:
    """The central directory's entries (parsed by zipfile), checked against the end record."""
    limit = 2 * MAX_MEMBERS + 1  # members, manifest.json and as many directory entries
    if end.entries > limit:
        raise BundleError(f"not a bundle: {where} has {end.entries} zip entries, over the limit of {limit} "
                          f"({MAX_MEMBERS} members plus directory entries)")
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
        problem = _name_problem(name[:-1] if is_dir else name)
        if problem is not None:
            raise BundleError(f"{problem}: {clip(name, 200)}", member=name)
        table[name] = info
        if len(files) > MAX_MEMBERS + 1:
            raise BundleError(f"not a bundle: {where} has more than {MAX_MEMBERS} members (the limit)")
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


def _parse_zip(fileobj, read_at, total: int, where: str):
    """Validate a zip bundle; return (manifest, {name: (data offset, size)})."""
    end = _read_zip_end(read_at, total, where)
    files, dirs = _split_entries(_zip_entries(fileobj, read_at, total, where, end), where)

    def locate(name: str, info: zipfile.ZipInfo) -> int:
        return _local_data_offset(name, info, read_at, end.cd_offset)

    if MANIFEST_MEMBER not in files:
        raise BundleError(f"missing from {where}: this zip archive is not an engine bundle", member=MANIFEST_MEMBER)
    minfo = files.pop(MANIFEST_MEMBER)
    if minfo.file_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"is {minfo.file_size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
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


def _local_data_offset(name: str, info: zipfile.ZipInfo, read_at, start_dir: int) -> int:
    """Check one entry's local header against the central directory; return its data offset."""
    _check_flags(name, info.flag_bits)
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
    _check_flags(name, flags)
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


def _check_flags(name: str, flags: int) -> None:
    """Refuse encryption and data descriptors, from the central or the local header (§1.2)."""
    if flags & _FLAGS_ENCRYPTION:
        raise BundleError("is encrypted; bundle members must be plain", member=name)
    if flags & _FLAG_DESCRIPTOR:
        raise BundleError("uses a data descriptor (general purpose flag bit 3); bundle members must carry their "
                          "sizes and CRC in the local header", member=name)


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
    seen, limit = 0, 2 * MAX_MEMBERS + 1  # files and directories, as for the zip form's entries
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as it:
            for entry in it:
                name = prefix + entry.name
                seen += 1
                if seen > limit:
                    raise BundleError(f"not a bundle: {str(path)!r} holds more than {limit} files and directories "
                                      f"(the limit: {MAX_MEMBERS} members plus directories)")
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
            fsync_dir(d)
    return manifest


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# ---- temporaries: named, locked while in use, removed by the next save once abandoned ----------
# A save works in ``.<name>.tmp-<16 hex>`` beside the target (``.<name>.old-<16 hex>`` only in the
# portable directory swap). SIGKILL or a power cut can strand one; nothing can prevent that, since
# the data must be written somewhere before the rename publishes it. So every save holds an
# exclusive ``flock`` on its temporary while it runs (the kernel drops it when the process dies),
# and the next save to the same target removes the temporaries whose lock it can take.
def _temp_path(target: Path, kind: str, tag: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{tag}")


def _open_no_follow(path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))


def _still_names(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file or directory open as ``fd`` (not removed or replaced)."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _create_temp(target: Path, form: str) -> tuple[Path, str, int | None]:
    """A new temporary for ``target`` as ``(path, tag, fd)``, locked until ``fd`` is closed.

    A cleaner may remove the temporary between its creation and the lock; then it no longer has
    ``path`` as its name, and another name is tried. ``fd`` is None only for a directory where
    directories cannot be opened (non-POSIX).
    """
    while True:
        tag = secrets.token_hex(8)
        tmp = _temp_path(target, "tmp", tag)
        try:
            if form == "zip":
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o666)
            else:
                os.mkdir(tmp)
        except FileExistsError:
            continue
        if form == "dir":
            if not FLOCK:  # pragma: no cover - non-POSIX: a directory cannot be locked
                return tmp, tag, None
            try:
                fd = _open_no_follow(tmp)
            except FileNotFoundError:
                continue  # a cleaner removed it before it was locked
        if FLOCK:  # elsewhere a lock would not survive the rename nor tell a live save from a dead one
            lock_fd(fd, wait=True)
        if _still_names(fd, tmp):
            return tmp, tag, fd
        os.close(fd)


def _claim_abandoned(path: Path) -> int | None:
    """An fd holding the lock of temporary ``path`` if no live save owns it, else None."""
    if not FLOCK:  # pragma: no cover - non-POSIX: no liveness test, so nothing is ever cleaned
        return None
    try:
        fd = _open_no_follow(path)
    except OSError:
        return None
    if lock_fd(fd, wait=False) and _still_names(fd, path):
        return fd
    os.close(fd)
    return None


def _leftovers(target: Path) -> dict[str, dict[str, Path]]:
    """``{tag: {kind: path}}`` of the temporaries of saves to ``target`` in its directory."""
    pattern = re.compile(re.escape(f".{target.name}.") + r"(tmp|old)-([0-9a-f]{16})")
    try:
        names = os.listdir(target.parent)
    except OSError:
        return {}
    found: dict[str, dict[str, Path]] = {}
    for name in sorted(names):
        match = pattern.fullmatch(name)
        if match:
            found.setdefault(match.group(2), {})[match.group(1)] = target.with_name(name)
    return found


def _clean_leftovers(target: Path) -> None:
    """Remove what killed saves to ``target`` left beside it; never a running save's temporary.

    An ``old`` tree exists only if the portable directory swap died between its renames; if the
    target is missing then, it is the old bundle and is renamed back instead of removed. Errors are
    ignored: cleaning is housekeeping, and the save itself reports what stops it.
    """
    for tag, paths in _leftovers(target).items():
        fd = None
        if "tmp" in paths:
            fd = _claim_abandoned(paths["tmp"])
            if fd is None:
                continue  # a live save (or something we cannot open): leave all of this tag alone
        try:
            old = paths.get("old")
            if old is not None and not os.path.lexists(target):
                os.rename(old, target)
            elif old is not None:
                _remove(old)
            if fd is not None:
                _remove(paths["tmp"])
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)


# ---- swapping in ------------------------------------------------------------------------------
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_renameat2_fn: list = []  # [] until looked up, then [function or None]


def _renameat2():
    """glibc's ``renameat2`` (Linux 3.15+, glibc 2.28+), or None where there is none."""
    if not _renameat2_fn:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _renameat2_fn.append(fn)
    return _renameat2_fn[0]


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the OS or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


def _swap_by_renames(tmp: Path, target: Path, tag: str) -> None:
    """Portable directory swap: rename the old target aside, the new one in, delete the old.

    Between the two renames ``target`` does not exist: a reader then gets "not a bundle", and a
    crash leaves the old bundle at ``.<name>.old-<tag>``, which the next save renames back.
    """
    old = _temp_path(target, "old", tag)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    _remove(old)


def _swap_in(tmp: Path, target: Path, tag: str) -> None:
    """Move the finished ``tmp`` to ``target`` in one atomic step where the OS allows.

    Files replacing files use ``os.replace``. A directory (or a file replacing one) cannot be
    renamed over an existing target, so the two are exchanged atomically (``renameat2``
    ``RENAME_EXCHANGE``): readers and crashes see the old bundle or the new one, never neither. The
    old bundle then lies at ``tmp``, which the caller removes. Without the exchange (non-Linux, or
    a file system that lacks it) the portable two-rename swap is used.
    """
    if os.path.lexists(target) and (tmp.is_dir() or (target.is_dir() and not target.is_symlink())):
        if not _exchange(tmp, target):
            _swap_by_renames(tmp, target, tag)
    else:
        os.replace(tmp, target)
    fsync_dir(target.parent)


# ---- saving -----------------------------------------------------------------------------------
_SAVE_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "no space left: the disk quota is exceeded",
    errno.EFBIG: "no space: the file would exceed the file-size limit",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "its directory does not exist",
    errno.ENOTDIR: "a component of the path is not a directory",
}


def _save_error(target: Path, exc: OSError) -> SaveError:
    """``exc`` as a one-line ``SaveError`` naming the target and the reason in words."""
    reason = _SAVE_REASONS.get(exc.errno or 0, "the operating system refused")  # errno None: no reason known
    detail = f"{exc.strerror or exc}" + (f" at {exc.filename!r}" if exc.filename else "")
    return SaveError(f"cannot save the bundle {os.fspath(target)!r}: {reason} ({detail}); "
                     "the bundle that was there, if any, is unchanged", path=os.fspath(target), errno=exc.errno)


def _write_temp(tmp: Path, fd: int | None, form: str, members: Mapping[str, MemberData], order: list[str],
                engine_version: str) -> Manifest:
    """Write and fsync the whole bundle into the claimed temporary ``tmp`` (open, locked, as ``fd``)."""
    if form == "dir":
        return _write_tree(tmp, members, order, engine_version)
    assert fd is not None  # a zip temporary is always created open
    with open(fd, "wb", closefd=False) as f:  # the fd (and its lock) lives until the swap is done
        manifest = _write_zip(f, members, order, engine_version)
        f.flush()
        os.fsync(fd)
    return manifest


def _probe(path: Path) -> None:
    BundleArchive.open(path).close()


def check_save_target(target: str | os.PathLike, *, overwrite: bool = False) -> None:
    """What ``write_bundle`` checks first, for callers that do expensive work before saving (a
    conversion): ``SaveTargetError`` when ``target`` exists and is not a bundle, unless ``overwrite``."""
    check_replaceable(Path(os.fspath(target)), overwrite=overwrite, probe=_probe)


def write_bundle(target: str | os.PathLike, members: Mapping[str, MemberData], *, engine_version: str,
                 form: Literal["zip", "dir"] = "zip", overwrite: bool = False) -> Manifest:
    """Write a bundle atomically and return its manifest.

    An existing ``target`` is replaced only when it is a bundle or an empty directory; anything
    else (a directory of other files, a non-bundle file) raises ``SaveTargetError`` before anything
    is written, unless ``overwrite`` (``engine.bundle.target``). It is checked again just before
    the swap, so a file put there while the bundle was being written is not lost either.

    Sizes and sha256 are computed while streaming the data (one pass). The bundle is built in
    ``.<name>.tmp-<random>`` beside ``target``, locked and fsynced, then swapped in atomically; on
    any exception the temporary is removed and an existing ``target`` is left untouched, and an
    ``OSError`` (full disk, read-only directory) is raised as a ``SaveError`` naming the target.
    A save killed outright (SIGKILL, power loss) leaves the old bundle and its temporary; the next
    save to the same target removes such abandoned temporaries. Replacing a bundle that is
    currently open (e.g. re-saving via copy_members) is safe: open maps keep the old file's data.
    """
    if form not in ("zip", "dir"):
        raise ValueError(f"form must be 'zip' or 'dir', got {form!r}")
    order = _plan(members, engine_version)
    target = Path(os.fspath(target))
    check_save_target(target, overwrite=overwrite)
    try:
        _clean_leftovers(target)
        tmp, tag, fd = _create_temp(target, form)
        try:
            manifest = _write_temp(tmp, fd, form, members, order, engine_version)
            check_save_target(target, overwrite=overwrite)
            _swap_in(tmp, target, tag)
        finally:
            try:
                if os.path.lexists(tmp):  # the failed save's data, or the old bundle after an exchange
                    _remove(tmp)
            finally:
                if fd is not None:
                    os.close(fd)  # releases the lock
    except SaveTargetError:
        raise
    except OSError as exc:
        raise _save_error(target, exc) from exc
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
