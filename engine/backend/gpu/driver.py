"""The calls a CUDA-like driver must provide: the whole vendor-specific surface of a GPU plugin.

``engine.backend.gpu`` does streams, events, pooled memory, argument blocks, launches and capture
once, over this Protocol; a vendor plugin (``engine-cuda`` over ``cuda.bindings.driver``, HIP next,
or a third party's CUDA-like driver) is an adapter that implements it. Every handle is a plain
``int`` (a ``CUstream``, ``CUevent``, ``CUfunction``… as an address), so the shared layer never
imports a vendor module and handles hash and compare as the core needs (``Backend.has_streams``).

Errors: every method raises ``DriverError`` (an ``EngineError``) naming the call and the driver's
own name for the status (``CUDA_ERROR_OUT_OF_MEMORY``), except where noted. The adapter must not
touch the driver when it is constructed: ``load()`` is the first call, made lazily.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from engine.errors import EngineError, KernelError

__all__ = ["Driver", "DriverError", "DeviceFault", "DriverMissing", "LaunchDims3"]

#: ``(grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_memory_bytes)``.
LaunchDims3 = tuple[int, int, int, int, int, int, int]


class DriverError(EngineError, RuntimeError):
    """A driver call failed. ``call`` is the driver function, ``code`` its status, ``name`` the
    status's name as the vendor spells it (``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, call: str, code: int, name: str, detail: str = ""):
        self.call, self.code, self.name, self.detail = call, int(code), name, detail
        super().__init__(f"{call} failed: {name} ({int(code)}){': ' + detail if detail else ''}")


class DeviceFault(DriverError, KernelError):
    """A kernel faulted on the device (illegal address, trap, launch failure) and the driver reports
    it at a later call; a ``KernelError`` too. The context is unusable afterwards (CUDA's sticky
    errors): the process must be restarted. Which kernel faulted is not known unless launches are
    checked one by one (the plugin's debug mode)."""


class DriverMissing(EngineError, RuntimeError):
    """The driver library or its Python bindings cannot be loaded (the message says which and why)."""


@runtime_checkable
class Driver(Protocol):
    """A CUDA-like driver, one device index space, handles as ints (see the module docstring)."""

    #: Shown in messages and ``engine devices``: ``"CUDA driver"``, ``"HIP runtime"``.
    name: str

    # -- process and devices -----------------------------------------------------------------
    def load(self) -> None:
        """Load the library and initialise the driver; ``DriverMissing`` when the library is absent."""

    def version(self) -> int:
        """The driver's API version as the vendor encodes it (CUDA: 1000 * major + 10 * minor)."""

    def device_count(self) -> int: ...

    def device_name(self, index: int) -> str: ...

    def device_arch(self, index: int) -> tuple[int, int]:
        """The compute capability ``(major, minor)`` (CUDA) or architecture numbers (HIP)."""

    def activate(self, index: int) -> None:
        """Make the device's primary context current in the calling thread (retained once)."""

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self) -> int:
        """A new non-blocking stream on the current device."""

    def stream_destroy(self, stream: int) -> None: ...

    def stream_synchronize(self, stream: int) -> None: ...

    def stream_wait_event(self, stream: int, event: int) -> None: ...

    def stream_is_capturing(self, stream: int) -> bool: ...

    def device_synchronize(self) -> None:
        """Wait for all work of the current device."""

    def event_create(self) -> int:
        """A new event that records timing."""

    def event_destroy(self, event: int) -> None: ...

    def event_record(self, event: int, stream: int) -> None: ...

    def event_synchronize(self, event: int) -> None: ...

    def event_query(self, event: int) -> bool:
        """True when complete, False when not yet (never raises for "not ready")."""

    def event_elapsed_ms(self, start: int, end: int) -> float: ...

    # -- memory --------------------------------------------------------------------------------
    def pool_prepare(self, index: int) -> int:
        """The device's stream-ordered memory pool, set to keep freed memory for reuse (release
        threshold: unlimited), so a fresh allocation per run is served from the pool."""

    def alloc_async(self, nbytes: int, pool: int, stream: int) -> int:
        """``nbytes`` (> 0) from ``pool``, ordered on ``stream``; ``MemoryError`` when out of memory."""

    def free_async(self, ptr: int, stream: int, index: int) -> None:
        """Free ``ptr`` (of device ``index``) in stream order. Called from finalisers, so from any
        thread, also one where no context is current yet: the adapter makes ``index``'s current then."""

    def copy_htod(self, dst: int, src_host: int, nbytes: int, stream: int) -> None: ...

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int, stream: int) -> None: ...

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memset8(self, dst: int, value: int, nbytes: int, stream: int) -> None: ...

    # -- modules and launches ------------------------------------------------------------------
    def module_load(self, image: bytes) -> int:
        """Load a code object (cubin, NUL-terminated PTX, hsaco) into the current context."""

    def module_unload(self, module: int) -> None: ...

    def module_function(self, module: int, entry: str) -> int: ...

    def launcher(self, function: int, dims: LaunchDims3, stream: int, params: int) -> Callable[[], int]:
        """A zero-argument callable that launches ``function`` on ``stream`` with the kernel
        parameter array at address ``params`` (``void **``) and returns the driver's status as an
        ``int`` (0 = success). Built once per prepared launch: calling it must do no Python-level
        work beyond the driver call (a ``functools.partial`` over a foreign function)."""

    def error_name(self, code: int) -> str:
        """The driver's name for a status code (never raises)."""

    # -- capture -------------------------------------------------------------------------------
    def capture_begin(self, stream: int) -> None:
        """Start recording the work queued on ``stream`` by this thread (thread-local mode)."""

    def capture_end(self, stream: int) -> int:
        """Stop recording; the recorded graph's handle."""

    def graph_instantiate(self, graph: int) -> int: ...

    def graph_destroy(self, graph: int) -> None: ...

    def graph_exec_destroy(self, graph_exec: int) -> None: ...

    def graph_launcher(self, graph_exec: int) -> Callable[[int], int]:
        """A one-argument callable ``launch(stream) -> status`` replaying ``graph_exec``."""
