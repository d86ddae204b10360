"""The compiler and program-loader roles: C source to shared objects, binaries to kernels.

Per candidate the loader takes the *first* binary it can use, in the bundle's order: an
``elf-so`` built for this machine's target, else a ``c-source`` it compiles with ``cc``. When
none fits, the error lists every binary and why it was refused.

Shared objects are published at ``<cache_dir>/template/so/<sha256>.so`` (atomically, and an
existing file is only trusted if its bytes hash to its name) and opened with ``RTLD_LOCAL`` so
two kernels' symbols never collide. Libraries are never closed: a live function pointer into an
unloaded library would crash the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from engine.backend import CandidateSpec
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
        self.so_dir = Path(cache_dir) / "template" / "so"
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
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            library = self._libraries.get(sha)
            if library is None:
                path = self.so_dir / f"{sha}.so"
                if not _holds(path, sha):
                    _publish(path, data)
                library = self._libraries[sha] = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            return library

    def load_kernel(self, spec: CandidateSpec) -> TemplateKernel:
        refused = []
        for binary in spec.binaries:
            reason = self.unloadable(binary.format, binary.target)
            if reason is not None:
                refused.append(f"{binary.path} ({binary.format}, {binary.target}): {reason}")
                continue
            where = f"{spec.describe()}: {binary.path} ({binary.format}, {binary.target})"
            try:
                data = binary.data if binary.format == "elf-so" else self.compile_c(bytes(binary.data).decode())
                library = self.open_library(data)
            except (KernelError, OSError, UnicodeDecodeError) as exc:
                raise KernelError(f"{where}: {exc}") from exc
            try:
                function = library[spec.entry]
            except AttributeError:
                raise KernelError(f"{where} does not export the entry symbol {spec.entry!r}") from None
            return TemplateKernel(spec, binary, library, function)
        raise KernelError(f"{spec.describe()}: no loadable binary: {'; '.join(refused) or 'none listed'}; "
                          f"rebuild the bundle for {host_target()} or ship a c-source binary")


def _holds(path: Path, sha: str) -> bool:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == sha
    except OSError:
        return False


def _publish(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` so readers see no file or the whole file: temp file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
