"""The program role: one binary of a kernel candidate to a loaded ``CpuKernel``.

Binary selection is the core's (``BackendBase.load_kernel``): it asks ``ProgramLoader.loadable``
about each binary in the bundle's order (an ``elf-so`` for this machine's target, or a
``c-source`` when a compiler exists) and hands the first one that fits to ``load``, which opens
the shared object or compiles the source first.

Shared objects are opened from memory (``engine.backend.native``: the bytes that were hashed go
into a sealed anonymous file which is ``dlopen``ed), so loading writes nothing to the cache
directory, works when it is read-only, and runs exactly the bytes that were checked. Only where a
platform cannot load from memory are they published in an ``engine.backend.cachefiles.ContentStore``
at ``<cache_dir>/cpu/so/<sha256>.so`` (an existing file is re-hashed before it is trusted) and opened
by path. Either way they are opened with ``RTLD_LOCAL`` so two kernels' symbols never collide. Opened
libraries are cached per loader by content hash, so a thousand kernels cut from one ``.so`` open it
once. Libraries are never closed: ``dlclose`` under a live function pointer would be a crash, and
each ``CpuKernel`` holds its ``Library`` strongly.

A kernel that links a library shipped in a wheel (``engine_cpu.libraries``) names it only by
soname in its ``DT_NEEDED``. Before opening such a kernel the loader reads its dynamic section,
and for each soname a library provider serves it opens the provider's file by its absolute path
(once per process and loader); the dynamic loader then resolves the kernel's dependency by the
soname of that already-loaded library, from memory or from the file store alike. When the
provider cannot find its library (the wheel is not installed) the candidate fails with a
``LibraryUnavailableError`` (an ``engine.backend.CandidateUnavailable``) naming the candidate, the
library and how to install it; the core then runs the kernel's other candidates. A soname no
provider serves is left to the system's search, as for any shared object.

OpenMP's thread count (``num_threads``) is set with ``omp_set_num_threads`` when a library that
resolves it is loaded. Note that in libgomp (and the OpenMP spec: ``nthreads-var`` has data
environment scope) the setting is per calling thread, not process-wide: it is applied in the
loading thread, and again lazily in every thread that calls ``CpuKernel.launch`` or ``prepare``.
A prepared launch called from a thread that never launched or prepared anything runs with
OpenMP's default (``OMP_NUM_THREADS`` or all cores).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

from engine.backend import BinaryPayload, CandidateSpec
from engine.backend.cachefiles import ContentStore, sha256_hex
from engine.backend.native import open_from_memory
from engine.errors import KernelError
from engine.log import get_logger

from engine_cpu.compiler import CCompiler, CompilerError, uses_openmp
from engine_cpu.elf import read_dynamic
from engine_cpu.host import check_elf_header, host_target
from engine_cpu.kernel import CpuKernel
from engine_cpu.libraries import LinkedLibrary
from engine_cpu.opened import Library

__all__ = ["Library", "ProgramLoader", "OpenMPThreads", "FORMATS"]

FORMATS = ("elf-so", "c-source")

log = get_logger("engine.cpu.program")


class OpenMPThreads:
    """Applies one OpenMP thread count once per (thread, OpenMP runtime)."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self._local = threading.local()

    def apply(self, setter: ctypes._CFuncPtr) -> None:
        done = getattr(self._local, "done", None)
        if done is None:
            done = self._local.done = set()
        key = ctypes.cast(setter, ctypes.c_void_p).value  # one entry per libgomp in the process
        if key not in done:
            setter(self.num_threads)
            done.add(key)


