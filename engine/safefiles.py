"""Files that survive crashes and concurrent writers: the one place the engine writes them.

Every writer the engine has (the plugins' build caches, the dispatch cache, traces, bundle saves,
the cache's pruning) uses these four pieces, so the platform branches and the crash reasoning live
once:

* ``atomic_write``: the bytes go to a temporary beside the target (``.<name>.tmp-<12 hex>``),
  are flushed (and fsynced unless the caller says a torn file after a power cut is acceptable),
  then ``os.replace``d over the target, so a reader sees the old file or the whole new one.
* ``fsync_dir``: makes a rename or a creation in a directory durable; best effort, since not every
  platform or file system lets a directory be opened and synced.
* ``lock_fd`` / ``file_lock``: an exclusive advisory lock (``flock`` on POSIX, ``msvcrt.locking``
  on Windows). ``flock`` locks belong to an open file description, so threads of one process
  exclude each other as processes do, and the kernel drops the lock when its holder dies. Lock
  files are never removed: unlinking one while another process waits on it would let two
  processes hold "the" lock on two different files.
* ``abandoned_temporaries`` / ``remove_abandoned``: the temporaries ``atomic_write`` left for a
  target when its writer was killed between creating and renaming them. Only a caller that holds
  the lock every writer of that target holds may remove them (then none can be live).

Where no lock primitive exists at all, ``lock_fd`` reports the lock as held when asked to wait and
as busy otherwise: writers then only duplicate work, and nothing is ever cleaned up as abandoned.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write", "fsync_dir", "lock_fd", "unlock_fd", "file_lock", "temporary_name",
           "abandoned_temporaries", "remove_abandoned", "FLOCK"]

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt
    import time

    #: Whether locks are POSIX ``flock``s: they lock any open file or directory, the file may be
    #: renamed or removed while locked, and the kernel drops them when the holder dies (the bundle
    #: writer's liveness test for abandoned temporaries relies on all three).
    FLOCK = False

    def lock_fd(fd: int, *, wait: bool = True) -> bool:
        """Take an exclusive lock on open file ``fd``; False if another holds it and not ``wait``."""
        while True:
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                return True
            except OSError:
                if not wait:
                    return False
                time.sleep(0.05)

    def unlock_fd(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - a platform with neither primitive
        fcntl = None  # type: ignore[assignment]

    FLOCK = fcntl is not None

    def lock_fd(fd: int, *, wait: bool = True) -> bool:
        """Take an exclusive lock on open file ``fd``; False if another holds it and not ``wait``."""
        if fcntl is None:  # pragma: no cover
            return wait
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def unlock_fd(fd: int) -> None:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if missing, never deleted) for the block.

    Yields True while held; with ``wait=False`` a busy lock yields False at once, holding nothing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        held = lock_fd(fd, wait=wait)
        try:
            yield held
        finally:
            if held:
                unlock_fd(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Persist ``directory``'s entries (a rename or a creation in it). Best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """A fresh temporary's name for ``path``: ``.<name>.tmp-<12 hex>`` in the same directory."""
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")


def atomic_write(path: str | os.PathLike[str], data: bytes | memoryview | str, *, fsync: bool = True,
                 private: bool = False) -> None:
    """Publish ``data`` (``str`` is written as UTF-8) at ``path`` all at once.

    ``fsync=False`` skips the file's and the directory's fsync: readers still never see a partial
    file, but after a power cut the file may be missing or empty (fine for what is recomputed, such
    as tuned dispatch rows). ``private`` creates the file readable by its owner only (mode 0600).
    The parent directory is created if needed. On any error the temporary is removed and the
    target is unchanged.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = temporary_name(path)
        try:
            fd = os.open(tmp, flags, 0o600 if private else 0o666)
            break
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def abandoned_temporaries(path: Path) -> list[Path]:
    """The temporaries ``atomic_write`` created for ``path`` that are still beside it."""
    pattern = re.compile(re.escape(f".{path.name}.tmp-") + "[0-9a-f]{12}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return [path.with_name(n) for n in sorted(names) if pattern.fullmatch(n)]


def remove_abandoned(path: Path) -> int:
    """Remove ``abandoned_temporaries(path)``; returns how many went. Call only while holding the
    lock that every writer of ``path`` holds while its temporary exists. Best effort."""
    removed = 0
    for tmp in abandoned_temporaries(path):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
            removed += 1
    return removed
