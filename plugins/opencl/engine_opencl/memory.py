"""The allocator role: ``cl.Buffer`` device memory addressed by ``BufferPtr(buffer, offset)``.

Buffers are genuine device memory (no SVM, no host mapping): the core reaches them only through
the copies here. Host addresses (``int``) are wrapped as ctypes arrays so pyopencl reads and writes
them in place. Every driver error becomes an ``OpenCLError`` naming the operation and sizes.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engine.device import Device
from engine.errors import EngineError
from engine.pointer import BufferPtr
from engine.storage import Storage

from engine_opencl.devices import OpenCLDevice
from engine_opencl.queues import Queue

__all__ = ["OpenCLError", "allocate", "write", "read", "copy", "fill", "kernel_buffer", "export_handle",
           "import_handle"]


class OpenCLError(EngineError, RuntimeError):
    """An OpenCL copy or fill failed (the message names the operation, the pointers and the cause)."""


def allocate(dev: OpenCLDevice, device: Device, nbytes: int, unit: int, limit: int, stream: Any) -> Storage:
    """``nbytes`` of device memory; zero bytes get one ``unit`` (OpenCL refuses empty buffers).

    Raises ``MemoryError`` (``BackendBase.allocate`` adds size and device) when the driver refuses.
    """
    import pyopencl as cl

    if nbytes > limit:
        raise MemoryError(f"larger than the largest single allocation allowed ({limit} bytes)")
    try:
        buffer = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, max(nbytes, unit))
    except cl.Error as exc:
        raise MemoryError(f"the driver refused the buffer: {exc}") from exc
    # Releasing on any stream is safe: clReleaseMemObject defers freeing until the commands queued
    # with the buffer have finished, so the storage's stream needs no ordering here.
    return Storage(device, BufferPtr(buffer, 0), nbytes, release=lambda stream: buffer.release(), stream=stream)


def _check(ptr: Any, what: str) -> BufferPtr:
    if not isinstance(ptr, BufferPtr):
        raise OpenCLError(f"{what}: expected an opencl device pointer (engine.pointer.BufferPtr), got {ptr!r}")
    return ptr


def _host(addr: int, nbytes: int) -> ctypes.Array:
    return (ctypes.c_char * nbytes).from_address(addr)


def write(queue: Queue, dst: Any, src_host: int, nbytes: int) -> None:
    """Host to device, blocking: the host memory may be reused as soon as this returns."""
    import pyopencl as cl

    dst = _check(dst, "copy_from_host")
    if nbytes:
        try:
            cl.enqueue_copy(queue.queue, dst.buffer, _host(src_host, nbytes), dst_offset=dst.offset, is_blocking=True)
        except cl.Error as exc:
            raise OpenCLError(f"copy_from_host of {nbytes} bytes to {dst!r} (buffer of {dst.buffer.size}): "
                              f"{exc}") from exc


def read(queue: Queue, dst_host: int, src: Any, nbytes: int) -> None:
    """Device to host, queued: the host bytes are valid once an event recorded after it (or the
    queue) has completed."""
    import pyopencl as cl

    src = _check(src, "copy_to_host")
    if nbytes:
        try:
            queue.keep(cl.enqueue_copy(queue.queue, _host(dst_host, nbytes), src.buffer, src_offset=src.offset,
                                       is_blocking=False))
        except cl.Error as exc:
            raise OpenCLError(f"copy_to_host of {nbytes} bytes from {src!r} (buffer of {src.buffer.size}): "
                              f"{exc}") from exc


def copy(queue: Queue, dst: Any, src: Any, nbytes: int) -> None:
    """Device to device, queued (the regions must not overlap)."""
    import pyopencl as cl

    dst, src = _check(dst, "copy_device"), _check(src, "copy_device")
    if nbytes:
        try:
            cl.enqueue_copy(queue.queue, dst.buffer, src.buffer, byte_count=nbytes, src_offset=src.offset,
                            dst_offset=dst.offset)
        except cl.Error as exc:
            raise OpenCLError(f"copy_device of {nbytes} bytes from {src!r} to {dst!r}: {exc}") from exc


def fill(queue: Queue, dst: Any, value: int, nbytes: int) -> None:
    """Set ``nbytes`` bytes to ``value``, queued."""
    import numpy as np
    import pyopencl as cl

    dst = _check(dst, "memset")
    if nbytes:
        try:
            cl.enqueue_fill_buffer(queue.queue, dst.buffer, np.uint8(value & 0xFF), dst.offset, nbytes)
        except cl.Error as exc:
            raise OpenCLError(f"memset of {nbytes} bytes at {dst!r}: {exc}") from exc


def kernel_buffer(ptr: Any, base_align: int) -> Any:
    """The ``cl_mem`` a kernel argument at ``ptr`` is passed as: the buffer itself, or a sub-buffer
    from ``ptr.offset`` to the buffer's end. ``ValueError`` when the offset is not a multiple of the
    device's ``MEM_BASE_ADDR_ALIGN``, which OpenCL requires of sub-buffers."""
    if ptr is None:
        return None
    if not isinstance(ptr, BufferPtr):
        raise ValueError(f"expected an opencl device pointer (engine.pointer.BufferPtr), got {ptr!r}")
    if ptr.offset == 0:
        return ptr.buffer
    if ptr.offset % base_align:
        raise ValueError(f"{ptr!r} is at byte offset {ptr.offset}, not a multiple of the device's sub-buffer "
                         f"alignment (MEM_BASE_ADDR_ALIGN, {base_align} bytes)")
    rest = ptr.buffer.size - ptr.offset
    if rest <= 0:  # an empty tensor at the buffer's end: the kernel reads nothing from it
        return ptr.buffer
    return ptr.buffer.get_sub_region(ptr.offset, rest)


def export_handle(ptr: Any) -> tuple[int, int]:
    """DLPack's ``(data, byte_offset)``: for OpenCL, ``data`` is the ``cl_mem`` handle (dlpack.h)."""
    if not isinstance(ptr, BufferPtr):
        raise BufferError(f"expected an opencl device pointer (engine.pointer.BufferPtr), got {ptr!r}")
    return ptr.buffer.int_ptr, ptr.offset


def import_handle(dev: OpenCLDevice, data: int, byte_offset: int) -> BufferPtr:
    """The pointer for a DLPack tensor's ``cl_mem`` handle, retained for as long as it is used."""
    import pyopencl as cl

    buffer = cl.Buffer.from_int_ptr(data, retain=True)
    if buffer.context != dev.context:
        raise BufferError(f"the DLPack tensor's cl_mem belongs to another OpenCL context than opencl:{dev.index} "
                          f"({dev.name}); copy it through the host")
    return BufferPtr(buffer, byte_offset)
