"""``BackendBase`` and ``KernelBase``: the classes plugins subclass, with the contract's shared policy.

A backend has three roles, as in tinygrad's runtime: an *allocator* (storage, copies, memset),
a *program loader* (binary bytes to a launchable kernel) and an optional *compiler* (source to
binary bytes, used by the builder). Policy that every plugin would otherwise copy lives here, in
public methods; the device-specific work goes in underscore hooks:

* ``allocate`` checks the size and turns allocation failures into an ``OutOfMemoryError`` (also a
  ``MemoryError``) naming size, device and cause; the plugin writes ``_allocate``;
* ``load_kernel`` applies the binary-selection rule (the first binary ``loadable`` accepts, a
  ``BinaryRefused`` from ``_load_binary`` moves on to the next) and writes the error that lists
  every refused binary; the plugin writes ``_load_binary``;
* ``KernelBase.prepare`` checks argument counts and launch dimensions; the plugin writes
  ``_prepare``;
* ``time`` times with the backend's events on the given stream.

Required hooks raise ``NotImplementedError``, optional capabilities ``Unsupported`` (or return a
neutral default). Capabilities are declared as class attributes, never discovered with ``hasattr``.
Hot-path rule (DESIGN §5): pluggy is only used to *discover* backends; the run loop calls bound
methods of ``PreparedLaunch`` objects built once per prepared plan.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, NoReturn, Sequence

from engine.backend.contract import (API_VERSION, Availability, BinaryPayload, CandidateSpec, DevicePtr, Event,
                                     FusedLaunch, LaunchDims, PreparedLaunch, ReferenceKernel, Replayable,
                                     Stream)
from engine.backend.events import HostEvent
from engine.device import Device
from engine.errors import KernelError, OutOfMemoryError, Unsupported
from engine.storage import Storage

__all__ = ["BackendBase", "KernelBase", "BinaryRefused", "CandidateUnavailable", "kernel_failure"]


class BinaryRefused(KernelError):
    """Raised by ``_load_binary`` when a binary that looked loadable turns out not to be (a driver
    that refuses a PTX version, a program that does not build for this device): selection moves on
    to the next binary and the reason is listed if none loads."""


class CandidateUnavailable(KernelError):
    """Raised by ``_load_binary`` when a candidate needs something optional this machine lacks (a
    library shipped in a wheel that is not installed): unlike other ``KernelError``s it does not
    stop the bundle from loading. The core runs the kernel's other candidates in its place and
    logs one warning per load; only when no candidate of a kernel loads is the error raised."""


class BackendBase:
    """Base class for backends (see the module docstring)."""

    kind: ClassVar[str] = ""
    workspace_slot: ClassVar[int] = -1
    api_version: ClassVar[tuple[int, int]] = API_VERSION
    dlpack_device_type: ClassVar[int] = 0
    formats: ClassVar[tuple[str, ...]] = ()
    #: Source languages ``compile`` accepts (e.g. ``("c",)``).
    languages: ClassVar[tuple[str, ...]] = ()
    #: Byte alignment of allocations and planned workspace offsets.
    alignment: ClassVar[int] = 64
    #: Pointers are ordinary host addresses (``int``): tensors get zero-copy numpy views, weights are
    #: used straight from the memory-mapped bundle, graph inputs may be numpy arrays.
    host_accessible: ClassVar[bool] = False
    #: ``current_stream()`` can change within a thread (GPU streams). The engine then checks it on
    #: every run and keeps one workspace per (thread, stream), so work queued on two streams never
    #: shares scratch memory. Streams must then be hashable and compare equal for the same stream.
    has_streams: ClassVar[bool] = False
    #: What a user should do when no binary of a candidate loads (ends the ``KernelError``).
    rebuild_hint: ClassVar[str] = "rebuild the bundle for this device"

    # -- availability ------------------------------------------------------------------------
    def availability(self) -> Availability:
        raise NotImplementedError(f"{type(self).__name__}.availability")

    def device_count(self) -> int:
        return self.availability().device_count

    def device(self, index: int = 0) -> Device:
        return Device(self.kind, index)

    # -- allocator -----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device_index: int = 0, stream: Stream = None) -> Storage:
        """``nbytes`` on ``device_index`` for use on ``stream``, at an ``alignment``-aligned pointer.

        A ``MemoryError`` or ``OSError`` from ``_allocate`` becomes an ``OutOfMemoryError`` naming the
        size, the device and the cause; the core's call sites add what the memory was for.
        """
        _check_size(nbytes, self.kind, device_index)
        try:
            storage = self._allocate(nbytes, device_index, stream)
        except (MemoryError, OSError) as exc:
            raise OutOfMemoryError.from_error(exc, nbytes, f"{self.kind}:{device_index}") from exc
        if stream is not None and storage.stream is None:
            storage.stream = stream  # its release is ordered after the work on the stream it was made for
        return storage

    def _allocate(self, nbytes: int, device_index: int, stream: Stream) -> Storage:
        raise NotImplementedError(f"{type(self).__name__}._allocate")

    def prepare_allocation(self, nbytes: int, device_index: int = 0,
                           stream: Stream = None) -> Callable[[], Storage]:
        """A zero-argument factory of ``nbytes`` allocations for ``stream``, checked once.

        The fast path allocates every graph output afresh on every run through one of these.
        The default goes through ``allocate``; backends may return something leaner (a pool), which
        should raise ``OutOfMemoryError`` as ``allocate`` does (the core converts a plain
        ``MemoryError`` too).
        """
        _check_size(nbytes, self.kind, device_index)
        allocate = self.allocate
        return lambda: allocate(nbytes, device_index, stream)

    def max_allocation(self, device_index: int = 0) -> int | None:
        """The largest single allocation the device allows (``None``: no limit but memory).

        The core splits a workspace larger than this into several allocations.
        """
        return None

    def copy_from_host(self, dst: DevicePtr, src_host: int, nbytes: int, stream: Stream = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_from_host")

    def copy_to_host(self, dst_host: int, src: DevicePtr, nbytes: int, stream: Stream = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_to_host")

    def copy_device(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: Stream = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.copy_device")

    def memset(self, dst: DevicePtr, value: int, nbytes: int, stream: Stream = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.memset")

    # -- pointers across processes' boundaries (DLPack) -----------------------------------------
    def export_pointer(self, ptr: DevicePtr) -> tuple[int, int]:
        """``(data, byte_offset)`` of ``ptr`` for a DLPack tensor. Default: integer addresses."""
        if isinstance(ptr, int):
            return ptr, 0
        raise BufferError(f"the {self.kind} backend cannot export a {type(ptr).__name__} through DLPack")

    def import_pointer(self, data: int, byte_offset: int, device_index: int = 0, owner: object = None) -> DevicePtr:
        """The pointer for a DLPack tensor's ``(data, byte_offset)``. Default: integer addresses.

        ``owner`` keeps the producer's memory alive; a backend that wraps the handle may hold it.
        """
        return data + byte_offset

    def dlpack_stream(self, value: int | None, device_index: int = 0) -> Stream | None:
        """The stream a DLPack consumer named in ``__dlpack__(stream=value)`` (``None``: it named
        none), as this backend's stream, or ``None`` when the backend cannot use it.

        With a stream, an export only orders the consumer's stream after the tensor's producer (an
        event); without one the host waits for the producer. Default: ``None`` (the host waits).
        """
        return None

    # -- streams and events --------------------------------------------------------------------
    def current_stream(self, device_index: int = 0) -> Stream:
        return None

    def synchronize(self, device_index: int = 0, stream: Stream = None) -> None:
        """Wait until the work queued on ``stream`` (``None``: on the whole device) is done."""
        return None

    def create_event(self, device_index: int = 0) -> Event:
        """A new event (``engine.backend.Event``). Default: ``HostEvent``, which waits for the
        stream on the host when recorded; devices with queues override it with driver events."""
        return HostEvent(lambda stream: self.synchronize(device_index, stream))

    # -- programs ------------------------------------------------------------------------------
    def load_kernel(self, spec: CandidateSpec, device_index: int = 0) -> "KernelBase":
        """Load the first binary of ``spec`` this device can use (bundle format §13).

        Binaries ``loadable`` refuses are skipped, and so are those ``_load_binary`` refuses with
        ``BinaryRefused``; any other exception from the plugin becomes a ``KernelError`` naming the
        kernel and binary. When none loads, the ``KernelError`` lists every binary with its reason.
        """
        refused: list[str] = []
        for binary in spec.binaries:
            reason = self.loadable(binary.format, binary.target, device_index)
            if reason is None:
                try:
                    return self._load_binary(spec, binary, device_index)
                except BinaryRefused as exc:
                    reason = str(exc)
                except KernelError:
                    raise
                except Exception as exc:  # a plugin bug must still say which kernel and binary
                    raise KernelError(f"{spec.describe()}: {binary.describe()}: the {self.kind} plugin failed "
                                      f"to load it: {type(exc).__name__}: {exc}") from exc
            refused.append(f"{binary.describe()}: {reason}")
        listing = "; ".join(refused) if refused else "the candidate lists no binaries"
        raise KernelError(f"{spec.describe()}: no loadable binary for {self.kind}:{device_index}: {listing}; "
                          f"{self.rebuild_hint}")

    def _load_binary(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> "KernelBase":
        raise NotImplementedError(f"{type(self).__name__}._load_binary")

    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        """``None`` when a binary of this format and target can be loaded here, else the reason.

        Used by binary selection, ``engine inspect`` and error messages; the default checks the format.
        """
        if binary_format in self.formats:
            return None
        return f"format {binary_format!r} is not one of {self.kind}'s formats {list(self.formats)}"

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        """The reference kernels in this backend's language, by the names ``engine.testing``
        documents (``add``, ``scale_ws``, ``busy``, the ``mlp_*`` kernels of the demo model).
        Optional: the conformance suite skips the tests needing a missing kernel, with the reason,
        and ``engine demo --device KIND`` needs the ``mlp_*`` ones."""
        return {}

    # -- timing --------------------------------------------------------------------------------
    def time(self, fn: Callable[[], object], *, stream: Stream = None, warmup: int = 1, repeat: int = 10,
             device_index: int = 0) -> list[float]:
        """Milliseconds per call of ``fn`` (which queues work on ``stream``), one sample per repeat,
        after ``warmup`` calls: the time between two events recorded around each call."""
        if not isinstance(repeat, int) or repeat < 1:
            raise ValueError("repeat must be at least 1")
        for _ in range(warmup):
            fn()
        self.synchronize(device_index, stream)
        samples = []
        for _ in range(repeat):
            start, end = self.create_event(device_index), self.create_event(device_index)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_ms(end))
        return samples

    # -- optional capabilities -----------------------------------------------------------------
    def compile(self, source: str, language: str,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        raise Unsupported(f"the {self.kind} backend cannot compile {language} sources")

    def capture(self, run_fn: Callable[[], None], *, stream: Stream = None, device_index: int = 0) -> Replayable:
        """Record ``run_fn`` (launches queued on ``stream``) for replay. Optional."""
        raise Unsupported(f"the {self.kind} backend cannot capture runs")

    def fuse(self, launches: Sequence[PreparedLaunch]) -> FusedLaunch | None:
        """Fuse prepared launches of this backend into one native call, or ``None`` if unsupported."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} kind={self.kind!r} slot={self.workspace_slot}>"


