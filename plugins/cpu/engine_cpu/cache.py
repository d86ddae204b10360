"""Crash- and race-safe files in the on-disk cache.

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
from typing import Iterator

try:  # POSIX only; without it concurrent builders just duplicate work.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["sha256_hex", "atomic_write", "read_verified", "key_lock"]


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
