"""A loaded kernel and its prepared launches: the CPU kernel ABI through ctypes.

Every entry point has the C signature::

    int32_t entry(void *const *tensors, const int64_t *symbols, void *workspace);

``tensors`` holds input pointers then output pointers, ``symbols`` the kernel's symbol values in
order, ``workspace`` is NULL when the kernel has none; 0 means success. ctypes releases the GIL
during the call, so threads running kernels on different buffers really run in parallel.

``KernelBase`` (from the engine) checks the argument counts and launch dimensions and provides
``launch`` and ``fail``; a plugin only writes ``_prepare``, which binds the arguments once. This
device's pointers are plain addresses (``int``); a device whose memory is a handle receives
``engine.backend.BufferPtr(buffer, offset)`` objects here instead, and the ``LaunchDims`` the core
evaluated from the bundle's launch expressions in ``dims``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, NoReturn, Sequence

from engine.backend import BinaryPayload, CandidateSpec, KernelBase, LaunchDims, Stream, kernel_failure

__all__ = ["TemplateKernel", "TemplateLaunch"]

_KIND = "template"


class TemplateKernel(KernelBase):
    """One candidate; holds its library so the code outlives every launch made from it."""

    device_name = _KIND

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload, library: ctypes.CDLL,
                 function: ctypes._CFuncPtr):
        super().__init__(spec, binary)
        function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        function.restype = ctypes.c_int32
        self.library, self.function = library, function

    def _prepare(self, tensors: list[int], symbol_values: list[int], workspace: int | None,
                 stream: Stream, dims: LaunchDims | None) -> "TemplateLaunch":
        # Synchronous device: no stream to bind the launch to, and no launch geometry to use.
        return TemplateLaunch(self, tensors, symbol_values, workspace)


class TemplateLaunch:
    """Arguments bound once; the core patches input/output pointers with ``set_tensor``."""

    __slots__ = ("kernel", "call", "set_tensor", "_tensors", "_symbols")

    def __init__(self, kernel: TemplateKernel, tensors: Sequence[int], symbol_values: Sequence[int],
                 workspace: int | None):
        self.kernel = kernel
        self._tensors = (ctypes.c_void_p * len(tensors))(*tensors)
        self._symbols = (ctypes.c_int64 * len(symbol_values))(*symbol_values)
        ws = ctypes.c_void_p(workspace) if workspace else None  # None is NULL
        # The hot path: one call with no Python work besides ctypes' own, and patches that write
        # straight into the argument array (no Python frame per patched pointer).
        self.call: Callable[[], int] = functools.partial(kernel.function, self._tensors, self._symbols, ws)
        self.set_tensor: Callable[[int, int], None] = self._tensors.__setitem__

    def fail(self, code: int) -> NoReturn:
        raise kernel_failure(self.kernel.spec, code, _KIND)
