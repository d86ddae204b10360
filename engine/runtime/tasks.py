"""Compiled tasks: a kernel's metadata plus its loaded candidates on one device.

Builtin ``copy`` tasks (cross-device copies, DESIGN §3) have no candidates; the core performs them
with the plugins' copy calls through ``CopyLaunch``, which has the same shape as a backend's
prepared launch so the fast path treats every step alike.

A candidate whose plugin raises ``CandidateUnavailable`` (it needs an optional library this machine
lacks) does not stop the load: its place in ``candidates`` is taken by the kernel's first candidate
that did load, so candidate indices (dispatch-table rows, tuning) keep their meaning and every
choice runs correct code, and ``unavailable`` records why. One warning per load lists them. A
kernel none of whose candidates loads raises the first candidate's error. Tuned rows of such a load
are cached under their own device tag (``availability_tag``), apart from rows tuned where every
candidate loaded.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, NoReturn, Sequence

import attrs
import numpy as np

from engine.backend import BackendBase, BinaryPayload, CandidateSpec, CandidateUnavailable, Kernel, LaunchConfig
from engine.bundle.contents import BundleContents
from engine.bundle.schema import KernelMeta
from engine.errors import KernelError
from engine.hostptr import array_address
from engine.log import get_logger
from engine.tensor import host_wait

__all__ = ["CompiledTask", "CopyLaunch", "load_tasks"]

log = get_logger("engine.runtime.tasks")


@attrs.define(eq=False)
class CompiledTask:
    """One kernel of the plan (reference name), with its candidates loaded on ``backend``."""

    index: int
    meta: KernelMeta
    backend: BackendBase
    device_index: int
    candidates: tuple[Kernel, ...]
    #: Candidates that could not load here (index -> reason); their places in ``candidates`` hold
    #: the first candidate that did.
    unavailable: Mapping[int, str] = attrs.field(factory=dict)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def is_copy(self) -> bool:
        return self.meta.builtin == "copy"

    def __repr__(self) -> str:
        return (f"CompiledTask({self.index}: {self.meta.name!r} on {self.meta.device}, "
                f"{len(self.candidates)} candidates)")


class CopyLaunch:
    """A cross-device (or same-device) copy of ``nbytes`` from tensor 0 to tensor 1.

    Each side's work goes on that side's stream; where the host is in between (a device to host
    copy, or staging between two device kinds) it waits for an event on the source's stream, never
    for a whole device.
    """

    __slots__ = ("ptrs", "nbytes", "_copy", "call", "name")

    def __init__(self, name: str, src: BackendBase, dst: BackendBase, src_ptr: Any, dst_ptr: Any, nbytes: int,
                 src_stream: Any, dst_stream: Any, src_index: int):
        self.name = name
        self.ptrs = [src_ptr, dst_ptr]
        self.nbytes = nbytes
        if src is dst:
            self._copy = lambda s, d, n: src.copy_device(d, s, n, dst_stream)
        elif src.host_accessible:
            self._copy = lambda s, d, n: dst.copy_from_host(d, s, n, dst_stream)
        elif dst.host_accessible:
            def to_host(s: Any, d: int, n: int) -> None:
                src.copy_to_host(d, s, n, src_stream)
                host_wait(src, src_index, src_stream)
            self._copy = to_host
        else:
            def via_host(s: Any, d: Any, n: int) -> None:
                staging = np.empty(n, np.uint8)
                addr = array_address(staging)
                src.copy_to_host(addr, s, n, src_stream)
                host_wait(src, src_index, src_stream)
                dst.copy_from_host(d, addr, n, dst_stream)
            self._copy = via_host
        self.call = self._run

    def _run(self) -> int:
        if self.nbytes:
            self._copy(self.ptrs[0], self.ptrs[1], self.nbytes)
        return 0

    def set_tensor(self, index: int, ptr: Any) -> None:
        self.ptrs[index] = ptr

    def fail(self, code: int) -> NoReturn:
        raise KernelError(f"copy task {self.name!r} failed with code {code}")


def load_tasks(contents: BundleContents, backends: dict[str, BackendBase],
               device_index: dict[str, int]) -> tuple[CompiledTask, ...]:
    """Load every candidate of every kernel (binaries are hash-checked as they are read)."""
    tasks = []
    missing: list[CandidateUnavailable] = []
    for k, meta in enumerate(contents.kernels):
        backend = backends[meta.device]
        index = device_index[meta.device]
        loaded: list[Kernel | None] = []
        unavailable: dict[int, CandidateUnavailable] = {}
        for c, cand in enumerate(meta.candidates):
            binaries = tuple(BinaryPayload(b.format, b.target, b.path, contents.binary(k, b.path))
                             for b in cand.binaries)
            launch = None
            if cand.launch is not None:
                launch = LaunchConfig(cand.launch.grid, cand.launch.block, cand.launch.shared_memory)
            spec = CandidateSpec(
                kernel_name=meta.name, index=c, entry=cand.entry, binaries=binaries, launch=launch,
                num_inputs=len(meta.inputs), num_outputs=len(meta.outputs), symbols=meta.symbols,
                has_workspace=not (meta.workspace.is_constant and meta.workspace.constant == 0),
            )
            try:
                loaded.append(backend.load_kernel(spec, index))
            except CandidateUnavailable as exc:
                loaded.append(None)
                unavailable[c] = exc
            except KernelError:
                raise
            except Exception as exc:  # a plugin bug (outside BackendBase's loop) must still name the kernel
                raise KernelError(f"{spec.describe()}: the {meta.device} plugin failed to load it: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if unavailable:
            standin = next((kernel for kernel in loaded if kernel is not None), None)
            if standin is None:
                raise next(iter(unavailable.values()))
            loaded = [standin if kernel is None else kernel for kernel in loaded]
            missing.extend(unavailable.values())
        tasks.append(CompiledTask(k, meta, backend, index, tuple(loaded),  # type: ignore[arg-type]
                                  {c: str(exc) for c, exc in unavailable.items()}))
    if missing:
        log.warning("%d kernel candidate(s) cannot load here and their kernels run another candidate instead; "
                    "the first: %s", len(missing), missing[0])
    return tuple(tasks)


def availability_tag(device_tag: str, tasks: Sequence[CompiledTask]) -> str:
    """``device_tag`` (what tuned rows are keyed by), changed when some candidates could not load:
    rows tuned while a candidate ran as a stand-in are then kept apart from those tuned with it."""
    missing = [(t.index, c) for t in tasks for c in sorted(t.unavailable)]
    if not missing:
        return device_tag
    return hashlib.sha256(f"{device_tag}|unavailable={missing}".encode()).hexdigest()[:16]


def candidate_counts(tasks: Sequence[CompiledTask]) -> list[int]:
    return [len(t.candidates) for t in tasks]
