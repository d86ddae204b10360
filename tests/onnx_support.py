"""Shared helpers of the ONNX kernel tests: ONNX Runtime's answer, random initializers, and the
candidate entries of a converted graph's tasks (what the tests force through the dispatch table)."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper


def ort_output(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output from ONNX Runtime's CPU provider, on every core."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def random_initializer(rng: np.random.Generator, name: str, shape) -> onnx.TensorProto:
    """A float32 initializer of standard-normal values."""
    return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32))


def candidate_entries(graph) -> list[tuple[str, ...]]:
    """The candidate entry names of each task (by task index)."""
    return [tuple(c.entry for c in task.meta.candidates) for task in graph.compiled_tasks]


def check_forced(model: onnx.ModelProto, entry: str, shapes: dict[str, tuple[int, ...]], batches=(1, 3),
                 rtol: float = 1e-4) -> list[tuple[str, ...]]:
    """Forces candidate ``entry`` on every task that offers it (candidate 0 elsewhere) through the
    public dispatch table at each batch, and compares the first output with ONNX Runtime's
    (``rtol`` relative, plus ``rtol`` of its largest magnitude). ``shapes``: each input's shape
    after the batch, in the graph's input order. Returns the tasks' entry names."""
    import engine_onnx

    graph = engine_onnx.convert(model).build()
    entries = candidate_entries(graph)
    assert any(entry in e for e in entries), entries
    choice = tuple(e.index(entry) if entry in e else 0 for e in entries)
    for batch in batches:
        graph.dispatch_table.record((batch,), choice)
        rng = np.random.default_rng(batch)
        feeds = {name: rng.standard_normal((batch, *shape)).astype(np.float32) for name, shape in shapes.items()}
        expected = ort_output(model, feeds)
        actual = graph.run_async(list(feeds.values()))[0].numpy()
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=f"batch {batch}")
    return entries
