"""``CpuBackend``: ties the CPU's allocator, compiler and program loader together.

Construction is cheap and touches nothing but the environment (the plugin hook builds one at
discovery): the compiler is only run, and the cache directory only created, when a kernel is
compiled or loaded. Configuration is read once here, never deep in the code:

* ``cache_dir``: defaults to ``Settings.from_env().cache_dir`` (``ENGINE_CACHE_DIR``);
* ``num_threads``: defaults to ``ENGINE_CPU_NUM_THREADS``; ``None`` leaves OpenMP's default;
* ``cc``: defaults to ``$CC``, else ``cc``;
* ``libraries``: the ``engine_cpu.libraries.LibraryRegistry`` of libraries kernels may link
  (default: the built-in providers plus the ``engine_cpu.libraries`` entry points);
* ``from_memory``: open shared objects from memory (default) or through the file store.

Everything is synchronous on the CPU: streams are ``None`` (a stream passed in is ignored),
``synchronize`` is a no-op, device pointers are host addresses (``int``), and the inherited
``create_event`` (``HostEvent``) and ``time()`` are exact. Binary selection is the core's
(``BackendBase.load_kernel``); this backend says what it can load (``loadable``) and loads one
binary (``_load_binary``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Callable, ClassVar, Mapping, Sequence

from engine.backend import (Availability, BackendBase, BinaryPayload, CandidateSpec, PreparedLaunch,
                            ReferenceKernel, Stream)
from engine.device import Device
from engine.errors import DeviceUnavailableError, KernelError, Unsupported
from engine.settings import Settings
from engine.storage import Storage

from engine_cpu import allocator
from engine_cpu.compiler import CCompiler
from engine_cpu.fused import RUNNER_ENTRY, RUNNER_SOURCE, CpuFusedLaunch, bind_runner
from engine_cpu.host import cpu_description, host_target
from engine_cpu.kernel import CpuKernel, CpuPreparedLaunch
from engine_cpu.libraries import LibraryRegistry
from engine_cpu.program import FORMATS, ProgramLoader

__all__ = ["CpuBackend", "NUM_THREADS_ENV"]

NUM_THREADS_ENV = "ENGINE_CPU_NUM_THREADS"


def _threads_from_env() -> int | None:
    raw = os.environ.get(NUM_THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{NUM_THREADS_ENV}={raw!r}: expected a positive integer number of threads")
    return value


class CpuBackend(BackendBase):
    """The host CPU as an engine device: one device, ``cpu:0``."""

    kind: ClassVar[str] = "cpu"
    workspace_slot: ClassVar[int] = 0
    api_version: ClassVar[tuple[int, int]] = (2, 0)
    dlpack_device_type: ClassVar[int] = 1  # kDLCPU
    formats: ClassVar[tuple[str, ...]] = FORMATS
    languages: ClassVar[tuple[str, ...]] = ("c",)
    alignment: ClassVar[int] = 64
    host_accessible: ClassVar[bool] = True
    rebuild_hint: ClassVar[str] = "rebuild the bundle or ship a c-source binary"

    def __init__(self, cache_dir: Path | None = None, num_threads: int | None = None, *,
                 cc: str | None = None, libraries: LibraryRegistry | None = None, from_memory: bool = True):
        if num_threads is None:
            num_threads = _threads_from_env()
        elif not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Settings.from_env().cache_dir
        self.num_threads = num_threads
        self.compiler = CCompiler(self.cache_dir, cc if cc is not None else os.environ.get("CC"), libraries)
        self.loader = ProgramLoader(self.cache_dir, self.compiler, num_threads, from_memory=from_memory)
        self._allocator = allocator.HostAllocator(Device("cpu", 0), self.alignment)
        self._description: str | None = None
        self._runner: ctypes._CFuncPtr | None = None
        self._runner_lock = threading.Lock()
        #: Why ``fuse`` returns None on this machine (no compiler for the runner), else None.
        self.fusion_unavailable: str | None = None

    # -- availability --------------------------------------------------------------------------
    def availability(self) -> Availability:
        if self._description is None:
            self._description = cpu_description()
        return Availability(True, 1, (self._description,))

    def host_target(self) -> str:
        """The target string this machine's ``elf-so`` binaries carry, e.g. ``"x86_64-linux"``."""
        return host_target()

    def _check_index(self, device_index: int) -> None:
        if device_index != 0:
            raise DeviceUnavailableError(f"cpu:{device_index}: the cpu backend has one device, cpu:0")

    # -- allocator -----------------------------------------------------------------------------
    def _allocate(self, nbytes: int, device_index: int, stream: Stream) -> Storage:
        self._check_index(device_index)
        return self._allocator.allocate(nbytes)

    def prepare_allocation(self, nbytes: int, device_index: int = 0,
                           stream: Stream = None) -> Callable[[], Storage]:
        """A factory that allocates straight from numpy, without ``allocate``'s checks per call (it
        raises ``OutOfMemoryError`` itself, as ``allocate`` would)."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"allocation size must be a non-negative int, got {nbytes!r}")
        self._check_index(device_index)
        return self._allocator.factory(nbytes)

    def copy_from_host(self, dst: int, src_host: int, nbytes: int, stream: Stream = None) -> None:
        allocator.copy(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int, stream: Stream = None) -> None:
        allocator.copy(dst_host, src, nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, stream: Stream = None) -> None:
        allocator.copy(dst, src, nbytes)

    def memset(self, dst: int, value: int, nbytes: int, stream: Stream = None) -> None:
        allocator.memset(dst, value, nbytes)

    # -- programs ------------------------------------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        if device_index != 0:
            return f"the cpu backend has one device, cpu:0 (asked for cpu:{device_index})"
        return self.loader.loadable(binary_format, target)

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> CpuKernel:
        self._check_index(device_index)
        return self.loader.load(spec, binary)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        """The reference kernels in C for this ABI (``engine.testing.c_abi``)."""
        from engine.testing.c_abi import c_reference_kernels

        return c_reference_kernels()

    # -- compiler ------------------------------------------------------------------------------
    def compile(self, source: str, language: str = "c",
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """C source to one ``elf-so`` payload for this machine (cached under ``cache_dir``).

        ``options``: ``openmp`` (bool, default False), ``flags`` (extra compiler flags, e.g.
        ``["-march=native"]`` for a bundle that never leaves this machine), ``entry``/``name``
        (names the payload ``<entry>.so``), ``link`` (names of libraries shipped in wheels, each
        also named by a ``// engine-cpu: link NAME`` line of the source; ``engine_cpu.libraries``).
        """
        if language not in self.languages:
            raise Unsupported(f"the cpu backend compiles {list(self.languages)} sources, not {language!r}")
        return (self.compiler.compile(source, options),)

    # -- fusion --------------------------------------------------------------------------------
    def fuse(self, launches: Sequence[PreparedLaunch]) -> CpuFusedLaunch | None:
        """One native call running ``launches`` in order; None if any is not a CPU launch."""
        if not all(isinstance(p, CpuPreparedLaunch) for p in launches):
            return None
        runner = self._fusion_runner()
        if runner is None:
            return None
        return CpuFusedLaunch(runner, launches)  # type: ignore[arg-type]

    def _fusion_runner(self) -> ctypes._CFuncPtr | None:
        with self._runner_lock:
            if self._runner is None and self.fusion_unavailable is None:
                try:
                    _, data = self.compiler.build(RUNNER_SOURCE, self.compiler.flags_for(None))
                    library = self.loader.load_library(data, "cpu fusion runner")
                    self._runner = bind_runner(library.handle[RUNNER_ENTRY])
                except KernelError as exc:
                    # Fusion is an optimisation: the core runs the launches one by one instead.
                    self.fusion_unavailable = f"cannot build the fusion runner: {exc}"
            return self._runner
