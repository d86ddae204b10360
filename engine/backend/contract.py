"""The device contract, version 2: the data the core hands a backend and the shapes it gets back.

Everything a plugin author must read about *types* is here; ``engine.backend.base`` holds the
class plugins subclass, with the shared policy. The contract in one paragraph:

* **Pointers are the backend's.** Device memory is addressed by a ``DevicePtr`` the backend
  defines. The core only ever does two things with one: add a byte offset (``ptr + n``) and hand it
  back to the same backend. A raw address (``int``) does both at no cost (CPU, CUDA, HIP); a
  device without flat addresses returns ``engine.pointer.BufferPtr(buffer, offset)`` (OpenCL
  ``cl_mem``, Vulkan buffers). ``None`` is the null pointer (no workspace).
* **Work is queued on streams, and the core says which.** Copies, launches, timing, capture,
  replay and ``synchronize`` all take the stream. A synchronous device ignores it.
* **Events order streams without device-wide waits.** ``create_event`` / ``record`` / ``wait`` /
  ``synchronize`` / ``elapsed_ms``; the core uses them for host reads, DLPack hand-offs and
  cross-device copies.
* **Memory is released on the stream that last used it.** ``allocate`` and
  ``prepare_allocation`` take the stream the memory will be used on; a ``Storage`` remembers its
  stream and its ``release`` callable receives it (stream-ordered free, caching pools).
* **The core evaluates launch dimensions** (``LaunchConfig.evaluate``) and hands them to
  ``Kernel.prepare`` as ``LaunchDims``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Protocol, Sequence, runtime_checkable

import attrs

from engine.device import Device
from engine.storage import Storage

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from 3.11; annotations only, never imported at run time

    from engine.expr import Expr

__all__ = [
    "API_VERSION",
    "API_CHANGES",
    "DevicePtr",
    "Stream",
    "Availability",
    "BinaryPayload",
    "LaunchConfig",
    "LaunchDims",
    "CandidateSpec",
    "ReferenceKernel",
    "PreparedLaunch",
    "Kernel",
    "FusedLaunch",
    "NativeLaunch",
    "HasNativeLaunch",
    "Replayable",
    "Event",
    "Backend",
]

#: Version of this contract. A plugin whose major differs is refused; a newer minor is accepted
#: (minor versions only add optional methods with defaults in ``BackendBase``).
API_VERSION: tuple[int, int] = (2, 0)

#: What each major version changed, for the message that refuses a plugin written for an older one.
API_CHANGES: Mapping[int, str] = {
    2: ("device memory is addressed by an opaque DevicePtr (Storage.ptr; int or engine.pointer.BufferPtr), "
        "streams are passed to time/capture/replay/synchronize, events (create_event) replace device-wide "
        "syncs, allocate/prepare_allocation take the stream and Storage release callables receive it, "
        "Kernel.prepare receives the LaunchDims the core evaluated, and BackendBase.load_kernel selects the "
        "binary (implement _load_binary); see docs/plugins.md"),
}

#: A device pointer: whatever the backend hands out, supporting ``ptr + nbytes``; ``None`` is null.
DevicePtr = Any
#: A backend's queue handle (``None`` on synchronous devices). Hashable, equal for the same queue.
Stream = Any


@attrs.frozen
class Availability:
    """Whether a kind can be used here, and if not, why (shown by ``engine devices``).

    ``driver`` names the driver or platform and its version when the backend knows it.
    """

    available: bool
    device_count: int = 0
    device_names: tuple[str, ...] = ()
    reason: str | None = None
    driver: str | None = None


@attrs.frozen
class BinaryPayload:
    """One binary of a kernel candidate: its format and target from the bundle plus its bytes."""

    format: str
    target: str
    path: str
    data: bytes | memoryview = attrs.field(eq=False, repr=lambda d: f"<{len(d)} bytes>")

    def describe(self) -> str:
        return f"{self.path} ({self.format}, {self.target})"


@attrs.frozen
class LaunchDims:
    """Launch geometry with the symbols filled in: grid (in blocks), block (in threads), bytes of
    dynamic shared memory. OpenCL's global size is ``grid * block`` per axis, its local size
    ``block``."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_memory: int = 0

    @property
    def global_size(self) -> tuple[int, int, int]:
        g, b = self.grid, self.block
        return (g[0] * b[0], g[1] * b[1], g[2] * b[2])


