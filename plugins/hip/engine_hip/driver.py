"""``HipDriver``: the ``engine.backend.gpu.Driver`` calls over hip-python's ``hip.hip``.

The HIP counterpart of ``engine_cuda.driver``: nothing is imported or initialised until ``load()``
(the plugin hook builds the backend at discovery and must not touch the runtime). Each call checks
the ``hipError_t``: a failure raises ``DriverError`` with the function and the status name
(``hipModuleLoadData failed: hipErrorInvalidImage (200)``), a status meaning a kernel faulted
raises ``DeviceFault`` (also a ``KernelError``), and out-of-memory on an allocation raises
``MemoryError`` (the core turns it into ``OutOfMemoryError``).

HIP has no separate driver API: the runtime's device is current per thread (``hipSetDevice``), and
its primary context is the one torch's ROCm build uses, so pointers and streams are shared.
hip-python accepts plain ``int`` addresses for every handle and for ``kernelParams`` and returns
handle objects that convert with ``int()``, so the shared layer's int handles pass straight through.

hip-python's major version must match the ROCm runtime's (the 6.x bindings call the ROCm 6
``hipGetDevicePropertiesR0600`` layout, and the 7.x line follows ROCm 7): ``version_mismatch``
names the line to install when they differ. Untested on an AMD GPU (docs/hip.md).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from engine.backend.gpu.driver import DeviceFault, DriverError, DriverMissing, LaunchDims3

__all__ = ["HipDriver", "FAULT_NAMES", "hip_version_text", "bindings_major"]

#: Statuses that mean a kernel faulted on the device (the runtime is unusable afterwards).
FAULT_NAMES = frozenset({
    "hipErrorIllegalAddress", "hipErrorLaunchFailure", "hipErrorIllegalInstruction",
    "hipErrorMisalignedAddress", "hipErrorInvalidAddressSpace", "hipErrorInvalidPc", "hipErrorAssert",
    "hipErrorHardwareStackError", "hipErrorLaunchTimeOut",
})

_LIBRARY = "libamdhip64.so"


def hip_version_text(version: int) -> str:
    """``60443483`` → ``"6.4"`` (HIP_VERSION: 10,000,000 * major + 100,000 * minor + patch)."""
    return f"{version // 10_000_000}.{version // 100_000 % 100}"


def bindings_major() -> int | None:
    """The major version of the installed hip-python (``7`` for 7.2.2.562.43), or None if absent."""
    from importlib import metadata

    try:
        return int(metadata.version("hip-python").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


class HipDriver:
    """``engine.backend.gpu.Driver`` for HIP (see the module docstring)."""

    name = "HIP runtime"

    def __init__(self) -> None:
        self._hip: Any = None
        self._lock = threading.Lock()
        self._no_device = False
        self._local = threading.local()
        self._props: dict[int, Any] = {}

    # -- plumbing ------------------------------------------------------------------------------
    def _check(self, call: str, result: Any) -> Any:
        if not isinstance(result, tuple):
            result = (result,)
        err = result[0]
        if int(err) != 0:
            self._raise(call, int(err))
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _raise(self, call: str, code: int) -> None:
        name = self.error_name(code)
        if name == "hipErrorOutOfMemory" and call.startswith("hipMalloc"):
            raise MemoryError(f"{call}: {name}")
        if name in FAULT_NAMES:
            raise DeviceFault(call, code, name, "a kernel queued earlier faulted on the device; the HIP runtime is "
                                                "unusable until the process restarts; set ENGINE_HIP_SYNC=1 to "
                                                "report the faulting kernel at its launch")
        raise DriverError(call, code, name)

    def error_name(self, code: int) -> str:
        hip = self._hip
        try:
            return str(hip.hipError_t(code).name)
        except Exception:  # noqa: BLE001 - an unknown code still gets a name
            return f"hipError_t {code}"

    # -- process and devices -----------------------------------------------------------------
    def load(self) -> None:
        if self._hip is not None:
            return
        with self._lock:
            if self._hip is not None:
                return
            try:
                from hip import hip
            except ImportError as exc:
                raise DriverMissing(f"the hip-python package cannot be imported ({exc}): pip install "
                                    f"'engine-hip[rocm6]' or 'engine-hip[rocm7]' (the ROCm runtime's major)") from exc
            try:
                err = hip.hipInit(0)[0]
            except RuntimeError as exc:  # hip-python raises this when libamdhip64.so cannot be opened
                raise DriverMissing(f"no ROCm runtime library: {_LIBRARY} cannot be loaded "
                                    f"({_dlopen_failure() or exc})") from exc
            self._hip = hip
            name = self.error_name(int(err))
            if name in ("hipErrorNoDevice", "hipErrorInvalidDevice"):
                self._no_device = True  # hipInit reports a machine without a GPU this way (ROCm 5.x: Invalid)
            elif int(err) != 0:
                self._hip = None
                raise DriverError("hipInit", int(err), name)

    def version(self) -> int:
        return int(self._check("hipRuntimeGetVersion", self._hip.hipRuntimeGetVersion()))

    def version_mismatch(self, version: int) -> str | None:
        """Why the installed hip-python does not fit a runtime of ``version``, or None."""
        major, runtime_major = bindings_major(), version // 10_000_000
        if major is None or major == runtime_major:
            return None
        return (f"hip-python {major}.x is installed but the ROCm runtime is {hip_version_text(version)}: the "
                f"bindings' major must match the runtime's: pip install 'hip-python>={runtime_major},"
                f"<{runtime_major + 1}'")

    def device_count(self) -> int:
        if self._no_device:
            return 0
        try:
            return int(self._check("hipGetDeviceCount", self._hip.hipGetDeviceCount()))
        except DriverError as exc:
            if exc.name == "hipErrorNoDevice":
                return 0
            raise

    def _properties(self, index: int) -> Any:
        props = self._props.get(index)
        if props is None:
            hip = self._hip
            props = hip.hipDeviceProp_t()
            self._check("hipGetDeviceProperties", hip.hipGetDeviceProperties(props, index))
            self._props[index] = props
        return props

    def device_name(self, index: int) -> str:
        """The marketing name and the gfx architecture: ``AMD Instinct MI300X (gfx942:sramecc+:xnack-)``."""
        return f"{_text(self._properties(index).name)} ({self.arch_name(index)})"

    def arch_name(self, index: int) -> str:
        """The device's ``gcnArchName``: the gfx target and its features (``gfx90a:sramecc+:xnack-``)."""
        return _text(self._properties(index).gcnArchName)

    def device_arch(self, index: int) -> tuple[int, int]:
        props = self._properties(index)
        return int(props.major), int(props.minor)

    def activate(self, index: int) -> None:
        """Make ``index`` the calling thread's device (HIP's primary context for it)."""
        self._check("hipSetDevice", self._hip.hipSetDevice(index))
        self._local.active = index

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self) -> int:
        hip = self._hip
        return int(self._check("hipStreamCreateWithFlags", hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking)))

    def stream_destroy(self, stream: int) -> None:
        self._check("hipStreamDestroy", self._hip.hipStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("hipStreamSynchronize", self._hip.hipStreamSynchronize(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("hipStreamWaitEvent", self._hip.hipStreamWaitEvent(stream, event, 0))

    def stream_is_capturing(self, stream: int) -> bool:
        status = self._check("hipStreamIsCapturing", self._hip.hipStreamIsCapturing(stream))
        return status != self._hip.hipStreamCaptureStatus.hipStreamCaptureStatusNone

    def device_synchronize(self) -> None:
        self._check("hipDeviceSynchronize", self._hip.hipDeviceSynchronize())

    def event_create(self) -> int:
        return int(self._check("hipEventCreate", self._hip.hipEventCreate()))

    def event_destroy(self, event: int) -> None:
        self._check("hipEventDestroy", self._hip.hipEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        self._check("hipEventRecord", self._hip.hipEventRecord(event, stream))

    def event_synchronize(self, event: int) -> None:
        self._check("hipEventSynchronize", self._hip.hipEventSynchronize(event))

    def event_query(self, event: int) -> bool:
        err = int(self._hip.hipEventQuery(event)[0])
        if err != 0 and self.error_name(err) == "hipErrorNotReady":
            return False
        if err != 0:
            self._raise("hipEventQuery", err)
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._check("hipEventElapsedTime", self._hip.hipEventElapsedTime(start, end)))

    # -- memory --------------------------------------------------------------------------------
    def pool_prepare(self, index: int) -> int:
        hip = self._hip
        pool = self._check("hipDeviceGetDefaultMemPool", hip.hipDeviceGetDefaultMemPool(index))
        threshold = hip.hipMemPoolAttr.hipMemPoolAttrReleaseThreshold
        value = _uint64(2**64 - 1)
        self._check("hipMemPoolSetAttribute", hip.hipMemPoolSetAttribute(pool, threshold, value))
        return int(pool)

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        return int(self._check("hipMallocFromPoolAsync", self._hip.hipMallocFromPoolAsync(nbytes, pool, stream)))

    def free_async(self, ptr: int, stream: int, index: int) -> None:
        if getattr(self._local, "active", None) is None:  # a finaliser on a thread that never used the GPU
            self.activate(index)
        self._check("hipFreeAsync", self._hip.hipFreeAsync(ptr, stream))

    def copy_htod(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        self._check("hipMemcpyHtoDAsync", self._hip.hipMemcpyHtoDAsync(dst, src_host, nbytes, stream))

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: int) -> None:
        self._check("hipMemcpyDtoHAsync", self._hip.hipMemcpyDtoHAsync(dst_host, src, nbytes, stream))

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check("hipMemcpyDtoDAsync", self._hip.hipMemcpyDtoDAsync(dst, src, nbytes, stream))

    def memset8(self, dst: int, value: int, nbytes: int, stream: int) -> None:
        self._check("hipMemsetD8Async", self._hip.hipMemsetD8Async(dst, value, nbytes, stream))

    # -- modules and launches ------------------------------------------------------------------
    def module_load(self, image: bytes) -> int:
        return int(self._check("hipModuleLoadData", self._hip.hipModuleLoadData(image)))

    def module_unload(self, module: int) -> None:
        self._check("hipModuleUnload", self._hip.hipModuleUnload(module))

    def module_function(self, module: int, entry: str) -> int:
        return int(self._check("hipModuleGetFunction", self._hip.hipModuleGetFunction(module, entry.encode())))

    def launcher(self, function: int, dims: LaunchDims3, stream: int, params: int) -> Callable[[], int]:
        hip = self._hip
        gx, gy, gz, bx, by, bz, shared = (int(d) for d in dims)
        return _launcher(hip.hipModuleLaunchKernel, hip.ihipModuleSymbol_t.fromObj(function), gx, gy, gz, bx, by, bz,
                         shared, hip.ihipStream_t.fromObj(stream), int(params))

    # -- capture -------------------------------------------------------------------------------
    def capture_begin(self, stream: int) -> None:
        hip = self._hip
        self._check("hipStreamBeginCapture", hip.hipStreamBeginCapture(
            stream, hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal))

    def capture_end(self, stream: int) -> int:
        return int(self._check("hipStreamEndCapture", self._hip.hipStreamEndCapture(stream)))

    def graph_instantiate(self, graph: int) -> int:
        return int(self._check("hipGraphInstantiate", self._hip.hipGraphInstantiate(graph, None, 0)))

    def graph_destroy(self, graph: int) -> None:
        self._check("hipGraphDestroy", self._hip.hipGraphDestroy(graph))

    def graph_exec_destroy(self, graph_exec: int) -> None:
        self._check("hipGraphExecDestroy", self._hip.hipGraphExecDestroy(graph_exec))

    def graph_launcher(self, graph_exec: int) -> Callable[[int], int]:
        hip = self._hip
        launch, handle, stream_type = hip.hipGraphLaunch, hip.hipGraphExec.fromObj(graph_exec), hip.ihipStream_t

        def replay(stream: int) -> int:
            return int(launch(handle, stream_type.fromObj(stream))[0])

        return replay


def _launcher(launch: Any, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
              stream: Any, params: int) -> Callable[[], int]:
    """``hipModuleLaunchKernel`` with every argument bound (a closure: its variables load fastest)."""

    def call() -> int:
        return int(launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, None)[0])

    return call


def _uint64(value: int) -> Any:
    """A ``uint64_t`` the runtime reads through a ``void *`` (the release threshold's value)."""
    import ctypes

    return ctypes.c_uint64(value)


def _text(raw: Any) -> str:
    data = raw if isinstance(raw, (bytes, bytearray)) else str(raw).encode()
    return bytes(data).split(b"\0", 1)[0].decode(errors="replace").strip()


def _dlopen_failure() -> str | None:
    """The dynamic loader's own reason for not opening the runtime library (hip-python's message
    shows it as Python bytes reprs), or ``None`` when it opens."""
    import ctypes

    try:
        ctypes.CDLL(_LIBRARY)
    except OSError as exc:
        return str(exc)
    return None
