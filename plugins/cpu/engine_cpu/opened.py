"""``Library``: one opened shared object, the thing a ``CpuKernel`` holds so its code stays mapped.

Its own module because both sides need it: the program role (``program``) opens libraries and
makes kernels, and a kernel (``kernel``) keeps its library alive; neither imports the other's module
for it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["Library"]


class Library:
    """An opened shared object; ``handle`` is the ``ctypes.CDLL`` (kept open for the process).

    ``path`` is what it was opened as (``/proc/self/fd/N`` when loaded from memory, whose ``fd``
    stays open with it; ``fd`` is None for a file in the cache).
    """

    __slots__ = ("sha256", "path", "handle", "omp_set_num_threads", "fd")

    def __init__(self, sha256: str, path: Path, handle: ctypes.CDLL, fd: int | None = None):
        self.sha256 = sha256
        self.path = path
        self.handle = handle
        self.fd = fd
        try:
            # dlsym on a handle also searches the library's own dependencies (libgomp).
            setter = handle["omp_set_num_threads"]
        except AttributeError:
            setter = None
        else:
            setter.argtypes = (ctypes.c_int,)
            setter.restype = None
        self.omp_set_num_threads = setter

    def __repr__(self) -> str:
        return f"<Library {self.path.name}>"