@attrs.frozen
class LaunchConfig:
    """Launch geometry as expressions over the kernel's symbols (from the bundle)."""

    grid: tuple["Expr", "Expr", "Expr"]
    block: tuple["Expr", "Expr", "Expr"]
    shared_memory: "Expr"

    def evaluate(self, symbols: Sequence[str], values: Sequence[int]) -> LaunchDims:
        """The dimensions at these symbol values; ``engine.expr.ExprError`` when an expression fails."""
        env = dict(zip(symbols, (int(v) for v in values)))
        grid = tuple(int(e.evaluate(env)) for e in self.grid)
        block = tuple(int(e.evaluate(env)) for e in self.block)
        return LaunchDims(grid, block, int(self.shared_memory.evaluate(env)))  # type: ignore[arg-type]


@attrs.frozen
class CandidateSpec:
    """Everything a backend needs to load one candidate of one kernel.

    ``binaries`` are in the bundle's order; ``BackendBase.load_kernel`` loads the first one the
    backend can use on the actual device (bundle format §13) and raises ``KernelError`` naming
    kernel, candidate and every refused binary if none fits.
    """

    kernel_name: str
    index: int
    entry: str
    binaries: tuple[BinaryPayload, ...]
    launch: LaunchConfig | None
    num_inputs: int
    num_outputs: int
    symbols: tuple[str, ...]
    has_workspace: bool

    def describe(self) -> str:
        return f"kernel {self.kernel_name!r} candidate {self.index} (entry {self.entry!r})"


def _str_tuple(value: Sequence[str]) -> tuple[str, ...]:
    """``tuple`` as an attrs converter mypy can type (``converter=tuple`` leaves its parameter generic)."""
    return tuple(value)


@attrs.frozen
class ReferenceKernel:
    """A kernel the conformance suite and the demo model run on a backend, in its own language.

    ``source`` may use the macros the caller defines in front of it (``#define N 128``: the names
    ``engine.testing`` documents per kernel); ``entries`` are its candidates (same result each);
    ``launch`` is the GraphBuilder launch dict (``grid``/``block``/``shared_memory`` expressions over
    the kernel's symbols and those macros, e.g. ``{"grid": ["ceil_div(batch * N, 64)", 1, 1],
    "block": [64, 1, 1]}``; the caller replaces the macro names by their values) or ``None`` for
    devices without launch geometry; ``options`` go to ``Backend.compile``.
    """

    source: str
    language: str
    entries: tuple[str, ...] = attrs.field(converter=_str_tuple)
    launch: Mapping[str, Any] | None = None
    options: Mapping[str, Any] | None = None


@runtime_checkable
class PreparedLaunch(Protocol):
    """A kernel call with every argument bound, ready for the fast path.

    ``call()`` queues the kernel on the stream it was prepared for and returns 0, or a non-zero
    code which the core hands to ``fail`` to raise a ``KernelError`` with context. Only tensor
    pointers that change between runs (graph inputs and outputs) are patched with ``set_tensor``.
    """

    call: Callable[[], int]

    def set_tensor(self, index: int, ptr: DevicePtr) -> None: ...

    def fail(self, code: int) -> NoReturn: ...


class Kernel(Protocol):
    """A loaded candidate (plugins subclass ``engine.backend.KernelBase``)."""

    spec: CandidateSpec
    binary: BinaryPayload  # the binary that was actually loaded

    def prepare(self, tensors: Sequence[DevicePtr], symbol_values: Sequence[int], workspace: DevicePtr,
                stream: Stream, dims: LaunchDims | None = None) -> PreparedLaunch:
        """Bind arguments once for repeated launches on ``stream``."""

    def launch(self, tensors: Sequence[DevicePtr], symbol_values: Sequence[int], workspace: DevicePtr,
               stream: Stream, dims: LaunchDims | None = None) -> None:
        """Queue one launch; ``KernelError`` (naming kernel, candidate and code) on failure."""


class FusedLaunch(Protocol):
    """Several prepared launches run by one native call (optional backend capability).

    ``call()`` runs them in order and returns 0, or the 1-based position of the first launch that
    returned non-zero (later ones are not run); ``code()`` then gives that launch's code. The fused
    call reads the same argument arrays as the individual launches, so ``set_tensor`` patches
    made on them after fusing are seen.
    """

    call: Callable[[], int]

    def code(self) -> int: ...


