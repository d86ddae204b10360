"""Allocations, pointers, copies and memset, at the odd sizes and offsets real graphs produce.

Every check reads the bytes back through the backend's own copies and compares them exactly,
neighbours included: a copy one byte short, or one byte long, is a wrong result somewhere else.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.device import Device
from engine.pointer import BufferPtr
from engine.storage import Storage
from engine.testing.buffers import host_address, pattern
from engine.testing.checks import bytes_differ, check

conformance = pytest.mark.conformance

SIZES = (0, 1, 4097, 64 << 20)
OFFSETS = (0, 1, 3, 7)
COPY_SIZES = (1, 13, 4099)
PAD = 64
SPAN = PAD + max(OFFSETS) + max(COPY_SIZES) + PAD


def misalignment(ptr, alignment: int) -> int | None:
    """How far ``ptr`` is past an aligned address (``None`` for a pointer type the suite cannot read)."""
    if isinstance(ptr, int):
        return ptr % alignment
    if isinstance(ptr, BufferPtr):
        return ptr.offset % alignment
    return None


def overlaps(a: Storage, b: Storage) -> bool:
    if not a.nbytes or not b.nbytes:
        return False
    pa, pb = a.ptr, b.ptr
    if isinstance(pa, int) and isinstance(pb, int):
        return pa < pb + b.nbytes and pb < pa + a.nbytes
    if isinstance(pa, BufferPtr) and isinstance(pb, BufferPtr) and pa.buffer is pb.buffer:
        return pa.offset < pb.offset + b.nbytes and pb.offset < pa.offset + a.nbytes
    return False


@pytest.fixture
def storages(memory):
    return [memory.alloc(n) for n in SIZES]


@conformance("allocation.sizes")
def test_sizes(backend, device_index, storages):
    for n, s in zip(SIZES, storages):
        check(isinstance(s, Storage), "allocation.sizes", f"allocate({n}) to return a Storage", type(s).__name__)
        check(s.nbytes == n, "allocation.sizes", f"allocate({n}).nbytes == {n}", s.nbytes)
        check(s.device == Device(backend.kind, device_index), "allocation.sizes",
              f"allocate({n}) on {Device(backend.kind, device_index)}", s.device)


@conformance("allocation.alignment")
def test_alignment(backend, storages, memory):
    more = [memory.alloc(n) for n in (3, 5, 7, 100, 1000)]
    for s in storages + more:
        if s.ptr is None:
            continue
        off = misalignment(s.ptr, backend.alignment)
        check(not off, "allocation.alignment", f"allocate({s.nbytes}) aligned to {backend.alignment} bytes",
              f"{s.ptr!r} is {off} bytes past an aligned address")


@conformance("allocation.distinct")
def test_distinct(storages, memory):
    live = storages + [memory.alloc(4097) for _ in range(4)]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            check(not overlaps(a, b), "allocation.distinct", "live allocations not to overlap",
                  f"{a!r} overlaps {b!r}")


@conformance("allocation.extent")
def test_extent(storages, memory):
    for s in storages:
        if s.nbytes == 0:
            continue
        edge = max(1, min(s.nbytes // 2, 4096))  # head and tail do not overlap unless nbytes == 1
        head, tail = pattern(edge, 1), pattern(edge, 2)
        memory.write(s.ptr + (s.nbytes - edge), tail)
        memory.write(s.ptr, head)
        got_head = memory.read(s.ptr, edge)
        got_tail = memory.read(s.ptr + (s.nbytes - edge), edge)
        if edge == s.nbytes:  # the two writes cover the same bytes: the later one wins
            tail = head
        check(got_head == head.tobytes(), "allocation.extent", f"the first {edge} bytes of a {s.nbytes}-byte "
              "allocation written and read back", lambda: bytes_differ(head, got_head))
        check(got_tail == tail.tobytes(), "allocation.extent", f"the last {edge} bytes of a {s.nbytes}-byte "
              "allocation written and read back", lambda: bytes_differ(tail, got_tail, s.nbytes - edge))


@conformance("allocation.host_view")
def test_host_view(backend, memory):
    s = memory.alloc(4097)
    if not backend.host_accessible:
        check(s.host_view is None, "allocation.host_view", "no host_view when host_accessible is False",
              repr(s.host_view))
        return
    check(isinstance(s.ptr, int), "allocation.host_view", "int pointers when host_accessible",
          type(s.ptr).__name__)
    view = s.host_view
    check(isinstance(view, memoryview) and view.nbytes == s.nbytes, "allocation.host_view",
          f"a memoryview of {s.nbytes} bytes", repr(view))
    data = pattern(s.nbytes, 3)
    memory.write(s.ptr, data)
    memory.sync()
    check(bytes(view) == data.tobytes(), "allocation.host_view", "host_view to show the bytes copied to ptr",
          lambda: bytes_differ(data, bytes(view)))


@conformance("allocation.prepared")
def test_prepared_allocation(backend, device_index, stream):
    for n in (0, 4097):
        make = backend.prepare_allocation(n, device_index, stream)
        a, b = make(), make()
        try:
            for s in (a, b):
                check(isinstance(s, Storage) and s.nbytes == n, "allocation.prepared",
                      f"the factory to make {n}-byte storages", repr(s))
                off = None if s.ptr is None else misalignment(s.ptr, backend.alignment)
                check(not off, "allocation.prepared", f"pointers aligned to {backend.alignment}",
                      f"{s.ptr!r} is {off} bytes past")
            check(not overlaps(a, b), "allocation.prepared", "two storages from one factory not to overlap",
                  f"{a!r} and {b!r}")
        finally:
            a.close()
            b.close()


@conformance("allocation.release")
def test_release(backend, device_index, stream):
    for _ in range(16):
        s = backend.allocate(1 << 20, device_index, stream)
        s.close()
        try:
            s.close()
        except Exception as exc:  # noqa: BLE001 - the finding itself
            check(False, "allocation.release", "a second close() to be harmless", f"{type(exc).__name__}: {exc}")
    again = backend.allocate(1 << 20, device_index, stream)
    check(again.nbytes == 1 << 20, "allocation.release", "allocation after releases to work", repr(again))
    again.close()


@conformance("allocation.max")
def test_max_allocation(backend, device_index):
    limit = backend.max_allocation(device_index)
    check(limit is None or (type(limit) is int and limit > 0), "allocation.max", "None or a positive int",
          repr(limit))


@conformance("pointer.arithmetic")
def test_pointer_arithmetic(memory):
    s = memory.alloc(256)
    p = s.ptr
    check(type(p + 5) is type(p), "pointer.arithmetic", f"ptr + 5 to be a {type(p).__name__}", type(p + 5).__name__)
    check((p + 3) + 4 == p + 7, "pointer.arithmetic", "(ptr + 3) + 4 == ptr + 7", f"{(p + 3) + 4!r} != {p + 7!r}")
    check(p + 0 == p, "pointer.arithmetic", "ptr + 0 == ptr", repr(p + 0))
    background, data = pattern(256, 4), pattern(64, 5)
    memory.write(p, background)
    memory.write(p + 37, data)
    expected = background.copy()
    expected[37:101] = data
    got = memory.read(p, 256)
    check(got == expected.tobytes(), "pointer.arithmetic", "bytes written at ptr + 37 to appear at offset 37",
          lambda: bytes_differ(expected, got))


@conformance("copy.host_roundtrip")
def test_host_roundtrip(memory):
    s = memory.alloc(SPAN)
    for off in OFFSETS:
        for n in COPY_SIZES:
            data = pattern(n, off * 7 + n)
            memory.write(s.ptr + off, data)
            got = memory.read(s.ptr + off, n)
            check(got == data.tobytes(), "copy.host_roundtrip", f"{n} bytes back from device offset {off}",
                  lambda: bytes_differ(data, got))


@conformance("copy.host_to_device_bounds")
def test_host_to_device_bounds(memory):
    s = memory.alloc(SPAN)
    background = pattern(SPAN, 99)
    for off in OFFSETS:
        for n in COPY_SIZES:
            data = pattern(n, off * 11 + n)
            memory.write(s.ptr, background)
            memory.write(s.ptr + PAD + off, data)
            expected = background.copy()
            expected[PAD + off:PAD + off + n] = data
            got = memory.read(s.ptr, SPAN)
            check(got == expected.tobytes(), "copy.host_to_device_bounds",
                  f"copy_from_host of {n} bytes at device offset {PAD + off} to change exactly those bytes",
                  lambda: bytes_differ(expected, got))


@conformance("copy.device_to_host_bounds")
def test_device_to_host_bounds(memory, backend):
    source = pattern(SPAN, 17)
    s = memory.upload(source)
    for off in OFFSETS:
        for n in COPY_SIZES:
            host = np.full(SPAN, 0xEE, np.uint8)
            backend.copy_to_host(host_address(host) + PAD + off, s.ptr + off, n, memory.stream)
            memory.sync()
            expected = np.full(SPAN, 0xEE, np.uint8)
            expected[PAD + off:PAD + off + n] = source[off:off + n]
            check(np.array_equal(host, expected), "copy.device_to_host_bounds",
                  f"copy_to_host of {n} bytes from device offset {off} to host offset {PAD + off} to write "
                  "exactly those bytes", lambda: bytes_differ(expected, host))


@conformance("copy.device_to_device")
def test_device_to_device(memory, backend):
    source = pattern(SPAN, 23)
    background = pattern(SPAN, 29)
    src = memory.upload(source)
    dst = memory.alloc(SPAN)
    for src_off, dst_off in ((0, 0), (1, 3), (3, 7), (7, 1)):
        for n in COPY_SIZES:
            memory.write(dst.ptr, background)
            backend.copy_device(dst.ptr + PAD + dst_off, src.ptr + src_off, n, memory.stream)
            expected = background.copy()
            expected[PAD + dst_off:PAD + dst_off + n] = source[src_off:src_off + n]
            got = memory.read(dst.ptr, SPAN)
            check(got == expected.tobytes(), "copy.device_to_device",
                  f"copy_device of {n} bytes from offset {src_off} to offset {PAD + dst_off}",
                  lambda: bytes_differ(expected, got))


@conformance("copy.zero_bytes")
def test_zero_bytes(memory, backend):
    source = pattern(256, 31)
    a = memory.upload(source)
    b = memory.upload(source[::-1].copy())
    host = np.full(16, 0xEE, np.uint8)
    backend.copy_from_host(a.ptr + 3, host_address(host), 0, memory.stream)
    backend.copy_to_host(host_address(host), a.ptr + 5, 0, memory.stream)
    backend.copy_device(a.ptr + 7, b.ptr, 0, memory.stream)
    backend.memset(a.ptr + 9, 0x11, 0, memory.stream)
    got = memory.read(a.ptr, 256)
    check(got == source.tobytes(), "copy.zero_bytes", "0-byte copies and memset to leave the device bytes alone",
          lambda: bytes_differ(source, got))
    check(bool(np.all(host == 0xEE)), "copy.zero_bytes", "a 0-byte copy_to_host to leave the host bytes alone",
          lambda: bytes_differ(np.full(16, 0xEE, np.uint8), host))


@conformance("memset.value")
def test_memset(memory, backend):
    s = memory.alloc(SPAN)
    background = pattern(SPAN, 37)
    for value in (0, 0xA5, 0xFF):
        for off in OFFSETS[:3]:
            for n in COPY_SIZES:
                memory.write(s.ptr, background)
                backend.memset(s.ptr + PAD + off, value, n, memory.stream)
                expected = background.copy()
                expected[PAD + off:PAD + off + n] = value
                got = memory.read(s.ptr, SPAN)
                check(got == expected.tobytes(), "memset.value",
                      f"memset(ptr + {PAD + off}, 0x{value:02x}, {n}) to set exactly those bytes",
                      lambda: bytes_differ(expected, got))
