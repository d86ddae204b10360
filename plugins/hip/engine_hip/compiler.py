"""The compiler role: HIP C++ to AMDGPU code objects (``hsaco``), one per gfx target, through hiprtc.

hiprtc needs neither a GPU nor the HIP runtime's devices, so ``GraphBuilder`` builds HIP bundles on
any machine with hiprtc and the ROCm device libraries (Debian: ``libamdhip64-5``,
``libhiprtc-builtins5``, ``rocm-device-libs``; ``scripts/install-rocm-compiler``). Every hiprtc call
runs in a child process (``hiprtc_worker``): hiprtc can abort, and an abort must become an error
naming the target, not the end of the caller's process.

What ``compile`` returns: one ``hsaco`` per target, in the order given (an AMD code object runs on
its own gfx target only, so the order does not matter for selection); the builder appends the
source (``hip-source``), compiled at load for the device's own target when no hsaco fits.
``default_targets()`` is ``DEFAULT_TARGETS`` less the targets this hiprtc cannot compile for (found
by compiling a one-line kernel once per target and compiler); a target named explicitly that it
cannot compile for is an error.

Every produced code object is checked before it is returned or cached: ``e_machine`` must be
``EM_AMDGPU`` (224) and its target the one asked for, so a wrong-target or non-ELF output never
lands in a bundle.

Cache: an ``engine.backend.cachefiles.BuildCache`` under ``<cache_dir>/hip/build`` (``<key>.hsaco``),
where ``key`` hashes the source, the compiler (library file and hiprtc version), the target and the
options: a new ROCm never reuses old output.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.backend import BinaryPayload
from engine.backend.cachefiles import BuildCache
from engine.errors import InputError, KernelError, Unsupported

from engine_hip.kernels import EM_AMDGPU, code_object_target, parse_target

__all__ = ["HipCompiler", "HipCompileError", "DEFAULT_TARGETS", "BASE_FLAGS", "OPTIONS", "hiprtc_unavailable"]

#: Code objects built by default: CDNA2 (MI200, gfx90a), CDNA3 (MI300, gfx942), RDNA3 (RX 7900, gfx1100).
DEFAULT_TARGETS: tuple[str, ...] = ("gfx90a", "gfx942", "gfx1100")
#: Options every compile uses. No fast math: results must match the CPU kernels closely.
BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17")
#: ``targets``: gfx targets (``"gfx942"``, features allowed: ``"gfx90a:xnack+"``); ``flags``: extra
#: hiprtc options; ``entry``/``name``: the payloads' file names. Anything else is refused.
OPTIONS = ("targets", "flags", "entry", "name")
#: Seconds one hiprtc child may take (a large kernel for one target takes a few seconds).
TIMEOUT = 300.0

_PROBE_SOURCE = 'extern "C" __global__ void probe(float *x) { x[threadIdx.x] += 1.0f; }\n'


class HipCompileError(KernelError):
    """hiprtc rejected a source or died compiling it. ``log`` holds hiprtc's whole log, ``options``
    the options used and ``target`` the gfx target; the message has the first errors only."""

    def __init__(self, message: str, *, log: str = "", options: Sequence[str] = (), target: str = ""):
        super().__init__(message)
        self.log = log
        self.options = tuple(options)
        self.target = target


def _worker(request: Mapping[str, Any]) -> tuple[int, dict[str, Any], str]:
    """Run one ``hiprtc_worker`` request: ``(return code, answer, stderr tail)``."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run([sys.executable, "-m", "engine_hip.hiprtc_worker"], input=json.dumps(dict(request)),
                              capture_output=True, text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return -1, {}, f"hiprtc took longer than {TIMEOUT:.0f} s"
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except ValueError:
        answer = {}
    return proc.returncode, answer, proc.stderr.strip()[-400:]


def hiprtc_unavailable() -> str | None:
    """``None`` when hiprtc can be loaded, else why not and what to install (touches no GPU)."""
    code, answer, err = _worker({"op": "info"})
    if code != 0:
        return f"the hiprtc probe process failed (exit status {code}): {err or 'no output'}"
    if "missing" in answer:
        return (f"no hiprtc library ({answer['missing']}); install ROCm's hiprtc (ROCm 6/7: libhiprtc.so; "
                "Debian 12: apt-get install libamdhip64-dev libhiprtc-builtins5 rocm-device-libs, or "
                "scripts/install-rocm-compiler) or set ENGINE_HIPRTC_LIBRARY")
    return None


def _parse_target(value: object) -> str:
    text = str(value).strip() if isinstance(value, str) else ""
    if parse_target(text) is None:
        raise InputError(f"hip compile: target {value!r} is not of the form gfx<NNN>[:feature±] (e.g. gfx942, "
                         "gfx90a:xnack+)")
    return text


