"""The compiler role: C source to shared-object bytes, with a content-addressed disk cache.

Flags are deliberately portable: ``-O3`` but never ``-march=native`` unless the caller passes it,
because bundles built here are loaded on other machines of the same target. ``-lm`` is linked by
default since numeric kernels routinely call ``expf`` and friends.

Libraries shipped in wheels (``engine_cpu.libraries``) are linked by name: option ``link`` and the
source's ``// engine-cpu: link NAME`` lines (the only way a bundle's ``c-source``, compiled at load
without options, can say it). Each is linked by its absolute path on this machine and with no
``rpath``/``runpath``, so the kernel's ``DT_NEEDED`` is the bare soname and the loader supplies the
library at load; the cache key holds the library's identity (soname, version), never its path.

Cache: an ``engine.backend.cachefiles.BuildCache`` at ``<cache_dir>/cpu/build`` (``<key>.so`` plus
``<key>.so.sha256``), where ``key`` is the sha256 of the source, the compiler's path and version
line, the flags and the linked libraries' identities. The source is always compiled under a
fixed file name in a private temp dir (``TMPDIR``), never in the cache, so that identical inputs give identical bytes (the ELF records
the source file name), which keeps concurrent builders' results interchangeable, and so that a
read-only cache directory still compiles (the result is then kept in memory only). A source's
separately compiled units (``engine_cpu.units``) are objects at ``<cache_dir>/cpu/units``
(``<key>.o``), keyed the same way by the unit's translation unit, and linked into each kernel.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from engine.backend import BinaryPayload
from engine.backend.cachefiles import BuildCache, sha256_hex
from engine.errors import InputError, KernelError

from engine_cpu.host import host_target
from engine_cpu.libraries import LibraryRegistry, LinkedLibrary, link_directives
from engine_cpu.units import split_units

__all__ = ["CCompiler", "CompilerError", "LinkDirectiveError", "BASE_FLAGS", "OPTIONS", "uses_openmp"]

BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
#: The ``options`` keys ``compile`` understands; anything else is refused so a typo is not ignored.
OPTIONS = ("openmp", "flags", "entry", "name", "link")

_SOURCE_NAME = "kernel.c"
_OUTPUT_NAME = "kernel.so"
_UNIT_SOURCE_NAME = "unit.c"
_UNIT_OUTPUT_NAME = "unit.o"
_TIMEOUT_S = 600
_OMP_PATTERN = re.compile(r"^\s*#\s*(pragma\s+omp\b|include\s*[<\"]omp\.h[>\"])", re.MULTILINE)


class CompilerError(KernelError):
    """The C compiler rejected a source; ``log`` holds its output, ``command`` the command line."""

    def __init__(self, message: str, *, log: str = "", command: Sequence[str] = ()):
        super().__init__(message)
        self.log = log
        self.command = tuple(command)


class LinkDirectiveError(KernelError, ValueError):
    """Option ``link`` names a library the source's ``// engine-cpu: link`` lines do not (the
    bundle's ``c-source``, compiled at load without options, would then not link it)."""

    def __init__(self, library: str, directives: Sequence[str]):
        super().__init__(f"cpu compile option 'link' names {library!r} but the source has no "
                         f"'// engine-cpu: link {library}' line (its lines name {list(directives)}); add the "
                         "line so the bundle's c-source fallback links the library too")
        self.library = library
        self.directives = tuple(directives)


