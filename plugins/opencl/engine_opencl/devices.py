"""Finding OpenCL devices: every platform's devices in a stable order, one context each.

Every way an OpenCL install can be broken (no pyopencl, no ICD, no device, a context the driver
refuses, a PoCL whose compiler cannot target this CPU) ends in an ``Availability`` whose reason
says what to install or set, never in an exception: ``engine devices`` must list the kind on any
machine.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.backend import Availability

__all__ = ["OpenCLDevice", "discover", "INSTALL_HINT", "ensure_writable_caches"]

log = logging.getLogger("engine.opencl")

INSTALL_HINT = ("pip install 'engine-opencl[pocl]' for PoCL's CPU device, or install your vendor's OpenCL "
                "driver (an ICD listed in /etc/OpenCL/vendors)")


class OpenCLDevice:
    """One usable device: its driver objects and the facts the backend needs about it."""

    __slots__ = ("index", "device", "context", "name", "driver", "identity", "base_align", "max_alloc")

    def __init__(self, index: int, platform: Any, device: Any, context: Any):
        self.index = index
        self.device = device
        self.context = context
        self.name = f"{platform.name} / {device.name}"
        self.driver = f"{platform.name} ({platform.version.strip()}), driver {device.driver_version}"
        #: What a built program depends on besides its source and options (the build cache key).
        self.identity = f"{self.driver} / {device.name} / {device.version}"
        #: ``MEM_BASE_ADDR_ALIGN`` in bytes (the driver reports bits): sub-buffer offsets need it.
        self.base_align = max(1, device.mem_base_addr_align // 8)
        self.max_alloc = int(device.max_mem_alloc_size)

    def __repr__(self) -> str:
        return f"<OpenCLDevice opencl:{self.index} {self.name}>"


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _user_cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def ensure_writable_caches(cache_dir: Path) -> None:
    """Keep the OpenCL stack working where its caches' default places cannot be written.

    Two libraries below the plugin keep caches in the user's cache directory (``$XDG_CACHE_HOME``,
    else ``~/.cache``) and break when it is read-only (a read-only HOME in a container):

    * PoCL keeps compiled kernels under ``$POCL_CACHE_DIR`` (default ``<user cache>/pocl``) and,
      when it cannot create it, reports no device at all. The variable is pointed at
      ``<engine cache>/opencl/pocl`` or, failing that, a private temporary directory.
    * pyopencl keeps generated argument-setting code under ``<user cache>/pytools`` and raises
      when it cannot create it. ``PYOPENCL_NO_CACHE=1`` turns that cache off (the plugin keeps
      its own cache of built programs; the generated code is rebuilt per process, which is cheap).

    Only variables the user left unset are set, each with one WARNING; both are read when the
    library initialises (PoCL at the first OpenCL call, pyopencl at import), so this runs before
    either, and a process where they are already loaded is unaffected.
    """
    base = _user_cache_base()
    if not os.environ.get("POCL_CACHE_DIR") and not _writable_dir(base / "pocl"):
        chosen = Path(cache_dir) / "opencl" / "pocl"
        if not _writable_dir(chosen):
            chosen = Path(tempfile.mkdtemp(prefix="engine-pocl-"))
        os.environ["POCL_CACHE_DIR"] = str(chosen)
        log.warning("PoCL's kernel cache %s cannot be written; using %s (set POCL_CACHE_DIR to choose)",
                    base / "pocl", chosen)
    if "PYOPENCL_NO_CACHE" not in os.environ and not _writable_dir(base / "pytools"):
        os.environ["PYOPENCL_NO_CACHE"] = "1"
        log.warning("pyopencl's cache %s cannot be written; running without it (PYOPENCL_NO_CACHE=1)",
                    base / "pytools")


#: PoCL's platform name. Its CPU device compiles through the LLVM it was built with, which names
#: the host CPU for code generation; an LLVM older than the CPU says "generic", which it then
#: refuses, so every build fails on such a machine although the device lists fine.
POCL_PLATFORM = "Portable Computing Language"

_PROBE = "__kernel void engine_probe(__global int *x) { x[0] = 1; }"


def _pocl_cannot_compile(cl: Any, context: Any) -> str | None:
    """Why PoCL cannot build a one-line kernel here (None when it can). PoCL caches the build, so
    this costs a compiler run once per machine and a cache read after."""
    try:
        cl.Program(context, _PROBE).build()
    except cl.Error as exc:
        text = str(exc)
        if "unknown target CPU" in text:
            return ("its compiler cannot target this CPU (its LLVM does not know it and answers 'unknown target "
                    "CPU'): a PoCL built with a newer LLVM is needed here")
        first = next((line.strip() for line in text.splitlines() if "error" in line.lower()), text.strip())
        return f"cannot compile a one-line kernel: {first}"
    return None


def discover(selection: str | None, alignment: int,
             cache_dir: Path | None = None) -> tuple[list[OpenCLDevice], Availability]:
    """The usable devices and the kind's availability.

    ``selection`` keeps the devices whose "platform / device / type" contains one of its
    comma-separated terms; ``alignment`` is the backend's, which every device's sub-buffer
    alignment must divide (the planner places tensors at multiples of it); ``cache_dir`` (the
    engine's) is where PoCL's cache goes when its own place cannot be written.
    """
    if cache_dir is not None:
        ensure_writable_caches(cache_dir)
    try:
        import pyopencl as cl
    except ImportError as exc:
        return [], Availability(False, reason=f"pyopencl cannot be imported ({exc}); {INSTALL_HINT}")
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:  # -1001 (PLATFORM_NOT_FOUND_KHR): the ICD loader found no driver
        return [], Availability(False, reason=f"no OpenCL platform ({exc}; code {exc.code}): no OpenCL driver "
                                              f"is installed or none loads; {INSTALL_HINT}")
    terms = [t.strip().lower() for t in (selection or "").split(",") if t.strip()]
    seen: list[str] = []
    problems: list[str] = []
    candidates = []
    # The ICD loader's order follows a directory listing; sorting makes opencl:N the same device.
    for platform in sorted(platforms, key=lambda p: (p.name, p.version)):
        try:
            devices = platform.get_devices()
        except cl.Error as exc:
            problems.append(f"{platform.name}: cannot list devices: {exc}")
            continue
        for device in devices:
            label = f"{platform.name} / {device.name} / {cl.device_type.to_string(device.type)}"
            seen.append(label)
            if not terms or any(t in label.lower() for t in terms):
                candidates.append((platform, device))
    if not candidates:
        if seen:
            why = f"ENGINE_OPENCL_DEVICES={selection!r} matches none of: {'; '.join(seen)}"
        else:
            names = ", ".join(p.name for p in platforms) or "none"
            why = f"no OpenCL device on the installed platform(s) ({names}); {INSTALL_HINT}"
        return [], Availability(False, reason="; ".join([why, *problems]))
    usable: list[OpenCLDevice] = []
    for platform, device in candidates:
        align = max(1, device.mem_base_addr_align // 8)
        if alignment % align:
            problems.append(f"{platform.name} / {device.name} needs sub-buffers aligned to {align} bytes "
                            f"(MEM_BASE_ADDR_ALIGN), the backend aligns to {alignment}: set "
                            f"ENGINE_OPENCL_ALIGNMENT={align} to use it")
            continue
        try:
            context = cl.Context([device])
        except cl.Error as exc:
            problems.append(f"{platform.name} / {device.name}: cannot create a context: {exc}")
            continue
        if platform.name == POCL_PLATFORM and (why := _pocl_cannot_compile(cl, context)):
            problems.append(f"{platform.name} / {device.name}: {why}")
            continue
        usable.append(OpenCLDevice(len(usable), platform, device, context))
    reason = "; ".join(problems) or None
    if not usable:
        return [], Availability(False, reason=reason)
    drivers = ", ".join(dict.fromkeys(d.driver for d in usable))
    return usable, Availability(True, len(usable), tuple(d.name for d in usable), reason=reason, driver=drivers)
