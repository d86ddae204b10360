"""A loaded CPU kernel and its prepared launches: the CPU kernel ABI (DESIGN §4) in ctypes.

Every entry point has the signature::

    int32_t entry(void *const *tensors, const int64_t *symbols, void *workspace);

``tensors`` holds input pointers then output pointers, ``symbols`` the values of the kernel's
symbols in order, ``workspace`` is NULL when the kernel has none. CPU device pointers are plain
addresses (``int``). The function objects come from ``ctypes.CDLL``, which releases the GIL for
the duration of the call, so threads launching kernels on different buffers really run in
parallel (the ABI requires kernels to be reentrant).

The fast path is ``CpuPreparedLaunch.call``: a ``functools.partial`` over a ctypes function with
argument arrays built once, so one run costs exactly one ctypes call. ``set_tensor`` writes into
the owned array in place.

Two function objects point at each entry: ``function`` carries ``argtypes`` (checked conversion,
for anyone calling it by hand), while prepared launches call an untyped twin. With ``argtypes``
ctypes runs ``c_void_p.from_param`` on every argument of every call, a cost comparable to the
call itself; the prepared arguments are already exact ctypes objects (two arrays, passed as
pointers, and a ``c_void_p`` or None), so the checks buy nothing there.

Argument counts are checked once, in ``KernelBase.prepare``; ``launch`` is inherited (prepare,
call, and ``fail`` on a non-zero code).

``native_launch`` describes the same call to the core's native run path (``engine.runtime.native``):
the entry's address and those of the two argument arrays, which the core patches and calls from C
with the GIL released, as ``call()`` would.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from engine.backend import BinaryPayload, CandidateSpec, KernelBase, LaunchDims, Stream, kernel_failure
from engine.backend import NativeLaunch

if TYPE_CHECKING:
    from engine_cpu.opened import Library

__all__ = ["CpuKernel", "CpuPreparedLaunch", "ENTRY_ARGTYPES", "ENTRY_RESTYPE"]

ENTRY_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ENTRY_RESTYPE = ctypes.c_int32
_DEVICE = "cpu"


class CpuKernel(KernelBase):
    """One candidate bound to the library it came from (held strongly: the code must outlive us)."""

    device_name = _DEVICE

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload, library: "Library",
                 function: ctypes._CFuncPtr, apply_threads: Callable[[], None] | None = None):
        super().__init__(spec, binary)
        function.argtypes = ENTRY_ARGTYPES
        function.restype = ENTRY_RESTYPE
        self.library = library
        self.function = function
        self.function_addr: int = ctypes.cast(function, ctypes.c_void_p).value or 0
        # Same address and calling convention (CDLL's class: releases the GIL), no argtypes.
        self._untyped = type(function)(self.function_addr)
        self._untyped.restype = ENTRY_RESTYPE
        # Applies the backend's OpenMP thread count in the calling thread (see program.py).
        self._apply_threads = apply_threads

    def _prepare(self, tensors: list[int], symbol_values: list[int], workspace: int | None,
                 stream: Stream, dims: LaunchDims | None) -> "CpuPreparedLaunch":
        """Bind the arguments once; ``stream`` and ``dims`` are ignored (CPU launches are synchronous
        and have no launch geometry)."""
        if self._apply_threads is not None:
            self._apply_threads()
        return CpuPreparedLaunch(self, tensors, symbol_values, workspace or 0)


class CpuPreparedLaunch:
    """A kernel call with owned argument arrays; ``call()`` returns the kernel's int code."""

    __slots__ = ("kernel", "call", "set_tensor", "workspace_addr", "tensor_array_addr", "symbol_array_addr",
                 "function_addr", "native_launch", "_tensors", "_symbols", "_workspace")

    def __init__(self, kernel: CpuKernel, tensor_addrs: Sequence[int], symbol_values: Sequence[int],
                 workspace_addr: int):
        self.kernel = kernel
        self._tensors = (ctypes.c_void_p * len(tensor_addrs))(*tensor_addrs)
        self._symbols = (ctypes.c_int64 * len(symbol_values))(*symbol_values)
        # A pre-built c_void_p (or None for NULL) so the per-call conversion is a type check only.
        self._workspace = ctypes.c_void_p(workspace_addr) if workspace_addr else None
        #: The workspace address the kernel receives, 0 for NULL (read by the fusion runner).
        self.workspace_addr = workspace_addr
        self.tensor_array_addr = ctypes.addressof(self._tensors)
        self.symbol_array_addr = ctypes.addressof(self._symbols)
        self.function_addr = kernel.function_addr
        self.call: Callable[[], int] = functools.partial(kernel._untyped, self._tensors, self._symbols,
                                                         self._workspace)
        #: ``set_tensor(index, ptr)`` points tensor argument ``index`` at ``ptr`` for later calls
        #: (and fused runs). It is the argument array's own ``__setitem__``: the fast path patches
        #: inputs and outputs with it on every run, and a Python method frame would double its cost.
        self.set_tensor: Callable[[int, int], None] = self._tensors.__setitem__
        #: This call for the core's native run path: the arrays above stay at these addresses.
        self.native_launch = NativeLaunch(self.function_addr, self.tensor_array_addr, len(tensor_addrs),
                                          self.symbol_array_addr, workspace_addr)

    def tensor_addrs(self) -> tuple[int, ...]:
        """The current tensor arguments (NULL reads as 0)."""
        return tuple(a or 0 for a in self._tensors)

    def fail(self, code: int) -> NoReturn:
        raise kernel_failure(self.kernel.spec, code, _DEVICE)

    def __repr__(self) -> str:
        return f"<CpuPreparedLaunch {self.kernel.spec.describe()}>"
