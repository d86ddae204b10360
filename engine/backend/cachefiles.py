"""Crash- and race-safe files in a plugin's on-disk cache (compiled kernels, extracted binaries).

Several processes may build or extract the same kernel into one cache directory at once, and a
process may die mid-write. So files are only ever published with ``os.replace`` of a fsynced temp
file from the same directory (readers see the old file or the whole new one, never half), and
nothing read back is trusted unless its sha256 matches what the caller vouches for (DESIGN §6).
A per-key advisory lock keeps concurrent builders from doing the same work twice; it is an
optimisation only: correctness comes from the atomic publish plus verification.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; without it concurrent builders just duplicate work.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["sha256_hex", "atomic_write", "read_verified", "key_lock", "ContentStore", "BuildCache"]


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Publish ``data`` at ``path`` all at once: temp file in the same dir, fsync, ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; best effort (not every filesystem allows it).
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_verified(path: Path, sha256: str) -> bytes | None:
    """The file's bytes if it exists and hashes to ``sha256``; ``None`` if missing or different."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if sha256_hex(data) == sha256 else None


@contextlib.contextmanager
def key_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for the block.

    ``flock`` locks belong to an open file description, so separate threads of one process
    exclude each other as well as separate processes do.
    """
    if fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class ContentStore:
    """Files named by the sha256 of their bytes under ``root`` (``<sha256><suffix>``).

    ``publish`` writes a file unless one that hashes to its name is already there, and returns its
    path; a truncated or tampered file is replaced. Loaders that must open a path (``dlopen``)
    publish here first.
    """

    def __init__(self, root: Path, suffix: str = ""):
        self.root = Path(root)
        self.suffix = suffix

    def path_for(self, sha256: str) -> Path:
        return self.root / f"{sha256}{self.suffix}"

    def publish(self, data: bytes | memoryview, sha256: str | None = None) -> Path:
        sha = sha256 or sha256_hex(data)
        path = self.path_for(sha)
        if read_verified(path, sha) is None:  # missing, truncated or tampered: (re)write
            atomic_write(path, data)
        return path


class BuildCache:
    """Build results by key under ``root``: ``<key><suffix>`` plus ``<key><suffix>.sha256``.

    The key names the inputs (source, compiler identity, options, device); the side file records
    the hash of the bytes, published *after* them, so a reader never trusts bytes whose recorded
    hash is missing or belongs to an older file. ``get_or_build`` holds a per-key lock so that
    concurrent builders (threads or processes) build once; correctness comes from the atomic
    publish and the hash check, the lock only saves work. Results are memoized per object.
    """

    def __init__(self, root: Path, suffix: str = ""):
        self.root = Path(root)
        self.suffix = suffix
        self._memo: dict[str, bytes] = {}

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{self.suffix}"

    def get(self, key: str) -> bytes | None:
        """The verified bytes built for ``key``, or ``None``."""
        data = self._memo.get(key)
        if data is not None:
            return data
        path = self._path(key)
        try:
            recorded = path.with_name(path.name + ".sha256").read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        data = read_verified(path, recorded)
        if data is not None:
            self._memo[key] = data
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        atomic_write(path, data)
        atomic_write(path.with_name(path.name + ".sha256"), sha256_hex(data).encode())
        self._memo[key] = data

    def get_or_build(self, key: str, build: "Callable[[], bytes]") -> bytes:
        """The cached bytes for ``key``, building and publishing them on a miss.

        ``OSError`` from the cache directory propagates (the caller says which setting to change).
        """
        data = self.get(key)
        if data is not None:
            return data
        with key_lock(self.root / f".{key}.lock"):
            data = self.get(key)  # another process may have built it meanwhile
            if data is None:
                data = build()
                self.put(key, data)
        return data
