"""The GPU kernel ABI (docs/bundle-format.md §12.2), written out independently of the engine's code.

Shared by the CUDA plugin's tests and, next, the HIP plugin's (the ABI is one for both): the
expected bytes of each kernel parameter come from the document's rules with ``struct``, and the
parameters a driver would read are read back through the ``void **`` array the way
``cuLaunchKernel`` / ``hipModuleLaunchKernel`` read ``kernelParams``.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Sequence

__all__ = ["expected_parameters", "read_kernel_params"]


def expected_parameters(tensors: Sequence[int], symbols: Sequence[int], workspace: int | None,
                        has_workspace: bool) -> list[bytes]:
    """Each parameter's bytes, in order: one 64-bit pointer per tensor (inputs, then outputs), one
    ``int64_t`` per symbol (two's complement, little-endian), then the workspace pointer only when
    the kernel declares a workspace."""
    params = [struct.pack("<Q", p) for p in tensors]
    params += [struct.pack("<q", v) for v in symbols]
    if has_workspace:
        params.append(struct.pack("<Q", workspace or 0))
    return params


def read_kernel_params(address: int, sizes: Sequence[int]) -> list[bytes]:
    """What a driver copies for a kernel whose parameters have ``sizes``: ``address`` is the
    ``void **`` array, entry ``i`` points at parameter ``i``'s bytes."""
    if not sizes:
        return []
    pointers = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]
