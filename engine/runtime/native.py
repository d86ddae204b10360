"""The native run path (issue 16): a prepared run as one compiled call, where every piece has a native form.

A prepared run (``prepared.PreparedRun``) whose launches all describe themselves natively (a
``native_launch`` on the prepared launch: C function pointer plus the addresses of its argument
arrays, the CPU kernel ABI) and whose outputs are plain fresh buffers is also compiled into a
``KeyRun`` of the ``engine.runtime._fastrun`` extension; a thread's lane keeps one ``NativeLane``
holding the KeyRuns of its keys. ``CompiledGraph.run_async`` then hands numpy inputs straight to
``NativeLane.run``: input checks, symbol binding, key lookup, output buffers from a per-(thread,
key) pool, address patching, the launches with the GIL released and the wrapping of the results
happen in one C call. Anything but the plain case (another input type, a mismatch of any kind, a
key not prepared yet, an allocation failure) makes it return None and the Python path runs the
call as before, so errors are the Python binder's own, by construction. The choice is made once
per prepared plan: other backends (OpenCL, CUDA) never get a KeyRun.

The extension is optional, like the planner's (``setup.py``): without a C compiler at install the
Python path runs everything, with the same results. ``ENGINE_NATIVE_RUN=0`` (``Settings.native_run``)
turns the native path off; ``unavailable()`` says why it is not in use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np

from engine.backend.contract import HasNativeLaunch, NativeLaunch
from engine.errors import KernelError

_fastrun: ModuleType | None
try:  # the compiled run path (``_fastrun.c``); optional, the Python path gives the same results
    _fastrun = importlib.import_module("engine.runtime._fastrun")
except ImportError:  # pragma: no cover - an install without a C compiler
    _fastrun = None

if TYPE_CHECKING:
    from engine.runtime.binding import InputBinder

__all__ = ["NativeLaunch", "HasNativeLaunch", "unavailable", "key_run", "native_lane", "NATIVE_RUN_ENV",
           "MAX_COUNT"]

#: The most inputs, outputs, symbols and dimensions per tensor the extension takes (its fixed-size
#: arrays, ``_fastrun.c``); a graph beyond them keeps the Python path.
MAX_COUNT = 32

#: The environment switch read into ``Settings.native_run`` (``0`` turns the native path off).
NATIVE_RUN_ENV = "ENGINE_NATIVE_RUN"


_POINTER = np.dtype(np.uintp).itemsize


def _layout_problem() -> str | None:
    """Why the extension cannot read numpy arrays' fields here (None: it can)."""
    if _fastrun is None:
        return "engine.runtime._fastrun was not built (no C compiler at install)"
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    probes: list[np.ndarray] = [base, base[1:], base[:, ::2], base.T, np.empty(0, np.uint8),
                                np.zeros((3, 5), np.int16), np.zeros(2, np.float32)[:1]]
    ro = np.zeros(3, np.int32)
    ro.flags.writeable = False
    probes.append(ro)
    for a in probes:
        try:
            got = _fastrun.probe(a)
        except (ValueError, OverflowError):
            return "numpy's array layout is not the one the extension reads"
        want = (a.__array_interface__["data"][0], a.ndim, a.shape, a.dtype, bool(a.flags.c_contiguous),
                bool(a.flags.writeable))
        if got[:3] != want[:3] or got[3] is not want[3] or bool(got[4]) != want[4] or bool(got[5]) != want[5]:
            return "numpy's array layout is not the one the extension reads"
    return None


_UNAVAILABLE = _layout_problem()


def unavailable() -> str | None:
    """Why the native run path cannot be used in this process (None when it can)."""
    return _UNAVAILABLE


def native_lane(binder: "InputBinder", n_outputs: int) -> Any:
    """A new ``NativeLane`` for one lane of a graph with these inputs (call only when available)."""
    if _fastrun is None:
        raise RuntimeError(f"the native run path is unavailable: {_UNAVAILABLE}")
    return _fastrun.NativeLane(np.ndarray, binder.native_specs(), len(binder.symbols), n_outputs)


def key_run(launches: Sequence[Any], input_patches: Sequence[Sequence[tuple[int, int]]],
            slot_patches: Sequence[Sequence[tuple[int, int]]], slots: Sequence[tuple[Any, ...]],
            output_slots: Sequence[int], tensor_type: type, registry: Any) -> Any | None:
    """The ``KeyRun`` of one prepared run, or None when a launch has no native form.

    ``input_patches[i]`` / ``slot_patches[s]``: the (launch position, tensor argument) pairs that
    receive input ``i`` / output slot ``s``; ``slots[s]`` is ``(allocate, external, dtype, shape,
    numpy_dtype)``; ``output_slots[k]`` the slot of graph output ``k`` (one slot per output).
    """
    if _fastrun is None or _UNAVAILABLE is not None or len(launches) == 0:
        return None
    described = []
    for launch in launches:
        native = launch.native_launch if isinstance(launch, HasNativeLaunch) else None
        if not isinstance(native, NativeLaunch):
            return None
        described.append(native)

    def addresses(patches: Sequence[Sequence[tuple[int, int]]]) -> tuple[tuple[int, ...], ...]:
        out = []
        for pairs in patches:
            row = []
            for pos, arg in pairs:
                d = described[pos]
                if not 0 <= arg < d.tensor_count:
                    raise ValueError(f"launch {pos}: tensor argument {arg} of {d.tensor_count}")
                row.append(d.tensors + arg * _POINTER)
            out.append(tuple(row))
        return tuple(out)

    held = tuple(launches)

    def fail(position: int, code: int) -> None:
        held[position - 1].fail(code)
        raise KernelError(f"launch failed with code {code}")  # fail() must raise; this is a safety net

    return _fastrun.KeyRun(tuple(d.function for d in described), tuple(d.tensors for d in described),
                           tuple(d.symbols for d in described), tuple(d.workspace for d in described),
                           addresses(input_patches), addresses(slot_patches), tuple(slots), tuple(output_slots),
                           tensor_type, registry, fail, held)


def external_storage_factory(device: Any) -> Callable[[np.ndarray], Any]:
    """``ExternalStorage`` over a caller's output array, exactly as ``CompiledGraph`` builds it."""
    from engine.hostptr import array_address
    from engine.storage import ExternalStorage

    def external(out: np.ndarray) -> Any:
        host = out.reshape(-1).view(np.uint8).data
        return ExternalStorage(device, array_address(out), out.nbytes, owner=out, host_view=host)

    return external
