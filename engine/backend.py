"""The device-plugin contract: what a backend supplies and what the core calls.

A backend has three roles, as in tinygrad's runtime: an *allocator* (storage, copies, memset),
a *program loader* (binary bytes to a launchable ``Kernel``) and an optional *compiler* (source to
binary bytes, used by the builder). ``Backend`` is the Protocol type checkers see; ``BackendBase``
is the class plugins subclass: shared policy lives in its public methods, the device-specific work
in underscore hooks; optional capabilities raise ``Unsupported``.

Hot-path rule (DESIGN §5): pluggy is only used to *discover* backends. The run loop calls bound
methods of ``PreparedLaunch`` objects that were built once per prepared plan.
"""

from __future__ import annotations

import time as _time
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, NoReturn, Protocol, Sequence, runtime_checkable

import attrs

from engine.device import Device
from engine.errors import KernelError, Unsupported
from engine.storage import Storage

if TYPE_CHECKING:
    from engine.expr import Expr

__all__ = [
    "API_VERSION",
    "Availability",
    "BinaryPayload",
    "LaunchConfig",
    "CandidateSpec",
    "Kernel",
    "PreparedLaunch",
    "FusedLaunch",
    "Replayable",
    "Backend",
    "BackendBase",
    "kernel_failure",
]

#: Version of this contract. A plugin whose major differs is refused; a newer minor is accepted
#: (minor versions only add optional methods with defaults in ``BackendBase``).
API_VERSION: tuple[int, int] = (1, 0)


@attrs.frozen
class Availability:
    """Whether a kind can be used here, and if not, why (shown by ``engine devices``)."""

    available: bool
    device_count: int = 0
    device_names: tuple[str, ...] = ()
    reason: str | None = None


@attrs.frozen
class BinaryPayload:
    """One binary of a kernel candidate: its format and target from the bundle plus its bytes."""

    format: str
    target: str
    path: str
    data: bytes | memoryview = attrs.field(eq=False, repr=lambda d: f"<{len(d)} bytes>")


@attrs.frozen
class LaunchConfig:
    """GPU launch geometry as expressions over the kernel's symbols."""

    grid: tuple["Expr", "Expr", "Expr"]
    block: tuple["Expr", "Expr", "Expr"]
    shared_memory: "Expr"


@attrs.frozen
class CandidateSpec:
    """Everything a backend needs to load one candidate of one kernel.

    ``binaries`` are in the bundle's order; the backend loads the first one it can use on the
    actual device (DESIGN §3) and raises ``KernelError`` naming kernel, candidate and targets if none.
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


@runtime_checkable
class PreparedLaunch(Protocol):
    """A kernel call with every argument bound, ready for the fast path.

    ``call()`` runs the kernel (asynchronously on GPU streams) and returns 0 on success or a
    non-zero code, which the core hands to ``fail`` to raise a ``KernelError`` with context.
    Only tensor addresses that change between runs (graph inputs and outputs) are patched with
    ``set_tensor``.
    """

    call: Callable[[], int]

    def set_tensor(self, index: int, addr: int) -> None: ...

    def fail(self, code: int) -> NoReturn: ...


class Kernel(Protocol):
    """A loaded candidate."""

    spec: CandidateSpec
    binary: BinaryPayload  # the binary that was actually loaded

    def launch(self, tensor_addrs: Sequence[int], symbol_values: Sequence[int], workspace_addr: int,
               stream: object) -> None:
        """Run once; raise ``KernelError`` (naming kernel, candidate and code) on failure."""

    def prepare(self, tensor_addrs: Sequence[int], symbol_values: Sequence[int], workspace_addr: int,
                stream: object) -> PreparedLaunch:
        """Bind arguments once for repeated launches."""


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
    """A captured run (CUDA graph, HIP graph, native CPU plan) replayed on static buffers."""

    def replay(self) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What the core needs from a device kind. Plugins subclass ``BackendBase``."""

    kind: str
    workspace_slot: int
    api_version: tuple[int, int]
    dlpack_device_type: int
    formats: tuple[str, ...]
    alignment: int
    host_accessible: bool
    has_streams: bool

    def availability(self) -> Availability: ...
    def device_count(self) -> int: ...
    def allocate(self, nbytes: int, device_index: int = 0) -> Storage: ...
    def prepare_allocation(self, nbytes: int, device_index: int = 0) -> Callable[[], Storage]: ...
    def copy_from_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None: ...
    def copy_to_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None: ...
    def copy_device(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None: ...
    def memset(self, addr: int, value: int, nbytes: int, stream: object = None) -> None: ...
    def current_stream(self, device_index: int = 0) -> object: ...
    def synchronize(self, device_index: int = 0) -> None: ...
    def load_kernel(self, spec: CandidateSpec, device_index: int = 0) -> Kernel: ...
    def time(self, fn: Callable[[], object], *, warmup: int = 1, repeat: int = 10,
             device_index: int = 0) -> list[float]: ...
    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]: ...
    def capture(self, run_fn: Callable[[], None], device_index: int = 0) -> Replayable: ...
    def fuse(self, launches: Sequence[PreparedLaunch]) -> FusedLaunch | None: ...