class Replayable(Protocol):
    """A captured run (CUDA graph, HIP graph, recorded command buffer) replayed on static buffers."""

    def replay(self, stream: Stream = None) -> None: ...

    def close(self) -> None: ...


class Event(Protocol):
    """A point in a stream's work.

    ``record(stream)`` marks the work queued on ``stream`` so far; ``wait(stream)`` makes later work
    on ``stream`` wait for it on the device (no host wait); ``synchronize()`` blocks the host until
    it completes; ``query()`` says whether it has; ``elapsed_ms(end)`` is the device time from this
    event to ``end`` (both recorded and complete). An event never recorded counts as complete.
    """

    def record(self, stream: Stream = None) -> None: ...

    def wait(self, stream: Stream = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_ms(self, end: Self) -> float: ...


class Backend(Protocol):
    """What the core needs from a device kind. Plugins subclass ``engine.backend.BackendBase``."""

    kind: str
    workspace_slot: int
    api_version: tuple[int, int]
    dlpack_device_type: int
    formats: tuple[str, ...]
    languages: tuple[str, ...]
    alignment: int
    host_accessible: bool
    has_streams: bool
    rebuild_hint: str

    def availability(self) -> Availability: ...
    def device_count(self) -> int: ...
    def device(self, index: int = 0) -> Device: ...
    def allocate(self, nbytes: int, device_index: int = 0, stream: Stream = None) -> Storage: ...
    def prepare_allocation(self, nbytes: int, device_index: int = 0,
                           stream: Stream = None) -> Callable[[], Storage]: ...
    def max_allocation(self, device_index: int = 0) -> int | None: ...
    def copy_from_host(self, dst: DevicePtr, src_host: int, nbytes: int, stream: Stream = None) -> None: ...
    def copy_to_host(self, dst_host: int, src: DevicePtr, nbytes: int, stream: Stream = None) -> None: ...
    def copy_device(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: Stream = None) -> None: ...
    def memset(self, dst: DevicePtr, value: int, nbytes: int, stream: Stream = None) -> None: ...
    def current_stream(self, device_index: int = 0) -> Stream: ...
    def synchronize(self, device_index: int = 0, stream: Stream = None) -> None: ...
    def create_event(self, device_index: int = 0) -> Event: ...
    def load_kernel(self, spec: CandidateSpec, device_index: int = 0) -> Kernel: ...
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None: ...
    def reference_kernels(self) -> Mapping[str, ReferenceKernel]: ...
    def time(self, fn: Callable[[], object], *, stream: Stream = None, warmup: int = 1, repeat: int = 10,
             device_index: int = 0) -> list[float]: ...
    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]: ...
    def capture(self, run_fn: Callable[[], None], *, stream: Stream = None, device_index: int = 0) -> Replayable: ...
    def fuse(self, launches: Sequence[PreparedLaunch]) -> FusedLaunch | None: ...
    def export_pointer(self, ptr: DevicePtr) -> tuple[int, int]: ...
    def import_pointer(self, data: int, byte_offset: int, device_index: int = 0, owner: object = None) -> DevicePtr: ...
    def dlpack_stream(self, value: int | None, device_index: int = 0) -> Stream | None: ...


# -- the native run path (engine.runtime.native) ---------------------------------------------

@attrs.frozen
class NativeLaunch:
    """What the native path needs to make one prepared launch itself (the CPU kernel ABI, DESIGN §4).

    ``function`` is the address of ``int32_t entry(void *const *tensors, const int64_t *symbols,
    void *workspace)``; ``tensors`` the address of the launch's own ``void *[tensor_count]`` argument
    array (inputs then outputs; the core writes the graph inputs' and outputs' addresses into it
    before each run, exactly as ``set_tensor`` would); ``symbols`` the address of its ``int64_t``
    symbol array; ``workspace`` the scratch address (0 for none). The arrays must stay valid, at
    these addresses, for as long as the prepared launch lives; ``fail(code)`` on the prepared launch
    raises for a non-zero code, as after ``call()``.
    """

    function: int
    tensors: int
    tensor_count: int
    symbols: int
    workspace: int = 0


@runtime_checkable
class HasNativeLaunch(Protocol):
    """A prepared launch the native path can make: ``native_launch`` is its description (or None
    when this launch has no native form)."""

    @property
    def native_launch(self) -> NativeLaunch | None: ...

    def fail(self, code: int) -> Any: ...
