"""Fusion: run a whole list of prepared CPU launches with one ctypes call.

The per-kernel cost of the fast path is one ctypes call. For plans of many small
kernels a tiny C runner walks the launch list natively instead, so the interpreter is paid once
per run. The runner reads the *same* argument arrays the prepared launches own (it is given their
addresses), so ``set_tensor`` patches made after fusing are seen without rebuilding anything.

The runner is compiled from ``RUNNER_SOURCE`` through the backend's compiler cache (once per
cache directory) and loaded like any kernel library.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Sequence

from engine_cpu.kernel import CpuPreparedLaunch

__all__ = ["RUNNER_SOURCE", "RUNNER_ENTRY", "CpuFusedLaunch", "bind_runner"]

RUNNER_ENTRY = "run_plan"
RUNNER_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef int32_t (*engine_cpu_kernel)(void *const *tensors, const int64_t *symbols, void *workspace);

/* Call n kernels in order; stop at the first non-zero code.
   Returns 0 if all succeed, else the failing launch's 1-based position (its code in *code_out). */
int64_t run_plan(int64_t n, const void *const *fns, void *const *tensor_arrays,
                 const void *const *symbol_arrays, void *const *workspaces, int32_t *code_out) {
    for (int64_t i = 0; i < n; ++i) {
        engine_cpu_kernel fn;
        /* ISO C has no object-to-function pointer conversion; POSIX guarantees the bytes agree. */
        memcpy(&fn, &fns[i], sizeof fn);
        int32_t code = fn((void *const *)tensor_arrays[i], (const int64_t *)symbol_arrays[i],
                          workspaces[i]);
        if (code != 0) {
            *code_out = code;
            return i + 1;
        }
    }
    *code_out = 0;
    return 0;
}
"""


def bind_runner(function: ctypes._CFuncPtr) -> ctypes._CFuncPtr:
    """Give the runner's ctypes function its return type (done once per loaded runner).

    No ``argtypes``, as for prepared launches (kernel.py): every argument is passed as an exact
    ctypes object built once, and per-call ``from_param`` checks would cost more than the call.
    """
    function.restype = ctypes.c_int64
    return function


class CpuFusedLaunch:
    """Prepared launches run in order by one native call.

    ``call()`` returns 0 or the 1-based position of the first failing launch (later ones are not
    run); ``code()`` gives that launch's code. ``launches[position - 1].fail(code())`` raises the
    usual ``KernelError``.
    """

    __slots__ = ("launches", "call", "_runner", "_fns", "_tensor_arrays", "_symbol_arrays",
                 "_workspaces", "_code")

    def __init__(self, runner: ctypes._CFuncPtr, launches: Sequence[CpuPreparedLaunch]):
        n = len(launches)
        # Holding the launches keeps their argument arrays and their kernels' libraries alive.
        self.launches = tuple(launches)
        self._runner = runner
        self._fns = (ctypes.c_void_p * n)(*(p.function_addr for p in launches))
        self._tensor_arrays = (ctypes.c_void_p * n)(*(p.tensor_array_addr for p in launches))
        self._symbol_arrays = (ctypes.c_void_p * n)(*(p.symbol_array_addr for p in launches))
        self._workspaces = (ctypes.c_void_p * n)(*(p.workspace_addr or 0 for p in launches))
        self._code = ctypes.c_int32(0)
        self.call: Callable[[], int] = functools.partial(
            runner, ctypes.c_int64(n), self._fns, self._tensor_arrays, self._symbol_arrays,
            self._workspaces, ctypes.pointer(self._code))

    def code(self) -> int:
        """The code returned by the launch at the position the last ``call()`` reported (0 if none)."""
        return self._code.value

    def __len__(self) -> int:
        return len(self.launches)

    def __repr__(self) -> str:
        return f"<CpuFusedLaunch of {len(self.launches)} launches>"