class BackendBase:
    """Base class for backends: required hooks raise ``NotImplementedError``, optional ones
    ``Unsupported``; shared policy (argument checks, error context, timing loop) lives here."""

    kind: ClassVar[str] = ""
    workspace_slot: ClassVar[int] = -1
    api_version: ClassVar[tuple[int, int]] = API_VERSION
    dlpack_device_type: ClassVar[int] = 0
    formats: ClassVar[tuple[str, ...]] = ()
    #: Byte alignment of allocations and planned workspace offsets.
    alignment: ClassVar[int] = 64
    #: Storage addresses are host pointers: tensors get zero-copy numpy views and weights can be
    #: used straight from the memory-mapped bundle.
    host_accessible: ClassVar[bool] = False
    #: Source languages ``compile`` accepts (e.g. ``("c",)``).
    languages: ClassVar[tuple[str, ...]] = ()
    #: ``current_stream()`` can change within a thread (GPU streams). The engine then checks it on
    #: every run and keeps one workspace per (thread, stream), so work queued on two streams never
    #: shares scratch memory. Streams must then be hashable and compare equal for the same stream.
    has_streams: ClassVar[bool] = False

    # -- availability ------------------------------------------------------------------------
    def availability(self) -> Availability:
        raise NotImplementedError(f"{type(self).__name__}.availability")

    def device_count(self) -> int:
        return self.availability().device_count

    def device(self, index: int = 0) -> Device:
        return Device(self.kind, index)

    # -- allocator -----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device_index: int = 0) -> Storage:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"allocation size must be a non-negative int, got {nbytes!r}")
        try:
            return self._allocate(nbytes, device_index)
        except (MemoryError, OSError) as exc:
            raise MemoryError(
                f"{self.kind}:{device_index}: cannot allocate {nbytes} bytes ({_mib(nbytes)}): {exc}"
            ) from exc

    def _allocate(self, nbytes: int, device_index: int) -> Storage:
        raise NotImplementedError(f"{type(self).__name__}._allocate")

    def prepare_allocation(self, nbytes: int, device_index: int = 0) -> Callable[[], Storage]:
        """A zero-argument factory of ``nbytes`` allocations, checked once.

        The fast path allocates every graph output afresh on every run through one of these.
        The default goes through ``allocate``; backends may return something leaner.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"allocation size must be a non-negative int, got {nbytes!r}")
        allocate = self.allocate
        return lambda: allocate(nbytes, device_index)

    def copy_from_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_from_host")

    def copy_to_host(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_to_host")

    def copy_device(self, dst_addr: int, src_addr: int, nbytes: int, stream: object = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_device")

    def memset(self, addr: int, value: int, nbytes: int, stream: object = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.memset")

    def current_stream(self, device_index: int = 0) -> object:
        return None

    def synchronize(self, device_index: int = 0) -> None:
        return None

    # -- programs ------------------------------------------------------------------------------
    def load_kernel(self, spec: CandidateSpec, device_index: int = 0) -> Kernel:
        raise NotImplementedError(f"{type(self).__name__}.load_kernel")

    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        """``None`` when a binary of this format and target can be loaded here, else the reason.

        Used by ``engine inspect`` and for error messages; the default only checks the format.
        """
        if binary_format in self.formats:
            return None
        return f"format {binary_format!r} is not one of {self.kind}'s formats {list(self.formats)}"

    # -- timing --------------------------------------------------------------------------------
    def time(self, fn: Callable[[], object], *, warmup: int = 1, repeat: int = 10,
             device_index: int = 0) -> list[float]:
        """Milliseconds per call of ``fn``, one sample per repeat, after ``warmup`` calls.

        Host-clock default: synchronize around each call. GPU backends override with events.
        """
        if repeat < 1:
            raise ValueError("repeat must be at least 1")
        for _ in range(warmup):
            fn()
        self.synchronize(device_index)
        samples = []
        clock = _time.perf_counter_ns
        for _ in range(repeat):
            start = clock()
            fn()
            self.synchronize(device_index)
            samples.append((clock() - start) / 1e6)
        return samples

    # -- optional capabilities -----------------------------------------------------------------
    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        raise Unsupported(f"the {self.kind} backend cannot compile {language} sources")

    def capture(self, run_fn: Callable[[], None], device_index: int = 0) -> Replayable:
        raise Unsupported(f"the {self.kind} backend cannot capture runs")

    def fuse(self, launches: Sequence[PreparedLaunch]) -> FusedLaunch | None:
        """Fuse prepared launches of this backend into one native call, or ``None`` if unsupported.

        The fast path uses it to take the interpreter out of the per-kernel cost.
        """
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} kind={self.kind!r} slot={self.workspace_slot}>"


def kernel_failure(spec: CandidateSpec, code: int, device: str) -> KernelError:
    """The one message format for a kernel that returned a failure code."""
    return KernelError(f"{spec.describe()} on {device} returned error code {code}")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"

