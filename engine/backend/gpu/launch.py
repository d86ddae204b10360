"""Loaded GPU kernels and their prepared launches.

``GpuKernel._prepare`` builds the launch once: an ``ArgumentBlock`` in the ABI's layout, the launch
dimensions the core evaluated, the stream, and the driver's ``launcher`` (a partial over the
foreign launch function). The core's fast path then calls ``set_tensor`` (the block's own
``__setitem__``) and ``call`` (the launcher itself): no Python object is built per launch.

A non-zero status from ``call`` goes to ``fail``, which raises a ``KernelError`` naming the kernel,
the candidate, the device and the driver's name for the status. Faults that happen later on the
device are reported by the next call that synchronises (``DeviceFault``). In *debug mode* each
launch is followed by a wait on its stream and a check, so a fault names the kernel that caused it
(skipped while the stream is being captured, where waiting is not allowed).

A launch with an empty grid (a batch of 0) is not sent to the driver, which would refuse it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, NoReturn

from engine.backend.base import KernelBase
from engine.backend.contract import BinaryPayload, CandidateSpec, LaunchDims
from engine.backend.gpu.abi import ArgumentBlock
from engine.backend.gpu.driver import Driver, DriverError
from engine.errors import KernelError

__all__ = ["GpuKernel", "PreparedGpuLaunch", "Module"]


class Module:
    """A loaded code object; unloaded when the last kernel using it is collected."""

    __slots__ = ("driver", "handle", "device_index", "__weakref__")

    def __init__(self, driver: Driver, handle: int, device_index: int):
        self.driver, self.handle, self.device_index = driver, handle, device_index
        weakref.finalize(self, _unload, driver, handle)


def _unload(driver: Driver, handle: int) -> None:
    try:
        driver.module_unload(handle)
    except Exception:  # noqa: BLE001 - the driver may be gone at interpreter exit
        pass


def _no_launch() -> int:
    return 0


def _checked(launch: Callable[[], int], driver: Driver, stream: int) -> int:
    """Debug mode: launch, then wait for the stream and return the first failure's status."""
    code = launch()
    if code:
        return code
    try:
        if not driver.stream_is_capturing(stream):
            driver.stream_synchronize(stream)
    except DriverError as exc:
        return exc.code or -1
    return 0


class PreparedGpuLaunch:
    """One bound launch (``engine.backend.PreparedLaunch``)."""

    __slots__ = ("call", "set_tensor", "block", "dims", "stream", "_kernel")

    def __init__(self, kernel: "GpuKernel", block: ArgumentBlock, dims: LaunchDims, stream: int,
                 call: Callable[[], int]):
        self._kernel = kernel
        self.block = block
        self.dims = dims
        self.stream = stream
        self.call = call
        self.set_tensor = block.set_tensor

    def fail(self, code: int) -> NoReturn:
        self._kernel.fail_launch(code, self.dims)


class GpuKernel(KernelBase):
    """A candidate's function in a loaded module (the module stays loaded while this lives)."""

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload, module: Module, function: int,
                 device_name: str, *, debug: bool = False):
        super().__init__(spec, binary)
        self.module = module
        self.function = function
        self.device_name = device_name
        self.debug = debug

    @property
    def driver(self) -> Driver:
        return self.module.driver

    def _prepare(self, tensors: list[Any], symbol_values: list[int], workspace: Any, stream: Any,
                 dims: LaunchDims | None) -> PreparedGpuLaunch:
        spec = self.spec
        if dims is None:
            raise KernelError(f"{spec.describe()}: has no launch configuration; {self.device_name} kernels need "
                              f"one (grid and block)")
        if min(dims.block) < 1 or min(dims.grid) < 0 or dims.shared_memory < 0:
            raise KernelError(f"{spec.describe()}: invalid launch dimensions grid={list(dims.grid)} "
                              f"block={list(dims.block)} shared_memory={dims.shared_memory} at symbols "
                              f"{dict(zip(spec.symbols, symbol_values))}")
        block = ArgumentBlock.filled(tensors, symbol_values, workspace, spec.has_workspace)
        stream = int(stream or 0)
        if min(dims.grid) == 0:
            call: Callable[[], int] = _no_launch
        else:
            call = self.driver.launcher(self.function, (*dims.grid, *dims.block, dims.shared_memory), stream,
                                        block.address)
            if self.debug:
                call = functools.partial(_checked, call, self.driver, stream)
        return PreparedGpuLaunch(self, block, dims, stream, call)

    def fail_launch(self, code: int, dims: LaunchDims | None = None) -> NoReturn:
        where = f" (grid={list(dims.grid)}, block={list(dims.block)}, shared_memory={dims.shared_memory})" if dims else ""
        raise KernelError(f"{self.spec.describe()} on {self.device_name}: launch failed: "
                          f"{self.driver.error_name(code)} ({code}){where}")

    def fail(self, code: int) -> NoReturn:
        self.fail_launch(code)