class KernelBase:
    """Base class for a loaded candidate: argument checks here, the binding in ``_prepare``."""

    #: The device name used in failure messages (``kernel_failure``); set by subclasses or instances.
    device_name: str = "?"

    def __init__(self, spec: CandidateSpec, binary: BinaryPayload):
        self.spec = spec
        self.binary = binary

    def prepare(self, tensors: Sequence[DevicePtr], symbol_values: Sequence[int], workspace: DevicePtr,
                stream: Stream, dims: LaunchDims | None = None) -> PreparedLaunch:
        """Bind the arguments for repeated launches on ``stream`` (counts and dims checked here).

        ``workspace`` reaches ``_prepare`` as ``None`` when the candidate declares none.
        """
        spec = self.spec
        expected = spec.num_inputs + spec.num_outputs
        if len(tensors) != expected:
            raise KernelError(f"{spec.describe()}: got {len(tensors)} tensor pointers, expected {expected} "
                              f"({spec.num_inputs} inputs + {spec.num_outputs} outputs)")
        if len(symbol_values) != len(spec.symbols):
            raise KernelError(f"{spec.describe()}: got {len(symbol_values)} symbol values, expected "
                              f"{len(spec.symbols)} for {list(spec.symbols)}")
        if spec.launch is not None and dims is None:
            raise KernelError(f"{spec.describe()}: declares launch dimensions but none were given")
        if not spec.has_workspace or workspace == 0:
            workspace = None
        return self._prepare(list(tensors), [int(v) for v in symbol_values], workspace, stream, dims)

    def _prepare(self, tensors: list[DevicePtr], symbol_values: list[int], workspace: DevicePtr,
                 stream: Stream, dims: LaunchDims | None) -> PreparedLaunch:
        raise NotImplementedError(f"{type(self).__name__}._prepare")

    def launch(self, tensors: Sequence[DevicePtr], symbol_values: Sequence[int], workspace: DevicePtr,
               stream: Stream, dims: LaunchDims | None = None) -> None:
        """Queue one launch; ``KernelError`` naming kernel, candidate and code on failure."""
        launch = self.prepare(tensors, symbol_values, workspace, stream, dims)
        code = launch.call()
        if code:
            launch.fail(code)

    def fail(self, code: int) -> NoReturn:
        raise kernel_failure(self.spec, code, self.device_name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec.describe()} from {self.binary.path}>"


def kernel_failure(spec: CandidateSpec, code: int, device: str) -> KernelError:
    """The one message format for a kernel that returned a failure code."""
    return KernelError(f"{spec.describe()} on {device} returned error code {code}")


#: The largest size ``allocate`` passes to a plugin (the planner's bound on any size too). Larger
#: sizes are refused as out of memory here: a plugin's allocator might raise something else for
#: them (numpy raises ``ValueError`` past its largest array).
MAX_ALLOCATION_BYTES = 2**62


def _check_size(nbytes: Any, kind: str, device_index: int) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"allocation size must be a non-negative int, got {nbytes!r}")
    if nbytes > MAX_ALLOCATION_BYTES:
        raise OutOfMemoryError(nbytes, f"{kind}:{device_index}", "larger than any device can provide (2**62 bytes)")
