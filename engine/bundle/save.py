"""Saving a bundle atomically: the save-target check, the locked temporary, the swap, the cleanup.

A save never leaves a half-written bundle, or none, where a good one was: the bundle is written
(``engine.bundle.writer``) into a temporary beside the target, fsynced, then renamed or atomically
exchanged into place; on any exception the temporary is removed and the target is untouched.

A save killed outright (SIGKILL, power loss) can strand its temporary; nothing can prevent that,
since the data must be written somewhere before the rename publishes it. So each temporary is
locked while its save runs, and the next save to the same target removes the ones no live save
holds. Locks and directory fsync come from ``engine.safefiles``; the naming and the liveness test
are the bundle's own, because a directory bundle's temporary is a whole tree, not one file.

The target itself is checked first (``check_save_target``, rules in ``engine.bundle.target``): only
a bundle or an empty directory is replaced without an explicit overwrite.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from engine.bundle.manifest import Manifest
from engine.bundle.reader import BundleArchive
from engine.bundle.target import check_replaceable
from engine.bundle.writer import MemberData, write_order, write_tree, write_zip
from engine.errors import SaveError, SaveTargetError
from engine.safefiles import FLOCK, fsync_dir, lock_fd

__all__ = ["check_save_target", "write_bundle", "write_failure"]


def _remove(path: Path) -> None:
    """Remove a temporary (a file, or a whole tree for the directory form); gone already is fine."""
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


def write_failure(exc: OSError) -> str:
    """Why a write failed, in words, then the system's own text: what every ``SaveError`` says."""
    reason = _SAVE_REASONS.get(exc.errno or 0, "the operating system refused")  # errno None: no reason known
    return f"{reason} ({exc.strerror or exc}" + (f" at {exc.filename!r})" if exc.filename else ")")


def _save_error(target: Path, exc: OSError) -> SaveError:
    """``exc`` as a one-line ``SaveError`` naming the target and the reason in words."""
    return SaveError(f"cannot save the bundle {os.fspath(target)!r}: {write_failure(exc)}; "
                     "the bundle that was there, if any, is unchanged", path=os.fspath(target), errno=exc.errno)


def _write_temp(tmp: Path, fd: int | None, form: str, members: Mapping[str, MemberData], order: list[str],
                engine_version: str) -> Manifest:
    """Write and fsync the whole bundle into the claimed temporary ``tmp`` (open, locked, as ``fd``)."""
    if form == "dir":
        return write_tree(tmp, members, order, engine_version)
    assert fd is not None  # a zip temporary is always created open
    with open(fd, "wb", closefd=False) as f:  # the fd (and its lock) lives until the swap is done
        manifest = write_zip(f, members, order, engine_version)
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
    order = write_order(members, engine_version)
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


