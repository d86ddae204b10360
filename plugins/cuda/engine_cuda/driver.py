"""``CudaDriver``: the ``engine.backend.gpu.Driver`` calls over ``cuda.bindings.driver``.

Nothing is imported or initialised until ``load()`` (the plugin hook builds the backend at
discovery and must not touch the driver). Each call checks the ``CUresult``: a failure raises
``DriverError`` with the function and the status name (``cuModuleLoadData failed:
CUDA_ERROR_INVALID_PTX (218)``), a status meaning a kernel faulted raises ``DeviceFault`` (also a
``KernelError``), and out-of-memory on an allocation raises ``MemoryError`` (the core turns it
into ``OutOfMemoryError``).

The two calls on the hot path, ``cuLaunchKernel`` and ``cuGraphLaunch``, are closures made once per
prepared launch over the bindings' function, the ``CUfunction``/``CUstream`` objects (the bindings'
fast path: no handle conversion per call) and the address of the argument block's ``void **`` array
(passed as an ``int``, used as is). A call is one Python frame around the bindings' call and returns
the ``CUresult`` (an ``int`` enum, 0 on success). This beat ``ctypes`` over the same ``libcuda``:
ctypes converts eleven arguments per call, the bindings' Cython wrapper less.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from engine.backend.gpu.driver import DeviceFault, DriverError, DriverMissing, LaunchDims3

__all__ = ["CudaDriver", "FAULT_NAMES"]

#: Statuses that mean a kernel faulted on the device (sticky: the context is unusable afterwards).
FAULT_NAMES = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_ASSERT", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_LAUNCH_TIMEOUT",
})

_LIBCUDA = "libcuda.so.1"


class CudaDriver:
    """``engine.backend.gpu.Driver`` for CUDA (see the module docstring)."""

    name = "CUDA driver"

    def __init__(self) -> None:
        self._cu: Any = None
        self._lock = threading.Lock()
        self._devices: dict[int, Any] = {}
        self._contexts: dict[int, Any] = {}
        self._no_device = False
        self._local = threading.local()

    # -- plumbing ------------------------------------------------------------------------------
    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        err = result[0]
        if err != 0:
            self._raise(call, int(err))
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _raise(self, call: str, code: int) -> None:
        name = self.error_name(code)
        if name == "CUDA_ERROR_OUT_OF_MEMORY" and call.startswith("cuMemAlloc"):
            raise MemoryError(f"{call}: {name}")
        if name in FAULT_NAMES:
            raise DeviceFault(call, code, name, "a kernel queued earlier faulted on the device; the CUDA context "
                                                "is unusable until the process restarts; set ENGINE_CUDA_SYNC=1 to "
                                                "report the faulting kernel at its launch")
        raise DriverError(call, code, name)

    def error_name(self, code: int) -> str:
        cu = self._cu
        try:
            err, name = cu.cuGetErrorName(cu.CUresult(code))
            if err == 0 and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - an unknown code still gets a name below
            pass
        return f"CUresult {code}"

    # -- process and devices -----------------------------------------------------------------
    def load(self) -> None:
        if self._cu is not None:
            return
        with self._lock:
            if self._cu is not None:
                return
            try:
                from cuda.bindings import driver as cu
            except ImportError as exc:
                raise DriverMissing(f"the cuda-bindings package cannot be imported ({exc}): "
                                    f"pip install 'engine-cuda[cu12]' or 'engine-cuda[cu13]'") from exc
            try:
                (err,) = cu.cuInit(0)
            except RuntimeError as exc:  # the bindings raise this when libcuda cannot be opened
                raise DriverMissing(f"no CUDA driver library: {_LIBCUDA} cannot be loaded ({exc})") from exc
            self._cu = cu
            if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
                self._no_device = True
            elif err != 0:
                self._cu = None
                raise DriverError("cuInit", int(err), _name_of(cu, int(err)))

    def version(self) -> int:
        return int(self._check("cuDriverGetVersion", self._cu.cuDriverGetVersion()))

    def device_count(self) -> int:
        if self._no_device:
            return 0
        return int(self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount()))

    def _device(self, index: int) -> Any:
        dev = self._devices.get(index)
        if dev is None:
            dev = self._devices[index] = self._check("cuDeviceGet", self._cu.cuDeviceGet(index))
        return dev

    def device_name(self, index: int) -> str:
        raw = self._check("cuDeviceGetName", self._cu.cuDeviceGetName(256, self._device(index)))
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()

    def device_arch(self, index: int) -> tuple[int, int]:
        cu, dev = self._cu, self._device(index)
        attr = cu.CUdevice_attribute
        major = self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        return int(major), int(minor)

    def activate(self, index: int) -> None:
        """The device's primary context (the one the CUDA runtime, torch and CuPy use), retained once
        per process and made current in the calling thread."""
        ctx = self._contexts.get(index)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(index)
                if ctx is None:
                    ctx = self._contexts[index] = self._check("cuDevicePrimaryCtxRetain",
                                                              self._cu.cuDevicePrimaryCtxRetain(self._device(index)))
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(ctx))
        self._local.active = index

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self) -> int:
        cu = self._cu
        return int(self._check("cuStreamCreate", cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))))

    def stream_destroy(self, stream: int) -> None:
        self._check("cuStreamDestroy", self._cu.cuStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._cu.cuStreamSynchronize(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cuStreamWaitEvent", self._cu.cuStreamWaitEvent(stream, event, 0))

    def stream_is_capturing(self, stream: int) -> bool:
        status = self._check("cuStreamIsCapturing", self._cu.cuStreamIsCapturing(stream))
        return status != self._cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def device_synchronize(self) -> None:
        self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())

    def event_create(self) -> int:
        return int(self._check("cuEventCreate", self._cu.cuEventCreate(int(self._cu.CUevent_flags.CU_EVENT_DEFAULT))))

    def event_destroy(self, event: int) -> None:
        self._check("cuEventDestroy", self._cu.cuEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._cu.cuEventRecord(event, stream))

    def event_synchronize(self, event: int) -> None:
        self._check("cuEventSynchronize", self._cu.cuEventSynchronize(event))

    def event_query(self, event: int) -> bool:
        (err,) = self._cu.cuEventQuery(event)
        if err == self._cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != 0:
            self._raise("cuEventQuery", int(err))
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._check("cuEventElapsedTime", self._cu.cuEventElapsedTime(start, end)))

    # -- memory --------------------------------------------------------------------------------
    def pool_prepare(self, index: int) -> int:
        cu = self._cu
        pool = self._check("cuDeviceGetDefaultMemPool", cu.cuDeviceGetDefaultMemPool(self._device(index)))
        self._check("cuMemPoolSetAttribute", cu.cuMemPoolSetAttribute(
            pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(2**64 - 1)))
        return int(pool)

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        return int(self._check("cuMemAllocFromPoolAsync", self._cu.cuMemAllocFromPoolAsync(nbytes, pool, stream)))

    def free_async(self, ptr: int, stream: int, index: int) -> None:
        if getattr(self._local, "active", None) is None:  # a finaliser on a thread that never used the GPU
            self.activate(index)
        self._check("cuMemFreeAsync", self._cu.cuMemFreeAsync(ptr, stream))

    def copy_htod(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        self._check("cuMemcpyHtoDAsync", self._cu.cuMemcpyHtoDAsync(dst, src_host, nbytes, stream))

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: int) -> None:
        self._check("cuMemcpyDtoHAsync", self._cu.cuMemcpyDtoHAsync(dst_host, src, nbytes, stream))

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check("cuMemcpyDtoDAsync", self._cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream))

    def memset8(self, dst: int, value: int, nbytes: int, stream: int) -> None:
        self._check("cuMemsetD8Async", self._cu.cuMemsetD8Async(dst, value, nbytes, stream))

    # -- modules and launches ------------------------------------------------------------------
    def module_load(self, image: bytes) -> int:
        return int(self._check("cuModuleLoadData", self._cu.cuModuleLoadData(image)))

    def module_unload(self, module: int) -> None:
        self._check("cuModuleUnload", self._cu.cuModuleUnload(module))

    def module_function(self, module: int, entry: str) -> int:
        return int(self._check("cuModuleGetFunction", self._cu.cuModuleGetFunction(module, entry.encode())))

    def launcher(self, function: int, dims: LaunchDims3, stream: int, params: int) -> Callable[[], int]:
        cu = self._cu
        gx, gy, gz, bx, by, bz, shared = (int(d) for d in dims)
        return _launcher(cu.cuLaunchKernel, cu.CUfunction(function), gx, gy, gz, bx, by, bz, shared,
                         cu.CUstream(stream), int(params))

    # -- capture -------------------------------------------------------------------------------
    def capture_begin(self, stream: int) -> None:
        cu = self._cu
        self._check("cuStreamBeginCapture", cu.cuStreamBeginCapture(
            stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))

    def capture_end(self, stream: int) -> int:
        return int(self._check("cuStreamEndCapture", self._cu.cuStreamEndCapture(stream)))

    def graph_instantiate(self, graph: int) -> int:
        return int(self._check("cuGraphInstantiate", self._cu.cuGraphInstantiate(graph, 0)))

    def graph_destroy(self, graph: int) -> None:
        self._check("cuGraphDestroy", self._cu.cuGraphDestroy(graph))

    def graph_exec_destroy(self, graph_exec: int) -> None:
        self._check("cuGraphExecDestroy", self._cu.cuGraphExecDestroy(graph_exec))

    def graph_launcher(self, graph_exec: int) -> Callable[[int], int]:
        launch, handle, stream_type = self._cu.cuGraphLaunch, self._cu.CUgraphExec(graph_exec), self._cu.CUstream

        def replay(stream: int) -> int:
            return launch(handle, stream_type(stream))[0]

        return replay


def _launcher(launch: Any, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
              stream: Any, params: int) -> Callable[[], int]:
    """``cuLaunchKernel`` with every argument bound (a closure: its variables load fastest)."""

    def call() -> int:
        return launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, 0)[0]

    return call


def _name_of(cu: Any, code: int) -> str:
    try:
        err, name = cu.cuGetErrorName(cu.CUresult(code))
        if err == 0 and name:
            return name.decode()
    except Exception:  # noqa: BLE001
        pass
    return f"CUresult {code}"
