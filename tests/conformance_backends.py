"""Backends for testing the conformance suite itself: one correct, several deliberately broken.

``ConfBackend`` (kind ``conf``, slot 9) is a minimal, correct v2 backend: host memory handed out
as if it were device memory (``host_accessible = False``, int pointers, freed through
``Storage(release=...)``), one stream object per thread, ``ctypes.memmove`` copies, and the CPU
plugin's compiler and kernels (same ABI), reached only through ``CpuBackend``'s public methods.
Each broken variant changes one thing, the way real plugins go wrong; ``tests/test_conformance.py``
checks the suite reports each under the right rule. The factories take no arguments, as
``--engine-backend MODULE:FACTORY`` requires; kernels are compiled under ``ENGINE_CACHE_DIR``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable, Mapping, NoReturn, Sequence

import attrs
import numpy as np

from engine.backend import (Availability, BackendBase, BinaryPayload, CandidateSpec, FusedLaunch, KernelBase,
                            LaunchDims, PreparedLaunch, ReferenceKernel, Stream)
from engine.errors import DeviceUnavailableError
from engine.settings import Settings
from engine.storage import Storage

__all__ = ["ConfBackend", "conf_backend", "misaligned_allocation", "short_copy", "zero_timer",
           "shared_workspace", "ignored_set_tensor", "stuck_event", "old_api", "unavailable", "BROKEN"]


class HostStream:
    """A thread's queue on the conf device (work is synchronous; the object only has identity)."""

    __slots__ = ("owner",)

    def __init__(self, owner: str):
        self.owner = owner

    def __repr__(self) -> str:
        return f"<HostStream of {self.owner}>"


class HostReplay:
    """A 'captured' run: the launches are bound to static buffers, so replaying is re-running them."""

    def __init__(self, run_fn: Callable[[], None]):
        self._run = run_fn

    def replay(self, stream: Stream = None) -> None:
        self._run()

    def close(self) -> None:
        self._run = _closed


def _closed() -> None:
    raise RuntimeError("this captured run was closed")


class ConfBackend(BackendBase):
    """A correct minimal v2 backend over host memory (see the module docstring)."""

    kind = "conf"
    workspace_slot = 9
    api_version = (2, 0)
    dlpack_device_type = 12  # kDLExtDev: tensors of this kind are not host memory to consumers
    formats = ("elf-so", "c-source")
    languages = ("c",)
    alignment = 64
    host_accessible = False
    has_streams = False

    def __init__(self, cache_dir: Any = None):
        self._cache_dir = cache_dir if cache_dir is not None else Settings.from_env().cache_dir
        self._cpu: BackendBase | None = None
        self._lock = threading.Lock()
        self._live: dict[int, np.ndarray] = {}
        self._local = threading.local()

    def _kernels(self) -> BackendBase:
        """The CPU plugin's backend, built on first use (construction stays cheap)."""
        with self._lock:
            if self._cpu is None:
                from engine_cpu import CpuBackend

                self._cpu = CpuBackend(cache_dir=self._cache_dir)
            return self._cpu

    def _check(self, device_index: int) -> None:
        if device_index != 0:
            raise DeviceUnavailableError(f"conf:{device_index}: the conf backend has one device, conf:0")

    def availability(self) -> Availability:
        return Availability(True, 1, ("host memory posing as a device (conformance tests)",))

    # -- memory --------------------------------------------------------------------------------
    def _raw(self, nbytes: int) -> tuple[int, np.ndarray]:
        buf = np.zeros(nbytes + self.alignment, np.uint8)
        addr = buf.ctypes.data
        return addr + (-addr % self.alignment), buf

    def _allocate(self, nbytes: int, device_index: int, stream: Stream) -> Storage:
        self._check(device_index)
        ptr, buf = self._raw(nbytes)
        with self._lock:
            self._live[ptr] = buf
        return Storage(self.device(device_index), ptr, nbytes, release=functools.partial(self._free, ptr),
                       stream=stream)

    def _free(self, ptr: int, stream: Stream) -> None:
        # Synchronous device: nothing queued on `stream` can still use the memory.
        with self._lock:
            self._live.pop(ptr, None)

    def copy_from_host(self, dst: int, src_host: int, nbytes: int, stream: Stream = None) -> None:
        ctypes.memmove(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int, stream: Stream = None) -> None:
        ctypes.memmove(dst_host, src, nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, stream: Stream = None) -> None:
        ctypes.memmove(dst, src, nbytes)

    def memset(self, dst: int, value: int, nbytes: int, stream: Stream = None) -> None:
        ctypes.memset(dst, value, nbytes)

    # -- streams -------------------------------------------------------------------------------
    def current_stream(self, device_index: int = 0) -> Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = HostStream(threading.current_thread().name)
        return stream

    # -- programs (the CPU plugin's, same ABI) ---------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        if device_index != 0:
            return f"the conf backend has one device, conf:0 (asked for conf:{device_index})"
        return self._kernels().loadable(binary_format, target, 0)

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> KernelBase:
        self._check(device_index)
        return self._kernels().load_kernel(attrs.evolve(spec, binaries=(binary,)), 0)

    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        return self._kernels().compile(source, language, options)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        return self._kernels().reference_kernels()

    def fuse(self, launches: Sequence[PreparedLaunch]) -> FusedLaunch | None:
        return self._kernels().fuse(launches)

    def capture(self, run_fn: Callable[[], None], *, stream: Stream = None, device_index: int = 0) -> HostReplay:
        self._check(device_index)
        return HostReplay(run_fn)