class ProgramLoader:
    """Loads candidates for one backend; owns the opened-library cache.

    ``from_memory=False`` always goes through the content store (the fallback of platforms that
    cannot load from memory).
    """

    def __init__(self, cache_dir: Path, compiler: CCompiler, num_threads: int | None = None, *,
                 from_memory: bool = True):
        self.from_memory = from_memory
        self.so_dir = Path(cache_dir) / "cpu" / "so"
        self.store = ContentStore(self.so_dir, ".so", cache_root=Path(cache_dir))
        self.compiler = compiler
        self.threads = OpenMPThreads(num_threads) if num_threads else None
        self._libraries: dict[str, Library] = {}
        self._linked: dict[Path, ctypes.CDLL] = {}  # wheel libraries opened for kernels, by path
        self._lock = threading.Lock()

    # -- what can be loaded --------------------------------------------------------------------
    def loadable(self, binary_format: str, target: str) -> str | None:
        """``None`` when a binary of this format and target can be used here, else the reason."""
        if binary_format == "elf-so":
            here = host_target()
            return None if target == here else f"this machine is {here}"
        if binary_format == "c-source":
            return self.compiler.available()
        return f"format {binary_format!r} is not one of cpu's formats {list(FORMATS)}"

    # -- loading -------------------------------------------------------------------------------
    def load(self, spec: CandidateSpec, binary: BinaryPayload) -> CpuKernel:
        """``spec``'s entry from ``binary`` (one ``loadable`` accepted); ``KernelError`` naming both
        when the object is corrupt, does not load, or lacks the entry."""
        return self._bind(spec, binary, self._library_for(spec, binary))

    def _library_for(self, spec: CandidateSpec, binary: BinaryPayload) -> Library:
        where = f"{spec.describe()}: {binary.describe()}"
        if binary.format == "elf-so":
            return self.load_library(binary.data, where)
        try:
            source = bytes(binary.data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KernelError(f"{where}: C source is not valid UTF-8: {exc}") from exc
        # Bundle sources carry no options: OpenMP is enabled when the source uses it, since
        # without -fopenmp its pragmas are silently ignored and omp_* calls fail to resolve.
        flags = self.compiler.flags_for({"openmp": uses_openmp(source)})
        # Libraries come from the source's "// engine-cpu: link" lines, as OpenMP from its pragmas
        # (a LibraryUnavailableError names ``where`` itself).
        libraries = self.compiler.libraries_for(source, None, where)
        try:
            _, data = self.compiler.build(source, flags, libraries)
        except CompilerError as exc:
            raise CompilerError(f"{where}: {exc}", log=exc.log, command=exc.command) from exc
        except KernelError as exc:
            raise KernelError(f"{where}: {exc}") from exc
        return self.load_library(data, f"{where} compiled")

    def load_library(self, data: bytes | memoryview, where: str) -> Library:
        """Open ``data`` as a shared object (once per content hash), from memory where possible."""
        data = bytes(data)  # one immutable copy: what is hashed is what is loaded
        sha = sha256_hex(data)
        with self._lock:
            library = self._libraries.get(sha)
            if library is not None:
                return library
            check_elf_header(data, where)
            needed = read_dynamic(data, where).needed
            self._open_dependencies(needed, where, discover=False)
            try:
                library = self._open(data, sha, where)
            except KernelError:
                # A soname the system cannot find may be served by a provider another distribution
                # declares: its entry points are read only now (a scan of every installed
                # distribution, too slow for every first load), and the open retried once.
                if not self._open_dependencies(needed, where, discover=True):
                    raise
                library = self._open(data, sha, where)
            if self.threads is not None and library.omp_set_num_threads is not None:
                self.threads.apply(library.omp_set_num_threads)
            self._libraries[sha] = library
            return library

    def _open(self, data: bytes, sha: str, where: str) -> Library:
        try:
            loaded = open_from_memory(data, f"engine-{sha[:16]}.so") if self.from_memory else None
        except OSError as exc:
            raise KernelError(f"{where}: cannot load the shared object: {exc}") from exc
        if loaded is None:
            return self._load_from_file(data, sha, where)
        log.debug("loaded %s from memory (%s)", where, sha[:16])
        return Library(sha, Path(loaded.path), loaded.handle, loaded.fd)

    def _open_dependencies(self, needed: tuple[str, ...], where: str, *, discover: bool) -> int:
        """Open the wheel libraries a kernel needs (its ``DT_NEEDED`` sonames that a provider
        serves) before the kernel itself; how many were newly opened. ``discover``: also ask the
        providers of the ``engine_cpu.libraries`` entry points."""
        registry = self.compiler.libraries
        opened = 0
        for soname in needed:
            provider = registry.provider_for_soname(soname, discover=discover)
            if provider is not None:
                opened += self._open_linked(registry.locate(provider.name, where), where)
        return opened

    def _open_linked(self, library: LinkedLibrary, where: str) -> int:
        if library.path in self._linked:
            return 0
        try:
            # RTLD_LOCAL: the library's symbols do not join the global scope (no clash with another
            # copy of BLAS in the process); kernels still bind to it, as a loaded DT_NEEDED soname.
            self._linked[library.path] = ctypes.CDLL(str(library.path), mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise KernelError(f"{where}: cannot open the library {library.name!r} at {library.path}: {exc}") from exc
        log.debug("opened %s %s (%s) for %s", library.name, library.version, library.path, where)
        return 1

    def _load_from_file(self, data: bytes, sha: str, where: str) -> Library:
        """Where memory loading is unavailable: publish in the content store and open that path.

        The path is opened right after it was (re)verified; if another process evicted it in
        between, it is published and opened once more.
        """
        for attempt in (1, 2):
            try:
                path = self.store.publish(data, sha)  # missing, truncated or tampered: (re)written
            except OSError as exc:
                raise KernelError(f"{where}: cannot write {self.store.path_for(sha)}: {exc}; "
                                  "free space there or set ENGINE_CACHE_DIR to a writable directory") from exc
            try:
                handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            except OSError as exc:
                if attempt == 1 and not path.exists():  # evicted between publish and dlopen
                    continue
                raise KernelError(f"{where}: cannot load the shared object: {exc}") from exc
            return Library(sha, path, handle)
        raise AssertionError("unreachable")  # pragma: no cover


    def _bind(self, spec: CandidateSpec, binary: BinaryPayload, library: Library) -> CpuKernel:
        try:
            function = library.handle[spec.entry]
        except AttributeError as exc:
            raise KernelError(
                f"{spec.describe()}: {binary.describe()} does not export "
                f"the entry symbol {spec.entry!r}; check the candidate's 'entry' (C++ sources need "
                "extern \"C\")") from exc
        apply_threads = None
        if self.threads is not None and library.omp_set_num_threads is not None:
            apply_threads = functools.partial(self.threads.apply, library.omp_set_num_threads)
        return CpuKernel(spec, binary, library, function, apply_threads)

    def loaded_libraries(self) -> int:
        """How many distinct shared objects this loader has opened."""
        with self._lock:
            return len(self._libraries)
