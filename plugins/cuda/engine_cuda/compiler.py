"""The compiler role: CUDA C++ to cubins (one per SM architecture) and PTX, through NVRTC.

NVRTC needs no driver and no GPU, so ``GraphBuilder`` builds CUDA bundles on any machine that has
the NVRTC wheel (issue 10: "CUDA C to cubin for a list of archs plus PTX, so GraphBuilder can build a
CUDA bundle on a machine without a GPU"). The backend's ``compile()`` and its loading of
``cuda-source`` binaries both come here.

What ``compile`` returns, most specific first (bundle format §13: the loader takes the first binary
the device can use): one ``cubin`` per architecture, newest architecture first (a cubin runs on its
own major at an equal or higher minor, so an sm_89 device skips ``sm_90`` and takes ``sm_80``), then
one ``ptx`` for the oldest architecture, which any later GPU's driver can JIT. PTX carries the
PTX ISA version of the NVRTC that made it and a driver older than that NVRTC refuses it
(``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``), which is why cubins come first (docs/cuda.md, "Versions").

NVRTC has no C library headers, so ``<stdint.h>`` and ``<cstdint>`` are supplied here (the
fixed-width types of the kernel ABI, bundle format §12.2). Entries must be ``extern "C"``: the
bundle names them by their symbol.

Cache: an ``engine.backend.cachefiles.BuildCache`` per output kind under
``<cache_dir>/cuda/build`` (``<key>.cubin`` / ``<key>.ptx``), where ``key`` is the sha256 of the
source, the NVRTC version, the target and the options, so a new NVRTC never reuses old output.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.backend import BinaryPayload
from engine.backend.cachefiles import BuildCache
from engine.errors import InputError, KernelError, Unsupported

__all__ = ["CudaCompiler", "CudaCompileError", "DEFAULT_ARCHS", "DEFAULT_PTX", "BASE_FLAGS", "OPTIONS",
           "NVRTC_HEADERS", "parse_arch", "nvrtc_unavailable"]

#: Cubin architectures built by default: Ampere (sm_80; its cubin also runs on sm_86/87/89), Hopper
#: (sm_90), Blackwell data centre (sm_100) and Blackwell consumer (sm_120; runs on sm_121 too).
#: Those the installed NVRTC does not know are left out (``CudaCompiler.default_archs``).
DEFAULT_ARCHS: tuple[str, ...] = ("sm_80", "sm_90", "sm_100", "sm_120")
#: The PTX shipped for every other GPU: the oldest default architecture, so any later one JITs it.
DEFAULT_PTX = "compute_80"
#: Options every compile uses. No ``-use_fast_math``: results must match the CPU kernels closely.
BASE_FLAGS: tuple[str, ...] = ("-std=c++17",)
#: The ``options`` keys ``compile`` understands; anything else is refused so a typo is not ignored.
#: ``archs``: cubin architectures (``"sm_90"`` or ``90``); ``ptx``: the PTX architecture
#: (``"compute_80"``) or ``None`` for no PTX; ``flags``: extra NVRTC options; ``entry``/``name``:
#: the payloads' file names.
OPTIONS = ("archs", "ptx", "flags", "entry", "name")

_STDINT = """#pragma once
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long intptr_t;
typedef unsigned long long uintptr_t;
#define INT32_MAX 2147483647
#define INT64_MAX 9223372036854775807LL
"""
#: Headers NVRTC resolves without a file system (``#include <stdint.h>`` in a kernel source).
NVRTC_HEADERS: Mapping[str, str] = {"stdint.h": _STDINT, "cstdint": _STDINT}

_SOURCE_NAME = "kernel.cu"
_ARCH = re.compile(r"(sm|compute)_(\d{2,3})([af]?)")


class CudaCompileError(KernelError):
    """NVRTC rejected a source. ``log`` holds NVRTC's whole log, ``options`` the options used and
    ``target`` the architecture it was compiling for; the message has the first errors only."""

    def __init__(self, message: str, *, log: str = "", options: Sequence[str] = (), target: str = ""):
        super().__init__(message)
        self.log = log
        self.options = tuple(options)
        self.target = target


def parse_arch(value: object, prefix: str) -> str:
    """``"sm_90"``, ``90`` or ``"90"`` as ``"<prefix>_90"``; ``InputError`` for anything else."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if text.isdigit():
        text = f"{prefix}_{text}"
    m = _ARCH.fullmatch(text)
    if m is None or m.group(1) != prefix:
        raise InputError(f"cuda compile: architecture {value!r} is not of the form {prefix}_<NN> "
                         f"(e.g. {prefix}_90)")
    return text