# -- broken variants ---------------------------------------------------------------------------------
class MisalignedAllocation(ConfBackend):
    """Pointers one byte past the alignment (a pool that forgot to round its offsets)."""

    def _raw(self, nbytes: int) -> tuple[int, np.ndarray]:
        ptr, buf = super()._raw(nbytes + 1)
        return ptr + 1, buf


class ShortCopy(ConfBackend):
    """copy_from_host drops the last byte (an off-by-one in a chunked upload)."""

    def copy_from_host(self, dst: int, src_host: int, nbytes: int, stream: Stream = None) -> None:
        ctypes.memmove(dst, src_host, max(nbytes - 1, 0))


class ZeroTimer(ConfBackend):
    """time() runs the work but reports zeros (a timer read before the events completed)."""

    def time(self, fn: Callable[[], object], *, stream: Stream = None, warmup: int = 1, repeat: int = 10,
             device_index: int = 0) -> list[float]:
        for _ in range(warmup + repeat):
            fn()
        return [0.0] * repeat


class SharedWorkspace(ConfBackend):
    """The k-th allocation of a size in any thread is the same memory in every thread (a scratch
    cache keyed by size that forgot the thread and stream); within one thread, allocations differ."""

    def __init__(self, cache_dir: Any = None):
        super().__init__(cache_dir)
        self._shared: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._counts = threading.local()

    def _raw(self, nbytes: int) -> tuple[int, np.ndarray]:
        counts = self._counts.__dict__.setdefault("by_size", {})
        k = counts[nbytes] = counts.get(nbytes, 0) + 1
        with self._lock:
            if (nbytes, k) not in self._shared:
                self._shared[(nbytes, k)] = super()._raw(nbytes)
            return self._shared[(nbytes, k)]


class _FrozenLaunch:
    """A prepared launch whose arguments are recorded at its first call: later set_tensor calls
    are ignored (a command buffer recorded once and never updated)."""

    def __init__(self, inner: PreparedLaunch):
        self._inner = inner
        self._recorded = False

    def call(self) -> int:
        self._recorded = True
        return self._inner.call()

    def set_tensor(self, index: int, ptr: Any) -> None:
        if not self._recorded:
            self._inner.set_tensor(index, ptr)

    def fail(self, code: int) -> NoReturn:
        self._inner.fail(code)


class _FrozenKernel(KernelBase):
    def __init__(self, inner: KernelBase):
        super().__init__(inner.spec, inner.binary)
        self._inner = inner

    def _prepare(self, tensors: list[Any], symbol_values: list[int], workspace: Any, stream: Stream,
                 dims: LaunchDims | None) -> PreparedLaunch:
        return _FrozenLaunch(self._inner.prepare(tensors, symbol_values, workspace, stream, dims))


class IgnoredSetTensor(ConfBackend):
    """Prepared launches ignore set_tensor after their first call.

    Memory is never freed here: the stale pointers such launches keep writing through must stay
    valid, or the test process would crash instead of reporting wrong results.
    """

    def _free(self, ptr: int, stream: Stream) -> None:
        pass

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> KernelBase:
        return _FrozenKernel(super()._load_binary(spec, binary, device_index))


class _StuckEvent:
    """An event that never completes: query() is always False and synchronize() does not wait."""

    def record(self, stream: Stream = None) -> None:
        pass

    def wait(self, stream: Stream = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def elapsed_ms(self, end: Any) -> float:
        return 0.0


class StuckEvent(ConfBackend):
    def create_event(self, device_index: int = 0) -> _StuckEvent:
        return _StuckEvent()


class OldApi(ConfBackend):
    """Written for contract 1.0: the registry refuses it."""

    api_version = (1, 0)


class Unavailable(ConfBackend):
    """Installed but without a device here: the suite checks the declared data and skips the rest."""

    def availability(self) -> Availability:
        return Availability(False, reason="no conf device on this machine (set CONF_VISIBLE_DEVICES)")


def conf_backend() -> ConfBackend:
    return ConfBackend()


def misaligned_allocation() -> ConfBackend:
    return MisalignedAllocation()


def short_copy() -> ConfBackend:
    return ShortCopy()


def zero_timer() -> ConfBackend:
    return ZeroTimer()


def shared_workspace() -> ConfBackend:
    return SharedWorkspace()


def ignored_set_tensor() -> ConfBackend:
    return IgnoredSetTensor()


def stuck_event() -> ConfBackend:
    return StuckEvent()


def old_api() -> ConfBackend:
    return OldApi()


def unavailable() -> ConfBackend:
    return Unavailable()


#: Factory name -> the rule the suite must report it under.
def template_backend() -> BackendBase:
    """The plugin template (examples/plugin-template, on PYTHONPATH) with the environment's cache."""
    from engine_template import TemplateBackend

    return TemplateBackend(Settings.from_env().cache_dir)


BROKEN: Mapping[str, str] = {
    "misaligned_allocation": "allocation.alignment",
    "short_copy": "copy.host_roundtrip",
    "zero_timer": "timing.samples",
    "shared_workspace": "isolation.threads",
    "ignored_set_tensor": "launch.prepared_set_tensor",
    "stuck_event": "event.completes",
    "old_api": "plugin.registered",
}
