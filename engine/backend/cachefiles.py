"""Crash- and race-safe files in a plugin's on-disk cache (compiled kernels, extracted binaries).

Several processes may build or extract the same kernel into one cache directory at once, and a
process may die mid-write. So files are only ever published with ``os.replace`` of a fsynced temp
file from the same directory (readers see the old file or the whole new one, never half), and
nothing read back is trusted unless its sha256 matches what the caller vouches for (DESIGN §6).
A per-key advisory lock keeps concurrent builders from doing the same work twice; it is an
optimisation only: correctness comes from the atomic publish plus verification.

What vouches for a file differs by store. A ``ContentStore`` file is named by its sha256, which
the bundle supplies, so a planted file fails the hash. A ``BuildCache`` entry (what a compiler
made from a source) has nothing outside the cache to compare with: a side file with its sha256
only catches torn writes, since whoever plants bytes can write their hash too. So each entry also
carries a tag, an HMAC of its key and hash under a secret that only the cache's owner can read
(``.auth/secret``, mode 0600, refused unless owned by this user); an entry without a valid tag is
rebuilt and replaced, never handed out.

A cache that cannot be written at all (read-only file system or home, no permission; see
``engine.cache.read_only_cache``) is not an error: ``BuildCache`` serves what it holds, builds
the rest without a lock and keeps it in memory, and says so once in the ``engine.cache`` log. A
full disk still raises, since it is a fault to fix rather than a deployment choice. Writers report
what they publish to ``engine.cache.note_write`` (the size cap) and readers touch what they hit
(``engine.cache.touch``: last use is the mtime the cap evicts by).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Callable

from engine import safefiles
from engine.cache import note_write, read_only_cache, report_read_only, touch
from engine.log import get_logger

__all__ = ["sha256_hex", "read_verified", "ContentStore", "BuildCache"]

log = get_logger("engine.cache")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def read_verified(path: Path, sha256: str) -> bytes | None:
    """The file's bytes if it exists and hashes to ``sha256``; ``None`` if missing or different."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if sha256_hex(data) == sha256 else None


class ContentStore:
    """Files named by the sha256 of their bytes under ``root`` (``<sha256><suffix>``).

    ``publish`` writes a file unless one that hashes to its name is already there, and returns its
    path; a truncated or tampered file is replaced. Loaders that must open a path (``dlopen``)
    publish here first. ``cache_root`` is the cache directory ``root`` lies in (for its size cap).
    """

    def __init__(self, root: Path, suffix: str = "", *, cache_root: Path | None = None):
        self.root = Path(root)
        self.suffix = suffix
        self.cache_root = None if cache_root is None else Path(cache_root)

    def path_for(self, sha256: str) -> Path:
        return self.root / f"{sha256}{self.suffix}"

    def publish(self, data: bytes | memoryview, sha256: str | None = None) -> Path:
        sha = sha256 or sha256_hex(data)
        path = self.path_for(sha)
        if read_verified(path, sha) is None:  # missing, truncated or tampered: (re)write
            safefiles.atomic_write(path, data, private=True)
            log.debug("content store %s: wrote %s", self.root, path.name)
            note_write(path, len(data), root=self.cache_root)
        else:
            touch(path)
        return path


_SECRET_BYTES = 32


def _owned_privately(st: os.stat_result, *, directory: bool) -> bool:
    """Whether a file or directory is this user's and closed to others (what a secret needs)."""
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    owner_ok = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
    return kind_ok and owner_ok and st.st_mode & 0o077 == 0


def _read_secret(path: Path) -> bytes | None:
    """The secret at ``path`` if it is a private file of this user, else None."""
    try:
        if not _owned_privately(os.lstat(path.parent), directory=True):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not _owned_privately(os.fstat(fd), directory=False):
            return None
        data = f.read(_SECRET_BYTES + 1)
    return data if len(data) == _SECRET_BYTES else None


