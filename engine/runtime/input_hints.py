"""What to do about inputs ``run_async`` cannot use: the advice half of the binder's errors.

People arrive from other runtimes with other habits: ONNX Runtime takes a dict of named arrays,
plain Python code passes nested lists, numpy defaults to float64 and int64. The binder only checks;
once a check failed, this module looks at what was passed and says what to write instead. It runs
on error paths only, so the checks on every run stay a handful of comparisons.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

__all__ = ["plural", "count_message", "not_a_tensor_message", "dtype_hint"]

_PY_SCALARS = (bool, int, float, complex)


def plural(count: int, noun: str) -> str:
    """``1 input``, ``2 inputs``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _np_dtype(name: str) -> str:
    """How the dtype is spelled in code: ``np.float32``, or ``ml_dtypes.bfloat16`` where numpy has none."""
    if name == "bool":
        return "np.bool_"
    return f"np.{name}" if isinstance(getattr(np, name, None), type) else f"ml_dtypes.{name}"


def _expected(names: Sequence[str]) -> str:
    return f" (expected: {', '.join(repr(n) for n in names)})" if names else ""


def _is_data(value: object) -> bool:
    """Python data rather than an array: a list or tuple (of rows, of numbers) or a number."""
    return isinstance(value, (list, tuple, *_PY_SCALARS)) and not isinstance(value, np.ndarray)


def _list_advice(names: Sequence[str], dtypes: Sequence[str], source: str) -> str:
    """``pass [np.asarray(rows, dtype=np.float32)]``: one array per input, in input order."""
    if len(names) == 1:
        return f"pass [np.asarray({source}, dtype={_np_dtype(dtypes[0])})]"
    arrays = ", ".join(f"np.asarray({n if n.isidentifier() else f'input_{i}'}, dtype={_np_dtype(d)})"
                       for i, (n, d) in enumerate(zip(names, dtypes)))
    return f"pass one array per input, in input order: [{arrays}]"


def count_message(inputs: object, names: Sequence[str], dtypes: Sequence[str]) -> str:
    """Why ``inputs`` is not a list of one value per input, and what to pass instead.

    ``names`` are the graph's input names (empty when the bundle has none) and ``dtypes`` their
    dtype names, both in input order.
    """
    count = len(dtypes)
    if isinstance(inputs, Mapping):
        text = f"run_async takes a list of arrays in input order, not a {type(inputs).__name__} of named arrays"
        if not names:
            return f"{text}: pass a list of the graph's {plural(count, 'input')}"
        order = ", ".join(f"inputs[{n!r}]" for n in names)
        return (f"{text}: pass [{order}] (the graph's {plural(count, 'input')}: "
                f"{', '.join(repr(n) for n in names)})")
    given = len(inputs) if isinstance(inputs, Sequence) else None
    text = f"the graph takes {plural(count, 'input')}, got {given}{_expected(names)}"
    if given and isinstance(inputs, (list, tuple)) and all(_is_data(x) for x in inputs):
        kinds = sorted({type(x).__name__ for x in inputs})
        what = f"Python {'/'.join(kinds)}{'s' if given > 1 else ''}"
        source = "rows" if any(isinstance(x, (list, tuple)) for x in inputs) else "values"
        text += (f": the list holds {given} {what}, not arrays; "
                 + _list_advice(names or [f"input_{i}" for i in range(count)], dtypes, source))
    return text


def not_a_tensor_message(where: str, value: object, dtype: str) -> str:
    """``value`` (one input) is neither a Tensor, an array nor a DLPack producer; ``where`` names the input."""
    text = f"{where}: expected an engine.Tensor, a numpy array or a DLPack tensor, got {type(value).__name__}"
    if _is_data(value):
        text += f"; pass np.asarray(value, dtype={_np_dtype(dtype)})"
    elif isinstance(value, str):
        text += " (a name where its array belongs?)"
    return text


def dtype_hint(name: str | None, dtype: str) -> str:
    """``; pass x.astype(np.float32)`` for a numpy array of another dtype (``name``: the input's name)."""
    variable = name if name and name.isidentifier() else "x"
    return f"; pass {variable}.astype({_np_dtype(dtype)})"
