"""``GpuBackend``: the device contract for CUDA-like drivers, written once over ``Driver``.

A vendor plugin subclasses it, declares its kind, slot, DLPack type and formats, passes its driver
adapter, and writes the parts that differ per vendor: which binaries it can load (``loadable``),
how a binary becomes a code object (``module_image``) and ``compile``. Everything else is here:

* **availability** probed once, lazily (``availability.probe``); a graph cannot be loaded on an
  unusable kind, and every device call goes through ``ready(index)``, which raises
  ``DeviceUnavailableError`` with the reason;
* **streams**: ``current_stream`` is the caller's stream when one is set (``use_stream``, or a
  framework's current stream through the plugin's stream sources), else the thread's own stream
  (``streams.StreamLanes``); ``has_streams`` so the core keeps a lane per (thread, stream);
* **memory** from the device's stream-ordered pool (``memory.PoolAllocator``); copies and memset on
  the given stream (else the current one); ``host_accessible = False``;
* **kernels**: ``_load_binary`` loads the image (modules shared by content between candidates) and
  returns a ``launch.GpuKernel``; launches through prepared argument blocks; a debug mode;
* **events** (``events.GpuEvent``), so ``time`` (inherited) is device time between two events;
* **capture** as a driver graph (``capture.capture``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import weakref
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

from engine.backend.base import BackendBase, BinaryRefused
from engine.backend.contract import Availability, BinaryPayload, CandidateSpec
from engine.backend.gpu.availability import Probe, cuda_version_text, probe
from engine.backend.gpu.capture import GraphReplay, capture
from engine.backend.gpu.driver import Driver, DriverError
from engine.backend.gpu.events import GpuEvent
from engine.backend.gpu.launch import GpuKernel, Module
from engine.backend.gpu.memory import PoolAllocator
from engine.backend.gpu.streams import StreamLanes, StreamSource
from engine.errors import DeviceUnavailableError
from engine.storage import Storage

__all__ = ["GpuBackend", "stream_handle"]


def stream_handle(stream: Any) -> int:
    """A stream handle from what callers hold: an ``int``, an object with ``__cuda_stream__()``
    (cuda.core), ``cuda_stream`` (torch) or ``ptr`` (CuPy), or a driver handle object with
    ``__int__`` (``cuda.bindings.driver.CUstream``)."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        return int(protocol()[1])
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    try:
        return int(stream)
    except (TypeError, ValueError):
        raise TypeError(f"expected a stream (an int handle, a torch/CuPy/cuda.core stream or a driver "
                        f"CUstream), got {type(stream).__name__}") from None


