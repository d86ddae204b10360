"""The optional compiled helpers, and the one public switch between them and the Python passes.

``engine.runtime._planner`` (memory-planning passes, a key's sizes) and ``engine._exprtape`` (size
expressions) are C extensions built at install where a C compiler exists. The numpy and Python
passes give the same plans, values and errors (tests/test_native_planner.py and tests/test_expr.py
compare them), so the extensions are an optimisation only and an install without a compiler works.

``ENGINE_COMPILED_HELPERS=0`` starts a process on the Python passes (what such an install runs);
``python_passes()`` switches for a block, for tests and benchmarks that compare both in one process.
It changes process-wide state, so it is not for use while other threads plan or run graphs; objects
that precompute for a compiled helper (an ``ExprBatch``'s tape, a ``ReplayTemplate``'s order) keep
the choice that held when they were built. The run path's native part has its own switch
(``ENGINE_NATIVE_RUN``, ``engine.runtime.native``).
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Iterator

from engine.settings import env_flag

__all__ = ["HELPERS", "CompiledHelpers", "built", "python_passes", "ENV"]

#: The environment variable that, set to ``0``, starts the process on the Python passes.
ENV = "ENGINE_COMPILED_HELPERS"


def _load(name: str) -> ModuleType | None:
    try:
        if name == "planner":
            from engine.runtime import _planner  # type: ignore[attr-defined]  # a C extension, no stub

            return _planner
        from engine import _exprtape  # type: ignore[attr-defined]  # a C extension, no stub

        return _exprtape
    except ImportError:  # pragma: no cover - an install without a C compiler
        return None


class CompiledHelpers:
    """The compiled helpers in use: each a module, or None where the Python passes run instead."""

    __slots__ = ("planner", "expr_tape", "_built")

    def __init__(self) -> None:
        self._built = {"planner": _load("planner"), "expr_tape": _load("expr_tape")}
        on = env_flag(os.environ.get(ENV, "1"))
        self.planner: ModuleType | None = self._built["planner"] if on else None
        self.expr_tape: ModuleType | None = self._built["expr_tape"] if on else None

    def built(self) -> dict[str, bool]:
        """Which helpers were built at install (whether or not they are in use)."""
        return {name: module is not None for name, module in self._built.items()}

    def restore(self) -> None:
        """Use every helper that was built (what a process starts with unless ``ENV`` is 0)."""
        self.planner, self.expr_tape = self._built["planner"], self._built["expr_tape"]


#: The process's helpers: ``engine.runtime.memory``, ``engine.runtime.plan`` and ``engine.expr``
#: read them at each call.
HELPERS = CompiledHelpers()


def built() -> dict[str, bool]:
    """``{"planner": ..., "expr_tape": ...}``: which compiled helpers this install has."""
    return HELPERS.built()


@contextlib.contextmanager
def python_passes() -> Iterator[None]:
    """Run the block on the numpy and Python passes, then go back to what was in use."""
    saved = HELPERS.planner, HELPERS.expr_tape
    HELPERS.planner = HELPERS.expr_tape = None
    try:
        yield
    finally:
        HELPERS.planner, HELPERS.expr_tape = saved
