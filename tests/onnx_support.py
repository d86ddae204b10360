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