def nvrtc_unavailable() -> str | None:
    """``None`` when NVRTC can be loaded, else why not and what to install (touches no driver)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        return (f"cuda-bindings is not installed ({exc}); install engine-cuda[cu12] or engine-cuda[cu13]")
    try:
        status, _, _ = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the loader raises RuntimeError/OSError subclasses
        return (f"the NVRTC library cannot be loaded ({type(exc).__name__}: {exc}); install the NVRTC wheel "
                "matching cuda-bindings' major (nvidia-cuda-nvrtc-cu12 for 12.x, nvidia-cuda-nvrtc for 13.x)")
    if int(status) != 0:
        return f"nvrtcVersion failed with status {int(status)}"
    return None


class CudaCompiler:
    """NVRTC with a disk cache: ``compile`` for the builder, ``cubin``/``ptx`` for one target.

    Nothing is loaded until the first compile (importing the plugin must stay cheap).
    ``invocations`` counts real NVRTC compilations by this object (cache hits do not count).
    """

    def __init__(self, cache_dir: Path):
        self.build_dir = Path(cache_dir) / "cuda" / "build"
        self.invocations = 0
        self._lock = threading.Lock()
        self._version: tuple[int, int] | None = None
        self._archs: tuple[int, ...] | None = None
        self._caches = {kind: BuildCache(self.build_dir, f".{kind}", cache_root=Path(cache_dir))
                        for kind in ("cubin", "ptx")}

    # -- what this NVRTC is ------------------------------------------------------------------
    def _nvrtc(self) -> Any:
        problem = nvrtc_unavailable()
        if problem is not None:
            raise Unsupported(f"the cuda backend cannot compile cuda sources here: {problem}")
        from cuda.bindings import nvrtc

        return nvrtc

    def version(self) -> tuple[int, int]:
        """NVRTC's ``(major, minor)``: part of every cache key, and the PTX ISA a driver must accept."""
        with self._lock:
            if self._version is None:
                _, major, minor = self._nvrtc().nvrtcVersion()
                self._version = (int(major), int(minor))
            return self._version

    def supported_archs(self) -> tuple[int, ...]:
        """The SM architectures this NVRTC compiles for (e.g. ``(75, 80, 86, …, 120)``)."""
        with self._lock:
            if self._archs is None:
                status, archs = self._nvrtc().nvrtcGetSupportedArchs()
                self._archs = tuple(int(a) for a in archs) if int(status) == 0 else ()
            return self._archs

    def default_archs(self) -> tuple[str, ...]:
        """``DEFAULT_ARCHS`` less those this NVRTC does not know (an older NVRTC lacks sm_120)."""
        supported = self.supported_archs()
        return tuple(a for a in DEFAULT_ARCHS if _number(a) in supported)

    def describe(self) -> str:
        """``NVRTC 12.8`` (for ``engine devices`` and the docs)."""
        major, minor = self.version()
        return f"NVRTC {major}.{minor}"

    # -- compiling -----------------------------------------------------------------------------
    def targets(self, options: Mapping[str, object] | None) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
        """``(cubin archs, ptx arch or None, extra flags)`` for ``options``, validated."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InputError(f"unknown cuda compile option(s) {unknown}; known: {list(OPTIONS)}")
        raw_archs = options.get("archs")
        archs: tuple[str, ...]
        if raw_archs is None:
            archs = self.default_archs()
        elif isinstance(raw_archs, (str, int)):
            archs = (parse_arch(raw_archs, "sm"),)
        elif isinstance(raw_archs, (list, tuple)):
            archs = tuple(dict.fromkeys(parse_arch(a, "sm") for a in raw_archs))
        else:
            raise InputError(f"cuda compile: option 'archs' must be a list of architectures, got {raw_archs!r}")
        raw_ptx = options.get("ptx", DEFAULT_PTX)
        ptx = None if raw_ptx is None or raw_ptx is False else parse_arch(raw_ptx, "compute")
        if not archs and ptx is None:
            raise InputError("cuda compile: no target: give at least one arch in 'archs' or a 'ptx' architecture")
        raw_flags = options.get("flags") or ()
        if not isinstance(raw_flags, (list, tuple)) or not all(isinstance(f, str) for f in raw_flags):
            raise InputError(f"cuda compile: option 'flags' must be a sequence of strings, got {raw_flags!r}")
        flags = tuple(str(f) for f in raw_flags)
        supported = self.supported_archs()
        for arch in (*archs, *((ptx,) if ptx else ())):
            if _number(arch) not in supported:
                raise InputError(f"cuda compile: {self.describe()} cannot compile for {arch}; it supports "
                                 f"{', '.join(f'sm_{a}' for a in supported)}")
        archs = tuple(sorted(archs, key=_number, reverse=True))  # newest first: the loader takes the first fit
        return archs, ptx, flags

    def compile(self, source: str, options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """Cubins for ``options['archs']`` (default: ``default_archs()``), newest first, then PTX for
        ``options['ptx']`` (default ``DEFAULT_PTX``; ``None`` for none)."""
        archs, ptx, flags = self.targets(options)
        name = str((options or {}).get("entry") or (options or {}).get("name") or "kernel")
        payloads = [BinaryPayload("cubin", arch, f"{name}.{arch}.cubin", self.cubin(source, arch, flags))
                    for arch in archs]
        if ptx is not None:
            payloads.append(BinaryPayload("ptx", ptx, f"{name}.{ptx}.ptx", self.ptx(source, ptx, flags)))
        return tuple(payloads)

    def cubin(self, source: str, arch: str, flags: Sequence[str] = ()) -> bytes:
        """The cubin of ``source`` for ``arch`` (``"sm_90"``), from the cache or NVRTC."""
        return self._build("cubin", source, parse_arch(arch, "sm"), tuple(flags))

    def ptx(self, source: str, arch: str, flags: Sequence[str] = ()) -> bytes:
        """The PTX text of ``source`` for ``arch`` (``"compute_80"``), without a trailing NUL byte
        (``cuModuleLoadData`` needs one: the loader appends it)."""
        return self._build("ptx", source, parse_arch(arch, "compute"), tuple(flags))

    def options_for(self, target: str, flags: Sequence[str]) -> tuple[str, ...]:
        return (f"--gpu-architecture={target}", *BASE_FLAGS, *flags)

    def cache_key(self, kind: str, source: str, target: str, flags: Sequence[str]) -> str:
        major, minor = self.version()
        h = hashlib.sha256()
        headers = "\0".join(f"{k}\0{v}" for k, v in sorted(NVRTC_HEADERS.items()))
        for part in (kind, source, f"nvrtc {major}.{minor}", "\0".join(self.options_for(target, flags)), headers):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous concatenation
            h.update(data)
        return h.hexdigest()

    def _build(self, kind: str, source: str, target: str, flags: tuple[str, ...]) -> bytes:
        key = self.cache_key(kind, source, target, flags)
        try:
            return self._caches[kind].get_or_build(key, lambda: self._run(kind, source, target, flags))
        except OSError as exc:
            raise KernelError(f"cannot write the CUDA build cache {self.build_dir}: {exc}; free space there or "
                              "set ENGINE_CACHE_DIR to a writable directory") from exc

    def _run(self, kind: str, source: str, target: str, flags: tuple[str, ...]) -> bytes:
        nvrtc = self._nvrtc()
        options = self.options_for(target, flags)
        names = list(NVRTC_HEADERS)
        status, prog = nvrtc.nvrtcCreateProgram(source.encode("utf-8"), _SOURCE_NAME.encode(), len(names),
                                                [NVRTC_HEADERS[n].encode() for n in names],
                                                [n.encode() for n in names])
        _check(nvrtc, status, "nvrtcCreateProgram")
        try:
            self.invocations += 1
            (status,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            log = _program_log(nvrtc, prog)
            if int(status) != 0:
                raise CudaCompileError(
                    f"CUDA compilation for {target} failed ({_status_name(nvrtc, status)}): {_first_error(log)} "
                    f"(NVRTC's whole log is in .log; options: {' '.join(options)})",
                    log=log, options=options, target=target)
            if kind == "cubin":
                status, size = nvrtc.nvrtcGetCUBINSize(prog)
                _check(nvrtc, status, "nvrtcGetCUBINSize")
                buf = bytearray(size)
                (status,) = nvrtc.nvrtcGetCUBIN(prog, buf)
                _check(nvrtc, status, "nvrtcGetCUBIN")
                return bytes(buf)
            status, size = nvrtc.nvrtcGetPTXSize(prog)
            _check(nvrtc, status, "nvrtcGetPTXSize")
            buf = bytearray(size)
            (status,) = nvrtc.nvrtcGetPTX(prog, buf)
            _check(nvrtc, status, "nvrtcGetPTX")
            return bytes(buf).rstrip(b"\0")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


def _number(arch: str) -> int:
    m = _ARCH.fullmatch(arch)
    return int(m.group(2)) if m else -1


def _status_name(nvrtc: Any, status: Any) -> str:
    try:
        _, text = nvrtc.nvrtcGetErrorString(status)
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - only for a message
        return f"status {int(status)}"


def _check(nvrtc: Any, status: Any, call: str) -> None:
    if int(status) != 0:
        raise KernelError(f"{call} failed: {_status_name(nvrtc, status)}")


def _program_log(nvrtc: Any, prog: Any) -> str:
    status, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if int(status) != 0 or size <= 1:
        return ""
    buf = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).rstrip(b"\0").decode("utf-8", "replace").strip()


def _first_error(log: str) -> str:
    """NVRTC's first error lines (or its first line): a one-line summary for the message."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join((errors or lines or ["no output"])[:3])[:600]
