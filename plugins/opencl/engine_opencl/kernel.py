"""A loaded candidate and its prepared launches: the OpenCL kernel ABI (``docs/opencl.md``).

Arguments, in order: one ``__global`` pointer per tensor (inputs, then outputs), one ``long`` per
symbol (``spec.symbols`` order), then, when the candidate has a workspace, one ``__global``
pointer to it (NULL when it is empty). The global size is ``grid * block``, the local size
``block``. A tensor at a non-zero offset of its buffer is passed as a sub-buffer starting there.

``cl.Kernel`` objects hold their arguments, so each ``PreparedLaunch`` owns one: a launch
prepared on one thread is never disturbed by another's ``set_tensor``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn

from engine.backend import BinaryPayload, CandidateSpec, KernelBase, LaunchDims
from engine.errors import KernelError

from engine_opencl.devices import OpenCLDevice
from engine_opencl.memory import kernel_buffer
from engine_opencl.queues import Queue

__all__ = ["OpenCLKernel", "OpenCLLaunch"]


class OpenCLKernel(KernelBase):
    """One candidate's entry in a built program, for one device."""

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload, program: Any, device: OpenCLDevice,
                 queue_for: Callable[[Any], Queue]):
        super().__init__(spec, binary)
        self.program = program
        self.device = device
        self.device_name = f"opencl:{device.index} ({device.name})"
        self._queue_for = queue_for

    def _prepare(self, tensors: list[Any], symbol_values: list[int], workspace: Any, stream: Any,
                 dims: LaunchDims | None) -> "OpenCLLaunch":
        assert dims is not None  # every loaded candidate has a launch configuration (checked at load)
        return OpenCLLaunch(self, self._queue_for(stream), tensors, symbol_values, workspace, dims)


class OpenCLLaunch:
    """A ``PreparedLaunch``: ``call()`` enqueues the kernel and returns 0, or the negated OpenCL
    error code, whose message ``fail`` reports."""

    __slots__ = ("kernel", "queue", "call", "_cl_kernel", "_ptrs", "_held", "_global", "_local", "_error",
                 "_launch", "_driver_error")

    def __init__(self, kernel: OpenCLKernel, queue: Queue, tensors: list[Any], symbol_values: list[int],
                 workspace: Any, dims: LaunchDims):
        import numpy as np
        import pyopencl as cl

        self.kernel = kernel
        self.queue = queue
        self._cl_kernel = cl.Kernel(kernel.program, kernel.spec.entry)
        # What each tensor argument is bound to; sub-buffers must live as long as they are bound.
        self._ptrs: list[Any] = [None] * len(tensors)
        self._held: list[Any] = [None] * len(tensors)
        self._error = ""
        for i, ptr in enumerate(tensors):
            self.set_tensor(i, ptr)
        spec, n = kernel.spec, len(tensors)
        args = [(f"symbol {name!r}", np.int64(v)) for name, v in zip(spec.symbols, symbol_values)]
        if spec.has_workspace:
            args.append(("the workspace", self._buffer(workspace, "the workspace")))
        for j, (what, value) in enumerate(args, n):
            self._set(j, value, what)
        self._global, self._local = dims.global_size, dims.block
        # Bound once: the fast path is this partial plus the error check.
        self._launch = functools.partial(cl.enqueue_nd_range_kernel, queue.queue, self._cl_kernel, self._global,
                                         self._local)
        self._driver_error = cl.Error
        # An empty grid launches nothing (OpenCL 1.2 refuses a zero global size).
        self.call: Callable[[], int] = self._enqueue if all(self._global) else _nothing

    def set_tensor(self, index: int, ptr: Any) -> None:
        if ptr is not None and self._ptrs[index] is ptr:
            return  # the same pointer object as last run (a graph input passed again): already bound
        mem = self._buffer(ptr, f"tensor argument {index}")
        self._set(index, mem, f"tensor argument {index}")
        self._ptrs[index], self._held[index] = ptr, mem

    def _buffer(self, ptr: Any, what: str) -> Any:
        for bound, mem in zip(self._ptrs, self._held):
            if bound is not None and bound == ptr:
                # One cl_mem for one address: two overlapping sub-buffers in one launch (an in-place
                # kernel's input and output) are undefined behaviour in OpenCL.
                return mem
        try:
            return kernel_buffer(ptr, self.kernel.device.base_align)
        except ValueError as exc:
            raise KernelError(f"{self.kernel.spec.describe()} on {self.kernel.device_name}: {what}: {exc}") from exc

    def _set(self, index: int, value: Any, what: str) -> None:
        import pyopencl as cl

        try:
            self._cl_kernel.set_arg(index, value)
        except cl.Error as exc:
            raise KernelError(f"{self.kernel.spec.describe()} on {self.kernel.device_name}: cannot set argument "
                              f"{index} ({what}): {exc}; see the opencl kernel ABI in docs/opencl.md") from exc

    def _enqueue(self) -> int:
        try:
            self._launch()
        except self._driver_error as exc:
            self._error = str(exc)
            return -exc.code if exc.code < 0 else (exc.code or -1)
        return 0

    def fail(self, code: int) -> NoReturn:
        raise KernelError(f"{self.kernel.spec.describe()} on {self.kernel.device_name}: launch failed with OpenCL "
                          f"error {-code}: {self._error or 'no message'} (global size {self._global}, "
                          f"local size {self._local})")

    def __repr__(self) -> str:
        return f"<OpenCLLaunch {self.kernel.spec.describe()} on {self.kernel.device_name}>"


def _nothing() -> int:
    return 0