class HipCompiler:
    """hiprtc (in child processes) with a disk cache: ``compile`` for the builder, ``hsaco`` for one
    target. Nothing runs until the first compile; ``invocations`` counts real hiprtc compilations."""

    def __init__(self, cache_dir: Path):
        self.build_dir = Path(cache_dir) / "hip" / "build"
        self.invocations = 0
        self._lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._support: dict[str, str | None] = {}
        self._cache = BuildCache(self.build_dir, ".hsaco", cache_root=Path(cache_dir))

    # -- what this hiprtc is -------------------------------------------------------------------
    def info(self) -> Mapping[str, Any]:
        """``{"library", "file", "version"}`` of the hiprtc the worker loads; ``Unsupported`` if none."""
        with self._lock:
            if self._info is None:
                problem = hiprtc_unavailable()
                if problem is not None:
                    raise Unsupported(f"the hip backend cannot compile hip sources here: {problem}")
                self._info = _worker({"op": "info"})[1]
            return self._info

    def describe(self) -> str:
        """``hiprtc 9.0 (libamdhip64.so.5.2.21153)``: the compiler, for messages and cache keys."""
        info = self.info()
        return f"hiprtc {info.get('version')} ({info.get('file')})"

    def target_problem(self, target: str) -> str | None:
        """Why this hiprtc cannot compile for ``target`` (a one-line kernel, once per target), or None."""
        target = _parse_target(target)
        with self._lock:
            known = target in self._support
        if not known:
            try:
                self._compile_checked(_PROBE_SOURCE, target, ())
                problem = None
            except HipCompileError as exc:
                problem = str(exc)
            with self._lock:
                self._support[target] = problem
        return self._support[target]

    def default_targets(self) -> tuple[str, ...]:
        """``DEFAULT_TARGETS`` less those this hiprtc cannot compile for (ROCm 5.2 knows only gfx90a)."""
        return tuple(t for t in DEFAULT_TARGETS if self.target_problem(t) is None)

    # -- compiling -----------------------------------------------------------------------------
    def targets(self, options: Mapping[str, object] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(gfx targets, extra flags)`` for ``options``, validated."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InputError(f"unknown hip compile option(s) {unknown}; known: {list(OPTIONS)}")
        raw = options.get("targets")
        targets: tuple[str, ...]
        if raw is None:
            targets = self.default_targets()
            if not targets:
                raise Unsupported(f"{self.describe()} cannot compile for any of {list(DEFAULT_TARGETS)}: "
                                  f"{self.target_problem(DEFAULT_TARGETS[0])}")
        elif isinstance(raw, str):
            targets = (_parse_target(raw),)
        elif isinstance(raw, (list, tuple)):
            targets = tuple(dict.fromkeys(_parse_target(t) for t in raw))
        else:
            raise InputError(f"hip compile: option 'targets' must be a list of gfx targets, got {raw!r}")
        if not targets:
            raise InputError("hip compile: no target: give at least one gfx target in 'targets'")
        raw_flags = options.get("flags") or ()
        if not isinstance(raw_flags, (list, tuple)) or not all(isinstance(f, str) for f in raw_flags):
            raise InputError(f"hip compile: option 'flags' must be a sequence of strings, got {raw_flags!r}")
        return targets, tuple(raw_flags)

    def compile(self, source: str, options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """One hsaco per target of ``options['targets']`` (default: ``default_targets()``)."""
        targets, flags = self.targets(options)
        name = str((options or {}).get("entry") or (options or {}).get("name") or "kernel")
        return tuple(BinaryPayload("hsaco", t, f"{name}.{t.replace(':', '_')}.hsaco", self.hsaco(source, t, flags))
                     for t in targets)

    def hsaco(self, source: str, target: str, flags: Sequence[str] = ()) -> bytes:
        """The code object of ``source`` for ``target`` (``"gfx942"``), from the cache or hiprtc."""
        target, flags = _parse_target(target), tuple(flags)
        key = self.cache_key(source, target, flags)
        try:
            return self._cache.get_or_build(key, lambda: self._compile_checked(source, target, flags))
        except OSError as exc:
            raise KernelError(f"cannot write the HIP build cache {self.build_dir}: {exc}; free space there or "
                              "set ENGINE_CACHE_DIR to a writable directory") from exc

    def options_for(self, target: str, flags: Sequence[str]) -> tuple[str, ...]:
        return (f"--offload-arch={target}", *BASE_FLAGS, *flags)

    def cache_key(self, source: str, target: str, flags: Sequence[str]) -> str:
        h = hashlib.sha256()
        for part in ("hsaco", source, self.describe(), "\0".join(self.options_for(target, flags))):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous concatenation
            h.update(data)
        return h.hexdigest()

    def _compile_checked(self, source: str, target: str, flags: tuple[str, ...]) -> bytes:
        options = self.options_for(target, flags)
        describe = self.describe()
        with tempfile.TemporaryDirectory(prefix="engine-hiprtc-") as tmp:
            out = Path(tmp) / "code.hsaco"
            with self._lock:
                self.invocations += 1
            code, answer, err = _worker({"op": "compile", "source": source, "options": list(options), "out": str(out)})
            if code != 0:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                raise HipCompileError(f"HIP compilation for {target} failed: the hiprtc process {how} ({describe} "
                                      f"probably does not support {target}; a newer ROCm does): {err or 'no output'}",
                                      log=err, options=options, target=target)
            if not answer.get("ok"):
                log = str(answer.get("log", ""))
                raise HipCompileError(f"HIP compilation for {target} failed ({answer.get('status')}): "
                                      f"{_first_error(log)} (hiprtc's whole log is in .log; options: "
                                      f"{' '.join(options)})", log=log, options=options, target=target)
            data = out.read_bytes()
        try:
            obj = code_object_target(data)
        except ValueError as exc:
            raise HipCompileError(f"hiprtc's output for {target} is not a code object ({exc})", target=target) from exc
        base = target.split(":")[0]
        if obj.machine != EM_AMDGPU or (obj.target or "").split(":")[0] != base:
            raise HipCompileError(f"hiprtc's output for {target} is a code object for {obj.target} (e_machine "
                                  f"{obj.machine}, expected {EM_AMDGPU})", target=target)
        return data


def _first_error(log: str) -> str:
    """hiprtc's first error lines (or its first line): a one-line summary for the message."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join((errors or lines or ["no output"])[:3])[:600]
