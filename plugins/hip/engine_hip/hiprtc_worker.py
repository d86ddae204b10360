"""One hiprtc call in a process of its own: ``python -m engine_hip.hiprtc_worker`` (used by ``compiler``).

hiprtc can abort the process (an old ROCm's comgr asked for a target it does not know frees an
invalid pointer and dies with SIGABRT), so the plugin never calls it in the engine's process.
The request is one JSON object on stdin; the answer one JSON object on stdout:

* ``{"op": "info"}`` → ``{"library": path, "file": resolved file name, "version": "M.m"}``;
* ``{"op": "compile", "source": …, "options": […], "out": path}`` → ``{"ok": true, "log": …}``
  with the code object written to ``out``, or ``{"ok": false, "status": name, "log": …}``.

hiprtc is called through ``ctypes``, not hip-python's ``hip.hiprtc``: hip-python opens
``libhiprtc.so``, which ROCm 5.x (Debian 12's packages) does not have (its hiprtc is inside
``libamdhip64.so.5``), and the worker must also run where hip-python is not installed (a build
machine). ``ENGINE_HIPRTC_LIBRARY`` names the library explicitly; else ``LIBRARIES`` are tried in order,
in ``$ROCM_PATH/lib`` (default ``/opt/rocm/lib``) first, then on the loader's path.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

__all__ = ["LIBRARIES", "open_hiprtc", "main"]

#: hiprtc's own library (ROCm 6/7), then the runtime that carried it in ROCm 5.
LIBRARIES = ("libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so", "libamdhip64.so.5")


def open_hiprtc() -> tuple[ctypes.CDLL, str]:
    """The first library exporting ``hiprtcCompileProgram``; ``OSError`` listing what was tried."""
    explicit = os.environ.get("ENGINE_HIPRTC_LIBRARY")
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidates = [explicit] if explicit else [*(os.path.join(rocm, "lib", n) for n in LIBRARIES), *LIBRARIES]
    tried = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            tried.append(f"{name}: {exc}")
            continue
        if hasattr(lib, "hiprtcCompileProgram"):
            return lib, name
        tried.append(f"{name}: no hiprtcCompileProgram")
    raise OSError("; ".join(tried[-4:]) if explicit is None else tried[0])


def _library_file(lib: ctypes.CDLL, name: str) -> str:
    """The resolved file of a loaded library (``libamdhip64.so.5.2.21153``): its version for cache keys."""
    dl = ctypes.CDLL(None)
    info = (ctypes.c_void_p * 4)()
    try:
        dl.dladdr.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        address = ctypes.cast(lib.hiprtcCompileProgram, ctypes.c_void_p).value
        if dl.dladdr(address, info) and info[0]:
            return os.path.realpath(ctypes.string_at(info[0]).decode())
    except (AttributeError, OSError):
        pass
    return name


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.hiprtcGetProgramLog(prog, buf)
    return buf.value.decode("utf-8", "replace").strip()


def _status(lib: ctypes.CDLL, code: int) -> str:
    lib.hiprtcGetErrorString.restype = ctypes.c_char_p
    text = lib.hiprtcGetErrorString(code)
    return text.decode() if text else f"hiprtcResult {code}"


def _compile(lib: ctypes.CDLL, request: dict[str, Any]) -> dict[str, Any]:
    prog = ctypes.c_void_p()
    source = str(request["source"]).encode("utf-8")
    status = lib.hiprtcCreateProgram(ctypes.byref(prog), source, b"kernel.hip", 0, None, None)
    if status != 0:
        return {"ok": False, "status": _status(lib, status), "log": "hiprtcCreateProgram failed"}
    try:
        options = [str(o).encode() for o in request["options"]]
        argv = (ctypes.c_char_p * len(options))(*options)
        status = lib.hiprtcCompileProgram(prog, len(options), argv)
        log = _log(lib, prog)
        if status != 0:
            return {"ok": False, "status": _status(lib, status), "log": log}
        size = ctypes.c_size_t()
        status = lib.hiprtcGetCodeSize(prog, ctypes.byref(size))
        if status != 0 or size.value == 0:
            return {"ok": False, "status": _status(lib, status), "log": log or "hiprtc produced no code"}
        code = ctypes.create_string_buffer(size.value)
        lib.hiprtcGetCode(prog, code)
        with open(request["out"], "wb") as f:
            f.write(code.raw[:size.value])
        return {"ok": True, "log": log}
    finally:
        lib.hiprtcDestroyProgram(ctypes.byref(prog))


def main() -> int:
    try:  # an aborting hiprtc must not leave a core file in the caller's directory
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    request = json.loads(sys.stdin.read())
    try:
        lib, name = open_hiprtc()
    except OSError as exc:
        print(json.dumps({"missing": str(exc)}))
        return 0
    if request.get("op") == "info":
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor))
        print(json.dumps({"library": name, "file": os.path.basename(_library_file(lib, name)),
                          "version": f"{major.value}.{minor.value}"}))
        return 0
    print(json.dumps(_compile(lib, request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