def _create_secret(path: Path) -> bytes | None:
    """Create the secret at ``path`` unless one exists (concurrent creators agree on one).

    None where ``path``'s directory is not private to this user (someone else's cache).
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _owned_privately(os.lstat(path.parent), directory=True):
        return None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # publish only if absent: the first creator's secret wins
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read_secret(path)


class BuildCache:
    """Build results by key under ``root``: ``<key><suffix>``, ``<key><suffix>.sha256`` and a tag.

    The key names the inputs (source, compiler identity, options, device); the side file records
    the hash of the bytes and ``.auth/<key><suffix>`` an HMAC of key and hash under the cache's
    secret (see the module docstring), both published *after* the bytes, so a reader never trusts
    bytes whose hash or tag is missing, belongs to an older file, or was written by someone else.
    ``get_or_build`` holds a per-key lock so that concurrent builders (threads or processes) build
    once; correctness comes from the atomic publish and the checks, the lock only saves work.
    Results are memoized per object. A cache that cannot be written (``read_only`` becomes True)
    still serves its entries; what is built meanwhile is kept in memory only (module docstring).
    ``cache_root`` is the cache directory ``root`` lies in (for its size cap and the log).
    """

    def __init__(self, root: Path, suffix: str = "", *, cache_root: Path | None = None):
        self.root = Path(root)
        self.suffix = suffix
        self.cache_root = None if cache_root is None else Path(cache_root)
        #: True once writing to the cache failed because it cannot be written at all.
        self.read_only = False
        self._memo: dict[str, bytes] = {}
        self._secret: bytes | None = None
        self._warned = False

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{self.suffix}"

    def _tag_path(self, key: str) -> Path:
        return self.root / ".auth" / f"{key}{self.suffix}"

    def _key_secret(self, *, create: bool) -> bytes | None:
        if self._secret is None:
            path = self.root / ".auth" / "secret"
            self._secret = _read_secret(path) or (_create_secret(path) if create else None)
        return self._secret

    def _warn_untrusted(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"build cache {self.root}: {self.root / '.auth' / 'secret'} is not a private file of this "
                          "user, so nothing built is cached; remove that .auth directory or set ENGINE_CACHE_DIR to "
                          "a directory of your own", RuntimeWarning, stacklevel=3)

    def _tag(self, key: str, sha256: str, secret: bytes) -> str:
        return hmac.new(secret, f"{key}\0{sha256}".encode(), hashlib.sha256).hexdigest()

    def get(self, key: str) -> bytes | None:
        """The verified bytes built for ``key``, or ``None`` (missing, torn, or not tagged by us)."""
        data = self._memo.get(key)
        if data is not None:
            return data
        path = self._path(key)
        secret = self._key_secret(create=False)
        if secret is None:
            log.debug("build cache %s: miss %s (no secret yet)", self.root, key[:16])
            return None
        try:
            recorded = path.with_name(path.name + ".sha256").read_text(encoding="ascii").strip()
            tag = self._tag_path(key).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            log.debug("build cache %s: miss %s", self.root, key[:16])
            return None
        if not hmac.compare_digest(tag, self._tag(key, recorded, secret)):
            log.debug("build cache %s: miss %s (tag does not match: rebuilt)", self.root, key[:16])
            return None
        data = read_verified(path, recorded)
        if data is not None:
            self._memo[key] = data
            touch(path)
            log.debug("build cache %s: hit %s", self.root, key[:16])
        else:
            log.debug("build cache %s: miss %s (bytes do not match their hash: rebuilt)", self.root, key[:16])
        return data

    def put(self, key: str, data: bytes) -> None:
        """Publish ``data`` for ``key``; skipped (with a warning, once) where no secret can be trusted,
        and kept in memory only where the cache cannot be written (``read_only``)."""
        if self.read_only:
            self._memo[key] = data
            return
        try:
            secret = self._key_secret(create=True)
            if secret is None:
                self._warn_untrusted()
                self._memo[key] = data  # this process built it: usable here, just not kept on disk
                return
            path, sha = self._path(key), sha256_hex(data)
            safefiles.atomic_write(path, data, private=True)
            safefiles.atomic_write(path.with_name(path.name + ".sha256"), sha.encode(), private=True)
            safefiles.atomic_write(self._tag_path(key), self._tag(key, sha, secret).encode(), private=True)
        except OSError as exc:
            if not read_only_cache(exc, self.cache_root or self.root):
                raise
            self._went_read_only(exc)
            self._memo[key] = data
            return
        self._memo[key] = data
        log.debug("build cache %s: stored %s (%d bytes)", self.root, key[:16], len(data))
        note_write(path, len(data) + 2 * len(sha), root=self.cache_root)

    def _went_read_only(self, exc: OSError) -> None:
        self.read_only = True
        report_read_only(self.cache_root or self.root, exc)

    def get_or_build(self, key: str, build: "Callable[[], bytes]") -> bytes:
        """The cached bytes for ``key``, building and publishing them on a miss.

        ``OSError`` from the cache directory propagates (the caller says which setting to change).
        """
        data = self.get(key)
        if data is not None:
            return data
        if not self.read_only:
            locked = False
            try:
                with safefiles.file_lock(self.root / f".{key}.lock"):
                    locked = True
                    data = self.get(key)  # another process may have built it meanwhile
                    if data is None:
                        data = build()
                        self.put(key, data)
                return data
            except OSError as exc:
                if locked or not read_only_cache(exc, self.cache_root or self.root):
                    raise
                self._went_read_only(exc)
        data = self._memo.get(key)
        if data is None:
            data = build()
            self._memo[key] = data
        return data
