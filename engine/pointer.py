"""Device pointers for devices without flat addresses: a buffer handle plus a byte offset.

The core never computes with a device pointer beyond ``ptr + nbytes`` (DESIGN §4, contract v2):
backends with flat address spaces (CPU, CUDA, HIP) hand out plain ``int`` addresses, where that
addition is free on the hot path. Devices whose memory is a handle (OpenCL ``cl_mem``, Vulkan
buffers, many NPUs) hand out ``BufferPtr(buffer, offset)``: adding to it moves the offset, the
buffer stays the one the backend allocated, and the backend passes both to its kernels.
"""

from __future__ import annotations

from typing import Any, final

__all__ = ["BufferPtr", "is_null"]


@final
class BufferPtr:
    """``offset`` bytes into ``buffer`` (the backend's handle object, compared by identity)."""

    __slots__ = ("buffer", "offset")

    def __init__(self, buffer: Any, offset: int = 0):
        if offset < 0:
            raise ValueError(f"a buffer offset cannot be negative, got {offset}")
        self.buffer = buffer
        self.offset = offset

    def __add__(self, nbytes: int) -> "BufferPtr":
        if nbytes == 0:
            return self
        return BufferPtr(self.buffer, self.offset + nbytes)

    __radd__ = __add__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BufferPtr) and other.buffer is self.buffer and other.offset == self.offset

    def __hash__(self) -> int:
        return hash((id(self.buffer), self.offset))

    def __repr__(self) -> str:
        return f"BufferPtr({type(self.buffer).__name__}@{id(self.buffer):#x} + {self.offset})"


def is_null(ptr: object) -> bool:
    """Whether ``ptr`` is the null pointer (``None``, or a zero address)."""
    return ptr is None or ptr == 0
