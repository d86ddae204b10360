"""A fake CUDA-like driver for control-flow tests of ``engine.backend.gpu`` and the GPU plugins.

It implements ``engine.backend.gpu.Driver`` in memory: handles are counters, launches are recorded
with the parameter bytes read through the ``void **`` array the real driver would read, and each
way a real driver fails can be switched on. Tests that use it check *control flow only* (which
reason, which message, which call order); they are never evidence that a plugin works on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from engine.backend.gpu import DriverError, DriverMissing
from gpu_abi import read_kernel_params

__all__ = ["FakeDriver"]


class FakeDriver:
    """See the module docstring. ``devices``: ``(name, (major, minor))`` pairs."""

    name = "CUDA driver"

    def __init__(self, *, devices: Sequence[tuple[str, tuple[int, int]]] = (("Fake GPU", (9, 0)),),
                 version: int = 12080, missing: str | None = None, init_error: str | None = None,
                 context_error: str | None = None, module_error: str | None = None,
                 param_counts: dict[str, int] | None = None, launch_status: int = 0,
                 sync_status: int = 0):
        self.devices = list(devices)
        self._version = version
        self.missing, self.init_error, self.context_error = missing, init_error, context_error
        self.module_error = module_error
        self.param_counts = dict(param_counts or {})
        self.launch_status, self.sync_status = launch_status, sync_status
        self.calls: list[tuple[Any, ...]] = []
        self.launches: list[dict[str, Any]] = []
        self.modules: dict[int, bytes] = {}
        self.functions: dict[int, str] = {}
        self.capturing: set[int] = set()
        self.freed: list[tuple[int, int]] = []
        self._next = 0x10000

    def _handle(self) -> int:
        self._next += 0x100
        return self._next

    def _err(self, call: str, name: str) -> DriverError:
        return DriverError(call, 999, name)

    def load(self) -> None:
        self.calls.append(("load",))
        if self.missing:
            raise DriverMissing(self.missing)
        if self.init_error:
            raise self._err("cuInit", self.init_error)

    def version(self) -> int:
        return self._version

    def device_count(self) -> int:
        return len(self.devices)

    def device_name(self, index: int) -> str:
        return self.devices[index][0]

    def device_arch(self, index: int) -> tuple[int, int]:
        return self.devices[index][1]

    def activate(self, index: int) -> None:
        self.calls.append(("activate", index))
        if self.context_error:
            raise self._err("cuDevicePrimaryCtxRetain", self.context_error)

    def stream_create(self) -> int:
        handle = self._handle()
        self.calls.append(("stream_create", handle))
        return handle

    def stream_destroy(self, stream: int) -> None:
        self.calls.append(("stream_destroy", stream))

    def stream_synchronize(self, stream: int) -> None:
        self.calls.append(("stream_synchronize", stream))
        if self.sync_status:
            raise DriverError("cuStreamSynchronize", self.sync_status, self.error_name(self.sync_status))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.calls.append(("stream_wait_event", stream, event))

    def stream_is_capturing(self, stream: int) -> bool:
        return stream in self.capturing

    def device_synchronize(self) -> None:
        self.calls.append(("device_synchronize",))

    def event_create(self) -> int:
        return self._handle()

    def event_destroy(self, event: int) -> None:
        pass

    def event_record(self, event: int, stream: int) -> None:
        self.calls.append(("event_record", event, stream))

    def event_synchronize(self, event: int) -> None:
        self.calls.append(("event_synchronize", event))

    def event_query(self, event: int) -> bool:
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return 0.5

    def pool_prepare(self, index: int) -> int:
        self.calls.append(("pool_prepare", index))
        return self._handle()

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        self.calls.append(("alloc_async", nbytes, stream))
        return self._handle()

    def free_async(self, ptr: int, stream: int, index: int) -> None:
        self.freed.append((ptr, stream))

    def copy_htod(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy_htod", dst, nbytes, stream))

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy_dtoh", src, nbytes, stream))

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy_dtod", dst, src, nbytes, stream))

    def memset8(self, dst: int, value: int, nbytes: int, stream: int) -> None:
        self.calls.append(("memset8", dst, value, nbytes, stream))

    def module_load(self, image: bytes) -> int:
        self.calls.append(("module_load", len(image)))
        if self.module_error:
            raise self._err("cuModuleLoadData", self.module_error)
        handle = self._handle()
        self.modules[handle] = bytes(image)
        return handle

    def module_unload(self, module: int) -> None:
        self.modules.pop(module, None)

    def module_function(self, module: int, entry: str) -> int:
        if entry not in self.param_counts:
            raise self._err("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND")
        handle = self._handle()
        self.functions[handle] = entry
        return handle

    def launcher(self, function: int, dims: Any, stream: int, params: int) -> Callable[[], int]:
        return functools.partial(self._launch, function, tuple(dims), stream, params)

    def _launch(self, function: int, dims: tuple[int, ...], stream: int, params: int) -> int:
        entry = self.functions[function]
        data = read_kernel_params(params, [8] * self.param_counts[entry])
        self.launches.append({"entry": entry, "dims": dims, "stream": stream, "params": data,
                              "captured": stream in self.capturing})
        return self.launch_status

    def error_name(self, code: int) -> str:
        return {1: "CUDA_ERROR_INVALID_VALUE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS"}.get(code, f"CUresult {code}")

    def capture_begin(self, stream: int) -> None:
        self.calls.append(("capture_begin", stream))
        self.capturing.add(stream)

    def capture_end(self, stream: int) -> int:
        self.calls.append(("capture_end", stream))
        self.capturing.discard(stream)
        return self._handle()

    def graph_instantiate(self, graph: int) -> int:
        self.calls.append(("graph_instantiate", graph))
        return self._handle()

    def graph_destroy(self, graph: int) -> None:
        self.calls.append(("graph_destroy", graph))

    def graph_exec_destroy(self, graph_exec: int) -> None:
        self.calls.append(("graph_exec_destroy", graph_exec))

    def graph_launcher(self, graph_exec: int) -> Callable[[int], int]:
        def launch(stream: int) -> int:
            self.calls.append(("graph_launch", graph_exec, stream))
            return 0
        return launch
