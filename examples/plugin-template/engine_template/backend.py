"""``TemplateBackend``: the allocator, compiler and program roles behind one object.

The core calls these methods; it never goes through pluggy after discovery. ``BackendBase`` (from
the engine) holds the policy every plugin shares: ``allocate`` checks the size and names the
device in allocation failures, then calls ``_allocate``; ``load_kernel`` picks the first binary
``loadable`` accepts and calls ``_load_binary``; ``time`` times with ``create_event``.

Everything here is synchronous: ``current_stream`` is ``None``, the stream every copy and launch
receives is ignored, ``synchronize(device_index, stream)`` is the inherited no-op and the inherited
events (``HostEvent``) are exact. A GPU-like device returns its stream handle from
``current_stream``, queues copies and launches on the stream it is given, waits for it in
``synchronize`` and returns driver events from ``create_event``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Mapping

from engine.backend import Availability, BackendBase, BinaryPayload, CandidateSpec, ReferenceKernel, Stream
from engine.errors import DeviceUnavailableError, Unsupported
from engine.storage import Storage

from engine_template import memory
from engine_template.kernel import TemplateKernel
from engine_template.program import FORMATS, Programs, host_target

__all__ = ["TemplateBackend"]


class TemplateBackend(BackendBase):
    kind: ClassVar[str] = "template"
    workspace_slot: ClassVar[int] = 7           # third parties: >= 3, not reserved (3: opencl), unique
    api_version: ClassVar[tuple[int, int]] = (2, 0)  # the plugin API this code was written for
    dlpack_device_type: ClassVar[int] = 12      # kDLExtDev; a real device uses its DLPack code
    formats: ClassVar[tuple[str, ...]] = FORMATS
    languages: ClassVar[tuple[str, ...]] = ("c",)
    alignment: ClassVar[int] = 64
    host_accessible: ClassVar[bool] = False     # the core copies through us, as for device memory
    rebuild_hint: ClassVar[str] = f"rebuild the bundle for {host_target()} or ship a c-source binary"

    def __init__(self, cache_dir: Path, cc: str = "cc"):
        # Cheap on purpose: nothing is compiled, opened or probed until it is needed.
        self.programs = Programs(cache_dir, cc)

    def availability(self) -> Availability:
        return Availability(True, 1, ("host memory (engine-plugin-template)",))

    def _check(self, device_index: int) -> None:
        if device_index != 0:
            raise DeviceUnavailableError(f"template:{device_index} does not exist (one device, template:0)")

    # -- allocator: pointers are this backend's own (here host addresses, ``int``) ---------------
    def _allocate(self, nbytes: int, device_index: int, stream: Stream) -> Storage:
        self._check(device_index)
        return memory.allocate(self.device(device_index), nbytes, self.alignment, stream)

    def copy_from_host(self, dst: int, src_host: int, nbytes: int, stream: Stream = None) -> None:
        memory.copy(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int, stream: Stream = None) -> None:
        memory.copy(dst_host, src, nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, stream: Stream = None) -> None:
        memory.copy(dst, src, nbytes)

    def memset(self, dst: int, value: int, nbytes: int, stream: Stream = None) -> None:
        memory.memset(dst, value, nbytes)

    # -- programs and compiler -----------------------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        if device_index != 0:
            return f"template:{device_index} does not exist (one device, template:0)"
        return self.programs.unloadable(binary_format, target)

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> TemplateKernel:
        self._check(device_index)
        return self.programs.load(spec, binary)

    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """C source to one ``elf-so`` for this machine (the builder ships the source beside it)."""
        if language not in self.languages:
            raise Unsupported(f"the template backend compiles {list(self.languages)} sources, not {language!r}")
        if options:
            raise ValueError(f"the template backend takes no compile options, got {sorted(options)}")
        return (BinaryPayload("elf-so", host_target(), "kernel.so", self.programs.compile_c(source)),)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        """The engine's reference kernels in this device's language (run by the conformance suite).

        This device runs the CPU kernel ABI, so the core's C versions serve; a device with its own
        language writes its own (see ``plugins/opencl/engine_opencl/reference.py``). The template
        links ``-lm`` into every kernel and takes no compile options."""
        from engine.testing.c_abi import c_reference_kernels

        return c_reference_kernels(link_math=False)
