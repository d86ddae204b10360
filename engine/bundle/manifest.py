"""Bundle format v1, the rules every bundle obeys whatever holds it: ``manifest.json`` and member names.

A bundle is either a zip archive (suffix ``.cgb``, every member ZIP_STORED) or a directory with
the same tree; this module is what both forms, the reader and the writer share, so that "a valid
bundle" is decided in one place:

* ``manifest.json`` lists every other member with its size and sha256. Unlisted or missing members
  are refused (by the reader), so a bundle cannot smuggle in files nobody accounted for.
* The **identity** (cache key) is the sha256 of the canonical JSON of the ``files`` entries, except
  ``dispatch_table.txt``: re-tuning dispatch must not invalidate caches keyed on the compiled graph.
* Member names are safe relative POSIX paths (``name_problem``), so one name means one file in a zip
  and in a directory, and prints on one line.
* The limits (``MAX_MEMBERS``, ``MAX_MANIFEST_BYTES``) bound what a hostile bundle can make the
  reader hold. The reader and the writer read them from this module when called, so one value
  holds for all three (tests lower them here).

Every defect is a :class:`~engine.errors.BundleError` naming ``manifest.json`` and the JSON path,
never a raw json/ValueError.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from engine.bundle.jsonread import INT64_MAX, INT64_MIN, clip
from engine.bundle.text import utf8_problem
from engine.errors import BundleError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MEMBERS",
    "MAX_MANIFEST_BYTES",
    "MANIFEST_MEMBER",
    "ManifestEntry",
    "Manifest",
    "name_problem",
    "check_name",
]

FORMAT_NAME = "engine.bundle"
FORMAT_VERSION = 1
MAX_MEMBERS = 10_000  # members listed in the manifest (manifest.json itself not counted)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024

MANIFEST_MEMBER = "manifest.json"

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")
_VERSION_RE = re.compile(r"([0-9]{1,9})(?:\.([0-9]{1,9}))?")  # ASCII digits, bounded: int() never sees more

# Characters no member name may hold (by Unicode category): controls (a newline would forge log
# lines), lone surrogates (not UTF-8: a non-UTF-8 file name in the directory form), line breaks.
_UNSAFE_NAME_CHARS = {"Cc": "a control character", "Cs": "a lone surrogate (not UTF-8)",
                      "Zl": "a line separator", "Zp": "a paragraph separator"}


# ---- names ------------------------------------------------------------------------------------
def name_problem(name: object) -> str | None:
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


def check_name(name: object) -> None:
    """Raise ``BundleError`` naming ``name`` when it is not a safe member name (``name_problem``)."""
    problem = name_problem(name)
    if problem is not None:
        shown = clip(name, 200) if isinstance(name, str) else repr(name)
        raise BundleError(f"{problem}: {shown}", member=name if isinstance(name, str) else shown)


# ---- manifest ---------------------------------------------------------------------------------
_IDENTITY_EXCLUDED = frozenset({"dispatch_table.txt"})


def _as_tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple`` as an attrs converter mypy can type (``converter=tuple`` leaves its parameter generic)."""
    return tuple(value)


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
            problem = name_problem(name)
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

