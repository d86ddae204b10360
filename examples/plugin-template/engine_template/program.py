"""The compiler and program-loader roles: C source to shared objects, one binary to a kernel.

The engine picks the binary (``BackendBase.load_kernel``): it asks ``Programs.unloadable`` about
each binary of a candidate in the bundle's order and hands the first one that fits to ``load``.
Here that is an ``elf-so`` built for this machine's target, else a ``c-source`` compiled with
``cc``. A shared object that passes that check but still does not open (a missing library, an
unresolved symbol) raises ``BinaryRefused``: the engine then tries the next binary, and lists the
reason if none loads. A source that does not compile is a broken bundle: ``KernelError``.

Shared objects are published through ``engine.backend.cachefiles.ContentStore`` at
``<cache_dir>/template/so/<sha256>.so`` (atomically, and an existing file is only trusted if its
bytes hash to its name) and opened with ``RTLD_LOCAL`` so two kernels' symbols never collide.
Libraries are never closed: a live function pointer into an unloaded library would crash the
process.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from engine.backend import BinaryPayload, BinaryRefused, CandidateSpec
from engine.backend.cachefiles import ContentStore, sha256_hex
from engine.errors import KernelError

from engine_template.kernel import TemplateKernel

__all__ = ["FORMATS", "CFLAGS", "host_target", "Programs"]

FORMATS = ("elf-so", "c-source")
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c11")


def host_target() -> str:
    """The target name ``elf-so`` binaries carry for this machine, e.g. ``"x86_64-linux"``."""
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    system = "linux" if sys.platform.startswith("linux") else sys.platform
    return f"{machine}-{system}"


class Programs:
    """Compiles C, opens shared objects (once per content hash) and binds candidates."""

    def __init__(self, cache_dir: Path, cc: str = "cc"):
        self.store = ContentStore(Path(cache_dir) / "template" / "so", ".so")
        self.cc = cc
        self._built: dict[str, bytes] = {}
        self._libraries: dict[str, ctypes.CDLL] = {}
        self._lock = threading.Lock()

    def unloadable(self, binary_format: str, target: str) -> str | None:
        """``None`` when a binary of this format and target can be used here, else why not."""
        if binary_format == "elf-so":
            return None if target == host_target() else f"built for {target}, this machine is {host_target()}"
        if binary_format == "c-source":
            return None if shutil.which(self.cc) else f"no C compiler {self.cc!r} on PATH"
        return f"format {binary_format!r} is not one of {list(FORMATS)}"

    def compile_c(self, source: str) -> bytes:
        """Shared-object bytes for ``source`` (memoized per process)."""
        key = hashlib.sha256(source.encode("utf-8")).hexdigest()
        if key in self._built:
            return self._built[key]
        with tempfile.TemporaryDirectory(prefix="engine-template-cc-") as tmp:
            Path(tmp, "kernel.c").write_text(source, encoding="utf-8")
            cmd = [self.cc, "kernel.c", "-o", "kernel.so", *CFLAGS, "-lm"]
            try:
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelError(f"cannot run the C compiler {self.cc!r}: {exc}") from exc
            if proc.returncode != 0:
                raise KernelError(f"C compilation failed: {' '.join(cmd)}\n{(proc.stderr + proc.stdout).strip()}")
            data = Path(tmp, "kernel.so").read_bytes()
        self._built[key] = data
        return data

    def open_library(self, data: bytes | memoryview) -> ctypes.CDLL:
        """The opened shared object (once per content hash).

        ``KernelError`` when the cache cannot be written; ``BinaryRefused`` when the object does
        not open here (the engine then tries the candidate's next binary).
        """
        sha = sha256_hex(data)
        with self._lock:
            library = self._libraries.get(sha)
            if library is None:
                try:
                    path = self.store.publish(data, sha)
                except OSError as exc:
                    raise KernelError(f"cannot write {self.store.path_for(sha)}: {exc}; "
                                      "set ENGINE_CACHE_DIR to a writable directory") from exc
                try:
                    library = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
                except OSError as exc:
                    raise BinaryRefused(f"cannot open the shared object: {exc}") from exc
                self._libraries[sha] = library
            return library

    def load(self, spec: CandidateSpec, binary: BinaryPayload) -> TemplateKernel:
        """The candidate's entry from ``binary``, which ``unloadable`` accepted."""
        where = f"{spec.describe()}: {binary.describe()}"
        if binary.format == "elf-so":
            data = binary.data
        else:
            try:
                data = self.compile_c(bytes(binary.data).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise KernelError(f"{where}: the C source is not UTF-8: {exc}") from exc
            except KernelError as exc:
                raise KernelError(f"{where}: {exc}") from exc
        try:
            library = self.open_library(data)
        except BinaryRefused:
            raise  # the engine lists the reason beside this binary's name
        except KernelError as exc:
            raise KernelError(f"{where}: {exc}") from exc
        try:
            function = library[spec.entry]
        except AttributeError:
            raise KernelError(f"{where} does not export the entry symbol {spec.entry!r}") from None
        return TemplateKernel(spec, binary, library, function)
