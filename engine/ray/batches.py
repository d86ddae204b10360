"""A callable class for ``ray.data.Dataset.map_batches``: one graph per actor, numpy batches in and out.

Ray Data creates the class once per actor of its pool (``concurrency=N``), so the bundle is loaded
(kernels opened, weights mapped) once per actor, and every batch is one ``run_async`` call. A batch
is a dict of numpy arrays (``batch_format="numpy"``); each graph input reads one column, each output
writes one (named as in the bundle; ``input0``, ``output0``, ... where it names none), and the
symbols (the batch dimension) are bound from the arrays of each batch. Row order and count are
those of the batch (set ``DataContext.execution_options.preserve_order`` to keep the dataset's).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from engine.errors import InputError
from engine.ray.placement import Placement, current_placement
from engine.ray.source import BundleSource, load_graph
from engine.runtime.compiled_graph import CompiledGraph

__all__ = ["GraphPredictor", "ColumnError"]


class ColumnError(InputError):
    """A batch column is missing or cannot feed its graph input; ``column``/``input`` name them."""

    def __init__(self, message: str, *, column: str, input: str):
        super().__init__(message)
        self.column = column
        self.input = input


class GraphPredictor:
    """``ds.map_batches(GraphPredictor, fn_constructor_args=(bundle,), concurrency=2, batch_format="numpy")``.

    ``bundle``: an ``ObjectRef`` from ``engine.ray.put_bundle`` (one copy of the weights per node)
    or a path readable on every node. ``inputs`` maps graph input names to batch columns and
    ``outputs`` graph output names to result columns (default: the same names); ``keep`` lists
    batch columns copied into the result unchanged (row ids, keys). ``cast=True`` converts columns to
    the inputs' dtypes; otherwise a column of another dtype is a ``ColumnError``. ``device``
    overrides the placement taken from Ray's resources (``engine.ray.placement``).
    """

    def __init__(self, bundle: BundleSource, *, inputs: Mapping[str, str] | None = None,
                 outputs: Mapping[str, str] | None = None, keep: Sequence[str] = (), cast: bool = False,
                 device: str | None = None, dispatch_policy: str | None = None):
        self.placement: Placement = current_placement(device)
        self.graph: CompiledGraph = load_graph(bundle, self.placement.device, dispatch_policy=dispatch_policy)
        meta = self.graph.meta
        in_names = list(meta.input_names) or [f"input{i}" for i in range(len(meta.inputs))]
        out_names = list(meta.output_names) or [f"output{i}" for i in range(len(meta.outputs))]
        self.inputs = _mapping(inputs, in_names, "input")
        self.outputs = _mapping(outputs, out_names, "output")
        self.keep = tuple(keep)
        self.cast = bool(cast)
        self._dtypes = tuple(np.dtype(s.dtype.numpy) for s in meta.inputs)
        self._columns = tuple(self.inputs[n] for n in in_names)
        self._input_names = tuple(in_names)
        self._result_columns = tuple(self.outputs[n] for n in out_names)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = [self._column(batch, c, n, dt) for c, n, dt in zip(self._columns, self._input_names, self._dtypes)]
        results = self.graph.run_async(arrays)
        out = {col: np.asarray(t.numpy()) for col, t in zip(self._result_columns, results)}
        for col in self.keep:
            out[col] = self._kept(batch, col)
        return out

    def _column(self, batch: Mapping[str, np.ndarray], column: str, name: str, dtype: np.dtype) -> np.ndarray:
        if column not in batch:
            raise ColumnError(f"graph input {name!r} reads column {column!r}, which the batch does not have "
                              f"(columns: {', '.join(sorted(batch)) or 'none'}); map it with inputs={{{name!r}: ...}}",
                              column=column, input=name)
        array = np.asarray(batch[column])
        if array.dtype == object:
            raise ColumnError(f"column {column!r} (graph input {name!r}) holds Python objects (rows of unequal "
                              f"shape?); expected a {dtype} tensor column", column=column, input=name)
        if array.dtype != dtype:
            if not self.cast:
                raise ColumnError(f"column {column!r} (graph input {name!r}): expected dtype {dtype}, "
                                  f"got {array.dtype}; "
                                  f"convert it before, or pass cast=True", column=column, input=name)
            array = array.astype(dtype)
        return np.ascontiguousarray(array)

    def _kept(self, batch: Mapping[str, np.ndarray], column: str) -> np.ndarray:
        if column not in batch:
            raise ColumnError(f"keep= names column {column!r}, which the batch does not have "
                              f"(columns: {', '.join(sorted(batch)) or 'none'})", column=column, input="")
        return np.asarray(batch[column])


def _mapping(given: Mapping[str, str] | None, names: list[str], what: str) -> dict[str, str]:
    mapping = {n: n for n in names}
    for name, column in (given or {}).items():
        if name not in mapping:
            raise InputError(f"{what}s= names graph {what} {name!r}, which the graph does not have "
                             f"({what}s: {', '.join(names)})")
        mapping[name] = column
    return mapping
