"""Kernel arguments as the GPU kernel ABI lays them out (docs/bundle-format.md §12.2), built once.

The parameters of a kernel are, in order: one pointer per tensor (inputs, then outputs), one
``int64_t`` per kernel symbol (in the order of the kernel's ``symbols``), and one pointer to the
workspace only when the kernel declares a workspace. Every parameter is 8 bytes and 8-byte aligned
on the 64-bit targets we support, so the block is one array of 8-byte slots, little-endian, with no
padding; the driver is handed the ``void **`` array that points at each slot (``kernelParams`` of
``cuLaunchKernel`` / ``hipModuleLaunchKernel``), and the contiguous slots are also exactly the
packed buffer of the ``extra`` launch form.

An ``ArgumentBlock`` is made once per prepared launch; the core then patches graph inputs and fresh
outputs in place (``set_tensor`` is the slot array's own ``__setitem__``: no Python object is built
per launch), and the driver reads the current values at every launch.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

__all__ = ["ArgumentBlock", "SLOT_BYTES", "pack_arguments", "argument_layout"]

#: Bytes per parameter: a 64-bit pointer or an ``int64_t``.
SLOT_BYTES = 8


def argument_layout(num_tensors: int, num_symbols: int, has_workspace: bool) -> list[tuple[str, int, int]]:
    """``(role, byte offset, size)`` of each parameter: roles ``tensor<i>``, ``symbol<i>``, ``workspace``."""
    roles = [f"tensor{i}" for i in range(num_tensors)] + [f"symbol{i}" for i in range(num_symbols)]
    if has_workspace:
        roles.append("workspace")
    return [(role, i * SLOT_BYTES, SLOT_BYTES) for i, role in enumerate(roles)]


def pack_arguments(tensors: Sequence[int | None], symbols: Sequence[int], workspace: int | None,
                   has_workspace: bool) -> bytes:
    """The packed parameter bytes for these values (null pointers as 0), as the kernel receives them."""
    ptrs = [int(p or 0) for p in tensors]
    out = struct.pack(f"<{len(ptrs)}Q{len(symbols)}q", *ptrs, *(int(v) for v in symbols))
    if has_workspace:
        out += struct.pack("<Q", int(workspace or 0))
    return out


class ArgumentBlock:
    """One launch's parameter slots and the pointer array the driver reads (see the module docstring).

    ``address`` is the ``void **`` to hand the driver (0 for a kernel without parameters);
    ``set_tensor(i, ptr)`` patches tensor ``i``; ``tobytes()`` is the packed parameter buffer.
    """

    __slots__ = ("num_tensors", "num_symbols", "has_workspace", "slots", "pointers", "address", "set_tensor")

    def __init__(self, num_tensors: int, num_symbols: int, has_workspace: bool):
        self.num_tensors, self.num_symbols, self.has_workspace = num_tensors, num_symbols, bool(has_workspace)
        count = num_tensors + num_symbols + int(has_workspace)
        self.slots = np.zeros(max(count, 1), dtype=np.uint64)
        base = self.slots.ctypes.data
        self.pointers = np.arange(count, dtype=np.uint64) * np.uint64(SLOT_BYTES) + np.uint64(base)
        self.address = int(self.pointers.ctypes.data) if count else 0
        # Tensor i is slot i: the array's own __setitem__ patches it without a Python frame.
        self.set_tensor = self.slots.__setitem__

    @classmethod
    def filled(cls, tensors: Sequence[int | None], symbols: Sequence[int], workspace: int | None,
               has_workspace: bool) -> "ArgumentBlock":
        block = cls(len(tensors), len(symbols), has_workspace)
        block.fill(tensors, symbols, workspace)
        return block

    def fill(self, tensors: Sequence[int | None], symbols: Sequence[int], workspace: int | None) -> None:
        n, m = self.num_tensors, self.num_symbols
        if len(tensors) != n or len(symbols) != m:
            raise ValueError(f"argument block holds {n} tensors and {m} symbols, got {len(tensors)} and "
                             f"{len(symbols)}")
        for i, ptr in enumerate(tensors):
            self.slots[i] = int(ptr or 0)
        self.slots.view(np.int64)[n:n + m] = [int(v) for v in symbols]
        if self.has_workspace:
            self.slots[n + m] = int(workspace or 0)

    def tobytes(self) -> bytes:
        count = self.num_tensors + self.num_symbols + int(self.has_workspace)
        return self.slots[:count].astype("<u8", copy=False).tobytes()

    def __len__(self) -> int:
        return self.num_tensors + self.num_symbols + int(self.has_workspace)

    def __repr__(self) -> str:
        return (f"<ArgumentBlock {self.num_tensors} tensors, {self.num_symbols} symbols"
                f"{', workspace' if self.has_workspace else ''} at {self.address:#x}>")
