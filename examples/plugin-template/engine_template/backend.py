"""``TemplateBackend``: the allocator, compiler and program roles behind one object.

The core calls these methods; it never goes through pluggy after discovery. Everything here is
synchronous: ``current_stream`` is ``None`` and ``synchronize`` is the inherited no-op. A GPU-like
device returns its stream handle, enqueues copies and launches on it, and waits in ``synchronize``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Mapping

from engine.backend import Availability, BackendBase, BinaryPayload, CandidateSpec
from engine.errors import DeviceUnavailableError, Unsupported
from engine.storage import Storage

from engine_template import memory
from engine_template.kernel import TemplateKernel
from engine_template.program import FORMATS, Programs, host_target

__all__ = ["TemplateBackend"]


class TemplateBackend(BackendBase):
    kind: ClassVar[str] = "template"
    workspace_slot: ClassVar[int] = 7           # third parties: >= 3 and unique in the process
    api_version: ClassVar[tuple[int, int]] = (1, 0)  # the plugin API this code was written for
    dlpack_device_type: ClassVar[int] = 12      # kDLExtDev; a real device uses its DLPack code
    formats: ClassVar[tuple[str, ...]] = FORMATS
    languages: ClassVar[tuple[str, ...]] = ("c",)
    alignment: ClassVar[int] = 64
    host_accessible: ClassVar[bool] = False     # the core copies through us, as for device memory

    def __init__(self, cache_dir: Path, cc: str = "cc"):
        # Cheap on purpose: nothing is compiled, opened or probed until it is needed.
        self.programs = Programs(cache_dir, cc)

    def availability(self) -> Availability:
        return Availability(True, 1, ("host memory (engine-plugin-template)",))

    def _check(self, device_index: int) -> None:
        if device_index != 0:
            raise DeviceUnavailableError(f"template:{device_index} does not exist (one device, template:0)")

    # -- allocator -----------------------------------------------------------------------------
    def _allocate(self, nbytes: int, device_index: int) -> Storage:
        self._check(device_index)
        return memory.allocate(self.device(device_index), nbytes, self.alignment)

    def copy_from_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        memory.copy(dst_addr, src_addr, nbytes)

    def copy_to_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        memory.copy(dst_addr, src_addr, nbytes)

    def copy_device(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        memory.copy(dst_addr, src_addr, nbytes)

    def memset(self, addr: int, value: int, nbytes: int, stream: object = None) -> None:
        memory.memset(addr, value, nbytes)

    # -- programs and compiler -----------------------------------------------------------------
    def load_kernel(self, spec: CandidateSpec, device_index: int = 0) -> TemplateKernel:
        self._check(device_index)
        return self.programs.load_kernel(spec)

    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        return self.programs.unloadable(binary_format, target)

    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """C source to one ``elf-so`` for this machine (the builder ships the source beside it)."""
        if language not in self.languages:
            raise Unsupported(f"the template backend compiles {list(self.languages)} sources, not {language!r}")
        if options:
            raise ValueError(f"the template backend takes no compile options, got {sorted(options)}")
        return (BinaryPayload("elf-so", host_target(), "kernel.so", self.programs.compile_c(source)),)
