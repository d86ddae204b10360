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

try:
    from engine.runtime import _planner  # type: ignore[attr-defined]  # a C extension, no stub
except ImportError:  # pragma: no cover - an install without a C compiler
    _planner = None
try:
    from engine import _exprtape  # type: ignore[attr-defined]  # a C extension, no stub
except ImportError:  # pragma: no cover - an install without a C compiler
    _exprtape = None


class CompiledHelpers:
    """The compiled helpers in use: each a module, or None where the Python passes run instead."""

    __slots__ = ("planner", "expr_tape")

    def __init__(self, on: bool) -> None:
        self.planner: ModuleType | None = _planner if on else None
        self.expr_tape: ModuleType | None = _exprtape if on else None


#: The process's helpers: ``engine.runtime.memory`` and ``engine.runtime.plan`` read them at each
#: call, ``engine.expr`` when it builds a tape.
HELPERS = CompiledHelpers(env_flag(os.environ.get(ENV, "1")))


def built() -> dict[str, bool]:
    """``{"planner": ..., "expr_tape": ...}``: which compiled helpers this install has (whether or
    not they are in use)."""
    return {"planner": _planner is not None, "expr_tape": _exprtape is not None}


@contextlib.contextmanager
def python_passes() -> Iterator[None]:
    """Run the block on the numpy and Python passes, then go back to what was in use."""
    saved = HELPERS.planner, HELPERS.expr_tape
    HELPERS.planner = HELPERS.expr_tape = None
    try:
        yield
    finally:
        HELPERS.planner, HELPERS.expr_tape = saved
