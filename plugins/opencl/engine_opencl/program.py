"""The compiler and program-loader roles: OpenCL C source to a built ``cl.Program``, cached by content.

Bundles carry OpenCL C source (format ``opencl-source``): the driver compiles it for the device at
hand, so one bundle runs on every vendor's devices. Building is slow, so the program binary the
driver produced is kept under ``<cache_dir>/opencl`` keyed by everything the build depends on
(source, options, platform, device, driver version) and handed back to the driver on the next
load; a binary the driver no longer accepts is rebuilt from source. A cache directory that
cannot be written (read-only deployments) still serves what it holds; programs built meanwhile
are kept in memory only (``engine.backend.cachefiles.BuildCache``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any, Mapping

from engine.backend import BinaryPayload
from engine.backend.cachefiles import BuildCache
from engine.errors import KernelError

from engine_opencl.devices import OpenCLDevice

__all__ = ["FORMAT", "TARGET", "LANGUAGE", "OPTIONS", "unloadable", "source_payload", "split_payload", "ProgramCache",
           "kernel_names", "argument_count"]

FORMAT = "opencl-source"
#: The target ``compile`` writes: OpenCL C 1.2, the version every OpenCL 1.2+ device builds.
TARGET = "opencl-c-1.2"
LANGUAGE = "opencl"
#: The ``options`` keys ``compile`` understands; anything else is refused so a typo is not ignored.
OPTIONS = ("build_options", "name")
#: A payload's first line may carry its build options, so they travel with the source in the bundle.
_HEADER = "// engine-opencl build options:"
_STD = "-cl-std=CL1.2"


def unloadable(binary_format: str, target: str) -> str | None:
    """Why a binary of this format and target cannot be loaded by this plugin, or ``None``."""
    if binary_format != FORMAT:
        return f"format {binary_format!r} is not {FORMAT!r}"
    if target not in (TARGET, "any"):
        return f"target {target!r}: this plugin builds OpenCL C 1.2 source (targets {TARGET!r}, 'any')"
    return None


def _options(options: Mapping[str, object] | None) -> tuple[list[str], str | None]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise KernelError(f"unknown opencl compile option(s) {unknown}; known: {list(OPTIONS)}")
    flags = options.get("build_options") or []
    flags = flags.split() if isinstance(flags, str) else flags
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, str) and "\n" not in f for f in flags):
        raise KernelError(f"opencl compile option 'build_options' must be a string or a list of strings, got {flags!r}")
    name = options.get("name")
    return list(flags), None if name is None else str(name)


def source_payload(source: str, options: Mapping[str, object] | None) -> tuple[BinaryPayload, list[str]]:
    """The ``opencl-source`` payload ``compile`` returns (options in its header) and its build options."""
    flags, name = _options(options)
    text = f"{_HEADER} {' '.join(flags)}\n{source}" if flags else source
    data = text.encode("utf-8")
    path = f"{name or hashlib.sha256(data).hexdigest()[:16]}.cl"
    return BinaryPayload(FORMAT, TARGET, path, data), flags


def split_payload(data: bytes | memoryview) -> tuple[str, list[str]]:
    """The source and build options of an ``opencl-source`` payload."""
    text = bytes(data).decode("utf-8")
    if text.startswith(_HEADER):
        first, _, rest = text.partition("\n")
        return rest, first[len(_HEADER):].split()
    return text, []


class ProgramCache:
    """Built programs by (device, content), in memory and as driver binaries on disk."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._store = BuildCache(self.root, ".bin", cache_root=self.root.parent)  # root: <cache_dir>/opencl
        self._programs: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def program(self, dev: OpenCLDevice, source: str, flags: list[str]) -> Any:
        """The program built from ``source`` for ``dev``; ``KernelError`` with the build log if it
        does not build, or naming the cache directory if that cannot be written."""
        options = [_STD, *flags]
        key = hashlib.sha256(json.dumps([source, options, dev.identity]).encode()).hexdigest()
        with self._lock:
            program = self._programs.get((dev.index, key))
        if program is not None:
            return program
        built: list[Any] = []

        def build() -> bytes:
            built.append(_build(dev, source, options, None))
            return _binary(built[-1])

        try:
            binary = self._store.get_or_build(key, build)
            if not built:
                try:
                    built.append(_build(dev, source, options, binary))
                except KernelError:  # the driver refuses its own binary (updated in place): rebuild
                    built.append(_build(dev, source, options, None))
                    self._store.put(key, _binary(built[-1]))
        except OSError as exc:
            raise KernelError(f"cannot use the opencl program cache {self.root}: {exc}; set ENGINE_CACHE_DIR to a "
                              f"writable directory") from exc
        with self._lock:
            return self._programs.setdefault((dev.index, key), built[-1])


def _build(dev: OpenCLDevice, source: str, options: list[str], binary: bytes | None) -> Any:
    import pyopencl as cl

    try:
        if binary is None:
            program = cl.Program(dev.context, source)
        else:
            program = cl.Program(dev.context, [dev.device], [binary])
        # cache_dir=False: this class is the cache; pyopencl's own would keep a second copy.
        return program.build(options=options, devices=[dev.device], cache_dir=False)
    except cl.Error as exc:
        what = "the OpenCL C source" if binary is None else "the cached program binary"
        # pyopencl's message repeats the failure and ends with the options; keep the driver's log.
        log = re.search(r"Build on [^\n]*:\n(.*?)(?:\n\(options: [^\n]*\))?\s*$", str(exc), re.DOTALL)
        raise KernelError(f"{what} does not build for opencl:{dev.index} ({dev.name}) with options "
                          f"{' '.join(options)!r}: {exc.routine} error {exc.code}\n"
                          f"{(log.group(1) if log else str(exc)).strip()}") from exc


def _binary(program: Any) -> bytes:
    import pyopencl as cl

    return bytes(program.get_info(cl.program_info.BINARIES)[0])


def kernel_names(program: Any) -> list[str]:
    import pyopencl as cl

    return program.get_info(cl.program_info.KERNEL_NAMES).split(";")


def argument_count(program: Any, entry: str) -> int:
    import pyopencl as cl

    return int(cl.Kernel(program, entry).num_args)
