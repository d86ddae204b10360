"""``OpenCLBackend``: OpenCL devices as engine kind ``opencl`` (slot 3), through pyopencl.

Construction is cheap and touches no driver (the plugin hook builds one at discovery): platforms
are enumerated and contexts created on the first call that needs a device, once. The three roles
live in their own modules: ``memory`` (allocator), ``program`` (compiler and loader), ``kernel``
(launches); ``queues`` holds streams and events.

No ``fuse`` and no ``capture``: launches are already queued without the host waiting, and core
OpenCL has no recorded command buffers (``cl_khr_command_buffer`` could back ``capture`` later).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, ClassVar, Mapping

from engine.backend import Availability, BackendBase, BinaryPayload, BinaryRefused, CandidateSpec, ReferenceKernel
from engine.errors import DeviceUnavailableError, KernelError, Unsupported
from engine.settings import Settings
from engine.storage import Storage

from engine_opencl import memory
from engine_opencl.devices import OpenCLDevice, discover
from engine_opencl.kernel import OpenCLKernel
from engine_opencl.program import (FORMAT, LANGUAGE, ProgramCache, argument_count, kernel_names, source_payload,
                                   split_payload, unloadable)
from engine_opencl.queues import OpenCLEvent, Queue, Queues

__all__ = ["OpenCLBackend"]


class OpenCLBackend(BackendBase):
    """Every OpenCL device of every platform, in a stable order: ``opencl:0``, ``opencl:1``, …

    ``devices`` filters them (``ENGINE_OPENCL_DEVICES``), ``max_allocation`` caps single
    allocations below the device's ``MAX_MEM_ALLOC_SIZE``, ``alignment`` raises the 512-byte
    alignment for devices whose sub-buffers need more (see ``docs/opencl.md``).
    """

    kind: ClassVar[str] = "opencl"
    workspace_slot: ClassVar[int] = 3
    api_version: ClassVar[tuple[int, int]] = (2, 0)
    dlpack_device_type: ClassVar[int] = 4  # kDLOpenCL
    formats: ClassVar[tuple[str, ...]] = (FORMAT,)
    languages: ClassVar[tuple[str, ...]] = (LANGUAGE,)
    #: Sub-buffer offsets must be multiples of MEM_BASE_ADDR_ALIGN, and the planner places tensors at
    #: multiples of this: 512 bytes covers what CPU devices (1024 bits) and the GPUs we know of ask
    #: (up to 4096 bits); discovery checks each device.
    alignment: ClassVar[int] = 512
    host_accessible: ClassVar[bool] = False
    has_streams: ClassVar[bool] = False
    rebuild_hint: ClassVar[str] = "rebuild the bundle with OpenCL C source (format 'opencl-source')"

    def __init__(self, cache_dir: Path | None = None, *, devices: str | None = None,
                 max_allocation: int | None = None, alignment: int | None = None):
        if alignment is not None:
            if alignment < 128 or alignment & (alignment - 1):
                raise ValueError(f"opencl alignment must be a power of two of at least 128 bytes, got {alignment}")
            self.alignment = alignment  # type: ignore[misc]  # per instance, before any planning
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Settings.from_env().cache_dir
        self.selection = devices
        self._max_allocation = max_allocation
        self._programs = ProgramCache(self.cache_dir / "opencl")
        self._queues = Queues()
        self._lock = threading.Lock()
        self._found: tuple[list[OpenCLDevice], Availability] | None = None

    # -- availability --------------------------------------------------------------------------
    def _discovered(self) -> tuple[list[OpenCLDevice], Availability]:
        if self._found is None:
            with self._lock:
                if self._found is None:
                    self._found = discover(self.selection, self.alignment, self.cache_dir)
        return self._found

    def availability(self) -> Availability:
        return self._discovered()[1]

    def opencl_device(self, index: int) -> OpenCLDevice:
        """The driver objects of ``opencl:index``; ``DeviceUnavailableError`` saying why if none."""
        devices, avail = self._discovered()
        if not 0 <= index < len(devices):
            why = avail.reason if not devices else f"there are {len(devices)} opencl device(s)"
            raise DeviceUnavailableError(f"opencl:{index} is not usable: {why}")
        return devices[index]

    # -- allocator -----------------------------------------------------------------------------
    def _allocate(self, nbytes: int, device_index: int, stream: Any) -> Storage:
        dev = self.opencl_device(device_index)
        return memory.allocate(dev, self.device(device_index), nbytes, self.alignment,
                               self.max_allocation(device_index), stream)

    def max_allocation(self, device_index: int = 0) -> int:
        limit = self.opencl_device(device_index).max_alloc
        return min(limit, self._max_allocation) if self._max_allocation else limit

    def _queue(self, ptr: Any, stream: Any) -> Queue:
        if stream is not None:
            return stream
        context = getattr(getattr(ptr, "buffer", None), "context", None)
        index = next((d.index for d in self._discovered()[0] if d.context == context), 0)
        return self.current_stream(index)

    def copy_from_host(self, dst: Any, src_host: int, nbytes: int, stream: Any = None) -> None:
        memory.write(self._queue(dst, stream), dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: Any, nbytes: int, stream: Any = None) -> None:
        memory.read(self._queue(src, stream), dst_host, src, nbytes)

    def copy_device(self, dst: Any, src: Any, nbytes: int, stream: Any = None) -> None:
        memory.copy(self._queue(dst, stream), dst, src, nbytes)

    def memset(self, dst: Any, value: int, nbytes: int, stream: Any = None) -> None:
        memory.fill(self._queue(dst, stream), dst, value, nbytes)

    def export_pointer(self, ptr: Any) -> tuple[int, int]:
        return memory.export_handle(ptr)

    def import_pointer(self, data: int, byte_offset: int, device_index: int = 0, owner: object = None) -> Any:
        return memory.import_handle(self.opencl_device(device_index), data, byte_offset)

    # -- streams and events --------------------------------------------------------------------
    def current_stream(self, device_index: int = 0) -> Queue:
        """The calling thread's in-order queue on ``opencl:device_index`` (the same one every time)."""
        return self._queues.current(self.opencl_device(device_index))

    def synchronize(self, device_index: int = 0, stream: Any = None) -> None:
        queues = [stream] if stream is not None else self._queues.live(device_index)
        for queue in queues:
            queue.finish()

    def create_event(self, device_index: int = 0) -> OpenCLEvent:
        return OpenCLEvent(device_index, functools.partial(self._stream_or_current, device_index))

    def _stream_or_current(self, device_index: int, stream: Any) -> Queue:
        return stream if stream is not None else self.current_stream(device_index)

    # -- programs ------------------------------------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        return unloadable(binary_format, target)

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> OpenCLKernel:
        if spec.launch is None:
            raise KernelError(f"{spec.describe()}: has no launch configuration; opencl kernels need one "
                              f"(grid and block: global size = grid * block, local size = block)")
        dev = self.opencl_device(device_index)
        source, flags = split_payload(binary.data)
        try:
            program = self._programs.program(dev, source, flags)
        except KernelError as exc:
            raise BinaryRefused(str(exc)) from exc
        names = kernel_names(program)
        if spec.entry not in names:
            raise BinaryRefused(f"the program has no kernel {spec.entry!r} (kernels: {', '.join(names)})")
        expected = spec.num_inputs + spec.num_outputs + len(spec.symbols) + int(spec.has_workspace)
        got = argument_count(program, spec.entry)
        if got != expected:
            raise BinaryRefused(f"kernel {spec.entry!r} takes {got} arguments, the opencl ABI passes {expected} "
                                f"({spec.num_inputs} inputs + {spec.num_outputs} outputs + {len(spec.symbols)} "
                                f"symbols{' + workspace' if spec.has_workspace else ''})")
        return OpenCLKernel(spec, binary, program, dev, functools.partial(self._stream_or_current, device_index))

    def compile(self, source: str, language: str = LANGUAGE,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """OpenCL C source to one ``opencl-source`` payload, checked by building it on ``opencl:0``
        when a device exists (so errors show at build time, with the build log).

        ``options``: ``build_options`` (string or list, e.g. ``["-cl-fast-relaxed-math"]``, stored in
        the payload), ``name`` (names the payload ``<name>.cl``).
        """
        if language != LANGUAGE:
            raise Unsupported(f"the opencl backend compiles {LANGUAGE!r} (OpenCL C) sources, not {language!r}")
        payload, flags = source_payload(source, options)
        if self.availability().available:
            self._programs.program(self.opencl_device(0), source, flags)
        return (payload,)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        from engine_opencl.reference import reference_kernels

        return reference_kernels()
