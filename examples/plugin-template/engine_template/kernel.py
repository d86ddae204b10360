"""A loaded kernel and its prepared launches: the CPU kernel ABI through ctypes.

Every entry point has the C signature::

    int32_t entry(void *const *tensors, const int64_t *symbols, void *workspace);

``tensors`` holds input pointers then output pointers, ``symbols`` the kernel's symbol values in
order, ``workspace`` is NULL when the kernel has none; 0 means success. ctypes releases the GIL
during the call, so threads running kernels on different buffers really run in parallel.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, NoReturn, Sequence

from engine.backend import BinaryPayload, CandidateSpec, kernel_failure
from engine.errors import KernelError

__all__ = ["TemplateKernel", "TemplateLaunch"]

_KIND = "template"


class TemplateKernel:
    """One candidate; holds its library so the code outlives every launch made from it."""

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload, library: ctypes.CDLL,
                 function: ctypes._CFuncPtr):
        function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        function.restype = ctypes.c_int32
        self.spec, self.binary, self.library, self.function = spec, binary, library, function

    def launch(self, tensor_addrs: Sequence[int], symbol_values: Sequence[int], workspace_addr: int,
               stream: object = None) -> None:
        code = self.prepare(tensor_addrs, symbol_values, workspace_addr, stream).call()
        if code != 0:
            raise kernel_failure(self.spec, code, _KIND)

    def prepare(self, tensor_addrs: Sequence[int], symbol_values: Sequence[int], workspace_addr: int,
                stream: object = None) -> "TemplateLaunch":
        spec = self.spec
        if len(tensor_addrs) != spec.num_inputs + spec.num_outputs or len(symbol_values) != len(spec.symbols):
            raise KernelError(f"{spec.describe()}: got {len(tensor_addrs)} tensors and {len(symbol_values)} "
                              f"symbols, expected {spec.num_inputs}+{spec.num_outputs} and {len(spec.symbols)}")
        return TemplateLaunch(self, tensor_addrs, symbol_values, workspace_addr if spec.has_workspace else 0)


class TemplateLaunch:
    """Arguments bound once; the core patches input/output addresses with ``set_tensor``."""

    __slots__ = ("kernel", "call", "set_tensor", "_tensors", "_symbols")

    def __init__(self, kernel: TemplateKernel, tensor_addrs: Sequence[int], symbol_values: Sequence[int],
                 workspace_addr: int):
        self.kernel = kernel
        self._tensors = (ctypes.c_void_p * len(tensor_addrs))(*tensor_addrs)
        self._symbols = (ctypes.c_int64 * len(symbol_values))(*symbol_values)
        workspace = ctypes.c_void_p(workspace_addr) if workspace_addr else None
        # The hot path: one call with no Python work besides ctypes' own, and patches that write
        # straight into the argument array (no Python frame per patched address).
        self.call: Callable[[], int] = functools.partial(kernel.function, self._tensors, self._symbols, workspace)
        self.set_tensor: Callable[[int, int], None] = self._tensors.__setitem__

    def fail(self, code: int) -> NoReturn:
        raise kernel_failure(self.kernel.spec, code, _KIND)
