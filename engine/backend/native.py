"""Loading native code (a shared object's bytes) straight from memory, without the cache directory.

``dlopen`` needs a path. Writing the bytes to the cache and opening that path has two problems:
the cache may be read-only (containers, serverless), and between hashing the file and ``dlopen``
another process (or a planted file) can replace it, so what runs is not what was checked. Here the
bytes the caller already holds (and has hashed) go into an anonymous in-memory file
(``memfd_create``, sealed against writes) which is opened as ``/proc/self/fd/N``: what is loaded
is exactly what was verified, and nothing is written to disk.

The file descriptor stays open for the life of the process (as the library does: engine never
``dlclose``s). That is required, not just tidy: glibc recognises an already-loaded library by the
name it was opened with, so a later ``dlopen("/proc/self/fd/N")`` with a reused ``N`` would hand
back the *earlier* library.

Where ``memfd_create`` or ``/proc/self/fd`` is missing (not Linux, a sandbox without /proc),
``open_from_memory`` returns ``None`` and callers fall back to publishing the bytes in a
``ContentStore`` and opening that path.
"""

from __future__ import annotations

import ctypes
import os

from engine.log import get_logger

__all__ = ["MemoryLibrary", "memory_loading_available", "open_from_memory"]

log = get_logger("engine.backend.native")

_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


class MemoryLibrary:
    """A shared object opened from an in-memory file: ``handle`` (``ctypes.CDLL``), the ``path``
    it was opened as and the ``fd`` that keeps that path valid."""

    __slots__ = ("handle", "path", "fd")

    def __init__(self, handle: ctypes.CDLL, path: str, fd: int):
        self.handle = handle
        self.path = path
        self.fd = fd


def memory_loading_available() -> bool:
    """Whether this platform can load shared objects from memory (Linux with /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _seal(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX has no memfd either
        return
    add = getattr(fcntl, "F_ADD_SEALS", None)
    seals = [getattr(fcntl, name, None) for name in _SEALS]
    if add is None or None in seals:
        return
    flags = 0
    for seal in seals:
        flags |= seal  # type: ignore[operator]
    try:
        fcntl.fcntl(fd, add, flags)
    except OSError:  # sealing is hardening only
        pass


def open_from_memory(data: bytes | memoryview, name: str, mode: int = ctypes.RTLD_LOCAL) -> MemoryLibrary | None:
    """Open ``data`` as a shared object from an anonymous in-memory file.

    ``None`` when this platform cannot (the caller falls back to a file). ``OSError`` from
    ``dlopen`` when the bytes do not load (the caller names the binary).
    """
    if not memory_loading_available():
        return None
    try:
        fd = os.memfd_create(name[:200] or "engine-kernel", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    except OSError as exc:  # e.g. a seccomp filter forbids it
        log.debug("memfd_create refused (%s); loading through the cache directory", exc)
        return None
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        _seal(fd)
        path = f"/proc/self/fd/{fd}"
        if not os.path.exists(path):  # /proc mounted without this process's fds
            os.close(fd)
            return None
        handle = ctypes.CDLL(path, mode=mode)
    except BaseException:
        os.close(fd)
        raise
    return MemoryLibrary(handle, path, fd)
