"""Shared test helpers: a second device kind on host memory, registries, small graphs.

``HostKindBackend`` is a real backend (real allocations, real copies, real C kernels through the
CPU plugin's loader) under its own kind name and workspace slot: the shape a third-party plugin
takes, and the second kind that multi-device and wrong-device tests need.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from engine.backend import Availability, BackendBase, CandidateSpec
from engine.plugins import Registry
from engine.settings import Settings
from engine.storage import Storage


class HostKindBackend(BackendBase):
    """Host memory under another kind name; kernels are the CPU plugin's (same ABI)."""

    kind = "hostdev"
    workspace_slot = 3
    dlpack_device_type = 14  # an arbitrary non-CPU code: tensors of this kind are copied, not shared
    formats = ("elf-so", "c-source")
    languages = ("c",)
    alignment = 64
    host_accessible = False

    def __init__(self, cpu: BackendBase):
        self._cpu = cpu

    def availability(self) -> Availability:
        return Availability(True, 1, ("host memory posing as a device",))

    def _allocate(self, nbytes: int, device_index: int) -> Storage:
        buf = np.empty(nbytes + 64, np.uint8)
        addr = buf.ctypes.data
        pad = -addr % 64
        return Storage(self.device(device_index), addr + pad, nbytes, owner=buf)

    def copy_from_host(self, dst_addr, src_addr, nbytes, stream=None):
        ctypes.memmove(dst_addr, src_addr, nbytes)

    def copy_to_host(self, dst_addr, src_addr, nbytes, stream=None):
        ctypes.memmove(dst_addr, src_addr, nbytes)

    def copy_device(self, dst_addr, src_addr, nbytes, stream=None):
        ctypes.memmove(dst_addr, src_addr, nbytes)

    def memset(self, addr, value, nbytes, stream=None):
        ctypes.memset(addr, value, nbytes)

    def load_kernel(self, spec: CandidateSpec, device_index: int = 0):
        return self._cpu.load_kernel(spec, 0)

    def compile(self, source, language, options=None):
        return self._cpu.compile(source, language, options)


def run_in_threads(work, n: int) -> None:
    """Run ``work(i)`` for i in 0..n-1 in ``n`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def make_registry(cache_dir: Path, *, with_hostdev: bool = False) -> Registry:
    registry = Registry(Settings(cache_dir=cache_dir))
    registry.load_entry_points()
    if with_hostdev:
        registry.register_backend(HostKindBackend(registry.backend("cpu")), distribution="tests")
    return registry