class GpuBackend(BackendBase):
    """Shared implementation for CUDA-like drivers (see the module docstring)."""

    has_streams: ClassVar[bool] = True
    host_accessible: ClassVar[bool] = False
    #: The pools hand out at least 256-byte aligned memory; the planner aligns offsets to it.
    alignment: ClassVar[int] = 256
    #: The variable that hides devices (named in the "no device" reason).
    visible_devices_env: ClassVar[str] = "CUDA_VISIBLE_DEVICES"
    #: The oldest driver version this plugin accepts, in the driver's encoding.
    min_driver_version: ClassVar[int] = 0
    #: Stream handles that name a default stream, which cannot be captured.
    default_streams: ClassVar[frozenset[int]] = frozenset({0})
    install_hint: ClassVar[str] = "install the GPU driver"
    upgrade_hint: ClassVar[str] = "upgrade the GPU driver"

    def __init__(self, driver: Driver, *, debug: bool = False, stream_sources: Sequence[StreamSource] = (),
                 env: Mapping[str, str] | None = None):
        self.driver = driver
        self.debug = debug
        self._env = env if env is not None else os.environ
        self._lanes = StreamLanes(driver, stream_sources)
        self._lock = threading.Lock()
        self._probe: Probe | None = None
        self._pools: dict[int, PoolAllocator] = {}
        # Candidates sharing a binary share its module; it is unloaded with the last kernel using it.
        self._modules: weakref.WeakValueDictionary[tuple[int, str], Module] = weakref.WeakValueDictionary()

    # -- availability --------------------------------------------------------------------------
    def probed(self) -> Probe:
        if self._probe is None:
            with self._lock:
                if self._probe is None:
                    found = probe(self.driver, kind=self.kind, min_version=self.min_driver_version,
                                  visible_env=self.visible_devices_env, env=self._env,
                                  version_text=self.version_text, install_hint=self.install_hint,
                                  upgrade_hint=self.upgrade_hint)
                    self._lanes.always_activate = found.availability.device_count > 1
                    self._probe = found
        return self._probe

    def version_text(self, version: int) -> str:
        """The driver version as users know it (CUDA's encoding by default; HIP overrides)."""
        return cuda_version_text(version)

    def availability(self) -> Availability:
        return self.probed().availability

    def ready(self, index: int) -> None:
        """Raise ``DeviceUnavailableError`` (with the reason) unless device ``index`` can be used."""
        avail = self.availability()
        if not avail.available:
            raise DeviceUnavailableError(f"{self.kind}:{index} is not usable: {avail.reason}")
        if not 0 <= index < avail.device_count:
            raise DeviceUnavailableError(f"{self.kind}:{index} does not exist ({avail.device_count} {self.kind} "
                                         f"devices)")

    def arch(self, index: int) -> tuple[int, int]:
        self.ready(index)
        return self.probed().archs[index]

    # -- streams and events --------------------------------------------------------------------
    def current_stream(self, device_index: int = 0) -> int:
        if self._probe is None or not self._probe.availability.available:
            self.ready(device_index)
        return self._lanes.current(device_index)

    def _stream(self, stream: Any, device_index: int = 0) -> int:
        return self.current_stream(device_index) if stream is None else int(stream)

    @contextlib.contextmanager
    def use_stream(self, stream: Any, device_index: int = 0) -> Iterator[int]:
        """Run the engine's work of this thread on ``stream`` (see ``stream_handle``) within the block."""
        self.ready(device_index)
        with self._lanes.use(stream_handle(stream), device_index) as handle:
            yield handle

    #: The stream a DLPack consumer means by ``stream=None`` (DLPack: the legacy default stream).
    dlpack_default_stream: ClassVar[int] = 0

    def dlpack_stream(self, value: int | None, device_index: int = 0) -> int | None:
        """DLPack stream numbers are this driver's stream handles (CUDA: 1 legacy default, 2
        per-thread default, else a ``CUstream``); ``None`` is the legacy default stream."""
        return self.dlpack_default_stream if value is None else int(value)

    def synchronize(self, device_index: int = 0, stream: Any = None) -> None:
        if stream is not None:
            self.driver.stream_synchronize(int(stream))
            return
        self.ready(device_index)
        self._lanes.activate(device_index)
        self.driver.device_synchronize()

    def create_event(self, device_index: int = 0) -> GpuEvent:
        self.ready(device_index)
        self._lanes.activate(device_index)
        return GpuEvent(self.driver, device_index, functools.partial(self._stream_or_current, device_index))

    def _stream_or_current(self, device_index: int, stream: Any) -> int:
        return self.current_stream(device_index) if stream is None else int(stream)

    # -- memory --------------------------------------------------------------------------------
    def pool(self, index: int) -> PoolAllocator:
        allocator = self._pools.get(index)
        if allocator is None:
            self.ready(index)
            with self._lock:
                allocator = self._pools.get(index)
                if allocator is None:
                    self._lanes.activate(index)
                    allocator = self._pools[index] = PoolAllocator(self.driver, self.device(index),
                                                                   self.driver.pool_prepare(index))
        return allocator

    def _allocate(self, nbytes: int, device_index: int, stream: Any) -> Storage:
        return self.pool(device_index).allocate(nbytes, self._stream(stream, device_index))

    def prepare_allocation(self, nbytes: int, device_index: int = 0, stream: Any = None) -> Callable[[], Storage]:
        super().prepare_allocation(nbytes, device_index, stream)  # the size check
        return self.pool(device_index).factory(nbytes, self._stream(stream, device_index))

    def copy_from_host(self, dst: Any, src_host: int, nbytes: int, stream: Any = None) -> None:
        if nbytes:
            self.driver.copy_htod(int(dst), int(src_host), nbytes, self._stream(stream))

    def copy_to_host(self, dst_host: int, src: Any, nbytes: int, stream: Any = None) -> None:
        if nbytes:
            self.driver.copy_dtoh(int(dst_host), int(src), nbytes, self._stream(stream))

    def copy_device(self, dst: Any, src: Any, nbytes: int, stream: Any = None) -> None:
        if nbytes:
            self.driver.copy_dtod(int(dst), int(src), nbytes, self._stream(stream))

    def memset(self, dst: Any, value: int, nbytes: int, stream: Any = None) -> None:
        if nbytes:
            self.driver.memset8(int(dst), int(value) & 0xFF, nbytes, self._stream(stream))

    # -- kernels ---------------------------------------------------------------------------------
    def module_image(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> bytes:
        """The code object to load for ``binary`` (raise ``BinaryRefused`` to move on). Vendor hook."""
        raise NotImplementedError(f"{type(self).__name__}.module_image")

    def module_refusal(self, error: DriverError) -> str | None:
        """The ``BinaryRefused`` reason for a driver error while loading a module, or ``None`` to
        raise it as is (a vendor hook: e.g. an unsupported PTX version is a refusal)."""
        return None

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> GpuKernel:
        self.ready(device_index)
        image = self.module_image(spec, binary, device_index)
        key = (device_index, hashlib.sha256(image).hexdigest())
        with self._lock:
            module = self._modules.get(key)
            if module is None:
                self._lanes.activate(device_index)
                try:
                    handle = self.driver.module_load(image)
                except DriverError as exc:
                    reason = self.module_refusal(exc)
                    if reason is None:
                        raise
                    raise BinaryRefused(reason) from exc
                module = self._modules[key] = Module(self.driver, handle, device_index)
        try:
            function = self.driver.module_function(module.handle, spec.entry)
        except DriverError as exc:
            raise BinaryRefused(f"the module has no kernel {spec.entry!r} ({exc.name})") from exc
        return GpuKernel(spec, binary, module, function, f"{self.kind}:{device_index}", debug=self.debug)

    # -- capture ---------------------------------------------------------------------------------
    def capture(self, run_fn: Callable[[], None], *, stream: Any = None, device_index: int = 0) -> GraphReplay:
        return capture(self.driver, run_fn, self._stream(stream, device_index), f"{self.kind}:{device_index}",
                       self.default_streams)