def _first_error(log: str) -> str:
    """The compiler's first error lines (or its first line): a one-line summary for the message."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join((errors or lines or ["no output"])[:3])[:600]


def uses_openmp(source: str) -> bool:
    """Whether a C source uses OpenMP (so a bundle's c-source is built with ``-fopenmp``)."""
    return _OMP_PATTERN.search(source) is not None


class CCompiler:
    """Runs the system C compiler (``$CC`` read once, else ``cc``) and caches what it builds.

    ``invocations`` counts real compiler runs in this object (cache hits do not count).
    """

    def __init__(self, cache_dir: Path, cc: str | None = None, libraries: LibraryRegistry | None = None):
        self.libraries = libraries if libraries is not None else LibraryRegistry()
        self.command = tuple(shlex.split(cc)) if cc and cc.strip() else ("cc",)
        self.build_dir = Path(cache_dir) / "cpu" / "build"
        self.invocations = 0
        self._identity: str | None = None  # resolved on first compile (runs `cc --version`)
        self._lock = threading.Lock()
        # Memoizes verified bytes per key, so repeat loads skip the disk.
        self.cache = BuildCache(self.build_dir, ".so", cache_root=Path(cache_dir))
        # Objects of the sources' separately compiled units (engine_cpu.units), by the same kind of key.
        self.units = BuildCache(Path(cache_dir) / "cpu" / "units", ".o", cache_root=Path(cache_dir))

    # -- identity ------------------------------------------------------------------------------
    def available(self) -> str | None:
        """``None`` if the compiler can be found, else why not."""
        if shutil.which(self.command[0]) is None:
            return (f"no C compiler {self.command[0]!r} on PATH; install gcc or clang, "
                    "or set CC to a compiler")
        return None

    def identity(self) -> str:
        """The compiler's resolved path and ``--version`` first line (part of every cache key)."""
        with self._lock:
            if self._identity is None:
                problem = self.available()
                if problem is not None:
                    raise KernelError(problem)
                path = shutil.which(self.command[0])
                try:
                    out = subprocess.run([*self.command, "--version"], capture_output=True, text=True,
                                         timeout=60, check=False)
                    lines = (out.stdout or out.stderr).splitlines()
                except (OSError, subprocess.SubprocessError) as exc:
                    raise KernelError(f"cannot run {self.command[0]!r} --version: {exc}") from exc
                version = lines[0] if lines else ""
                self._identity = "\n".join((str(path), *self.command[1:], version))
            return self._identity

    # -- compiling -----------------------------------------------------------------------------
    def flags_for(self, options: Mapping[str, object] | None) -> tuple[str, ...]:
        """The full flag list for ``options`` (validated)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown cpu compile option(s) {unknown}; known: {list(OPTIONS)}")
        extra = options.get("flags") or ()
        if isinstance(extra, str) or not all(isinstance(f, str) for f in extra):  # type: ignore[union-attr]
            raise ValueError(f"option 'flags' must be a sequence of strings, got {extra!r}")
        omp = ("-fopenmp",) if options.get("openmp") else ()
        return (*BASE_FLAGS, *omp, *extra)  # type: ignore[misc]

    def libraries_for(self, source: str, options: Mapping[str, object] | None = None,
                      where: str = "cpu compile") -> tuple[LinkedLibrary, ...]:
        """The libraries ``source`` links here: its ``// engine-cpu: link`` lines (which must
        include every name of option ``link``), each located by its provider."""
        directives = link_directives(source)
        raw = (options or {}).get("link") or ()
        if not isinstance(raw, (list, tuple)) or not all(isinstance(n, str) for n in raw):
            raise InputError(f"cpu compile option 'link' must be a list of library names, got {raw!r}")
        names: tuple[str, ...] = tuple(raw)
        for name in names:
            self.libraries.provider(name)  # an unknown name: UnknownLibraryError listing the known ones
            if name not in directives:
                raise LinkDirectiveError(name, directives)
        return tuple(self.libraries.locate(name, where) for name in directives)

    def compile(self, source: str, options: Mapping[str, object] | None = None) -> BinaryPayload:
        """Build ``source`` into an ``elf-so`` payload for this machine's target."""
        _, data = self.build(source, self.flags_for(options), self.libraries_for(source, options))
        name = (options or {}).get("entry") or (options or {}).get("name") or sha256_hex(data)[:16]
        return BinaryPayload(format="elf-so", target=host_target(), path=f"{name}.so", data=data)

    def cache_key(self, source: str, flags: Sequence[str], libraries: Sequence[LinkedLibrary] = ()) -> str:
        h = hashlib.sha256()
        for part in (source, self.identity(), "\0".join(flags), "\0".join(lib.identity for lib in libraries)):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous concatenation
            h.update(data)
        return h.hexdigest()

    def build(self, source: str, flags: Sequence[str],
              libraries: Sequence[LinkedLibrary] = ()) -> tuple[str, bytes]:
        """``(cache key, shared-object bytes)`` for ``source``, compiling only on a cache miss."""
        key = self.cache_key(source, flags, libraries)
        return key, self._cached(self.cache, key, lambda: self._run(source, flags, libraries))

    def _run(self, source: str, flags: Sequence[str], libraries: Sequence[LinkedLibrary] = ()) -> bytes:
        """Compile in a private temp dir under fixed names (reproducible bytes); the source's units
        (``engine_cpu.units``) come from their own cache and are linked in as objects."""
        split = split_units(source)
        objects = [self._unit_object(unit, flags, libraries) for unit in split.units]
        # Flags go after the source: gcc/clang options are position-independent except -l,
        # which --as-needed linkers only honour after the objects that need it. A linked
        # library is named by its file (DT_NEEDED gets its soname) and no -rpath is given.
        names = [f"unit{i}.o" for i in range(len(objects))]
        cmd = [*self.command, *self._includes(libraries), _SOURCE_NAME, *names, "-o", _OUTPUT_NAME, *flags,
               *(str(lib.path) for lib in libraries), "-lm"]
        inputs = {_SOURCE_NAME: split.own.encode("utf-8"), **dict(zip(names, objects))}
        return self._invoke(cmd, inputs, _OUTPUT_NAME, "C compilation")

    def _unit_object(self, unit: str, flags: Sequence[str], libraries: Sequence[LinkedLibrary]) -> bytes:
        """The object file of one unit's translation unit, compiled only on a cache miss."""
        key = self.cache_key(unit, ("-c", *flags), libraries)
        cmd = [*self.command, *self._includes(libraries), "-c", _UNIT_SOURCE_NAME, "-o", _UNIT_OUTPUT_NAME, *flags]
        return self._cached(self.units, key, lambda: self._invoke(cmd, {_UNIT_SOURCE_NAME: unit.encode("utf-8")},
                                                                  _UNIT_OUTPUT_NAME, "C compilation of a unit"))

    @staticmethod
    def _cached(cache: BuildCache, key: str, build: Callable[[], bytes]) -> bytes:
        """``cache``'s bytes for ``key``, built on a miss; a cache that cannot be written is a KernelError."""
        try:
            return cache.get_or_build(key, build)
        except OSError as exc:
            raise KernelError(f"cannot write the CPU build cache {cache.root}: {exc}; "
                              "free space there or set ENGINE_CACHE_DIR to a writable directory") from exc

    @staticmethod
    def _includes(libraries: Sequence[LinkedLibrary]) -> list[str]:
        return [f"-I{lib.include_dir}" for lib in libraries if lib.include_dir is not None]

    def _invoke(self, cmd: Sequence[str], inputs: Mapping[str, bytes], output: str, what: str) -> bytes:
        """Run ``cmd`` in a private temp dir holding ``inputs`` (file name -> bytes); ``output``'s bytes."""
        try:
            workdir = tempfile.TemporaryDirectory(prefix="engine-cpu-cc-")
        except OSError as exc:
            raise KernelError(f"cannot create a temporary directory to compile C source in "
                              f"({tempfile.gettempdir()}): {exc}; set TMPDIR to a writable directory") from exc
        with workdir as tmp:
            for name, data in inputs.items():
                Path(tmp, name).write_bytes(data)
            self.invocations += 1
            try:
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                                      timeout=_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired as exc:
                raise CompilerError(f"C compiler timed out after {_TIMEOUT_S}s: {shlex.join(cmd)}",
                                    command=cmd) from exc
            except OSError as exc:
                raise CompilerError(f"cannot run the C compiler {cmd[0]!r}: {exc}", command=cmd) from exc
            log = (proc.stderr + proc.stdout).strip()
            if proc.returncode != 0:
                raise CompilerError(
                    f"{what} failed (exit code {proc.returncode}): {_first_error(log)} "
                    f"(the compiler's whole output is in .log; command: {shlex.join(cmd)})", log=log, command=cmd)
            return Path(tmp, output).read_bytes()
