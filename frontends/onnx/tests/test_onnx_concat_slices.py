"""Channel Concats of Conv outputs without copies: each Conv writes its planes straight into its
slice of the Concat's buffer (``engine_onnx/concat_slices.py``), the Concat copies only the inputs
that were not written that way, or runs no kernel at all.

Models are built here with ``onnx.helper``, converted, compiled by the CPU plugin and compared with
ONNX Runtime at a symbolic batch of 1 and 3. Every Conv candidate is forced in turn through the
public dispatch table, so each one's slice addressing (channel offset, the buffer's wider batch
stride) is checked, not only the tuner's pick. Kernels are counted on the loaded plan.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine_onnx  # noqa: E402
from onnx_support import candidate_entries, ort_output, random_initializer  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4


def _model(nodes, x_shape, inits, outputs=("y",)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None] * (len(x_shape) + 1)) for o in outputs]
    graph = helper.make_graph(nodes, "slices", [x], outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _conv(rng, inits, name, x, c, oc, k, *, pad=0, relu=True, residual=None, rank=2):
    """Nodes of ``name = [Relu](Conv(x) [+ residual])`` with random weights added to ``inits``."""
    inits += [random_initializer(rng, f"{name}_w", [oc, c] + [k] * rank),
              random_initializer(rng, f"{name}_b", [oc])]
    out = f"{name}_conv" if relu or residual else name
    nodes = [helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], pads=[pad] * (2 * rank))]
    if residual:
        add = f"{name}_add" if relu else name
        nodes.append(helper.make_node("Add", [out, residual], [add]))
        out = add
    if relu:
        nodes.append(helper.make_node("Relu", [out], [name]))
    return nodes


def _kernels(graph) -> list[str]:
    return [graph.compiled_tasks[ins.task_idx].meta.name for ins in graph.graph_execution.instructions]


def _check_every_candidate(model, x_shape, batches=(1, 3)):
    """Runs the model with candidate i of every task (its last where it has fewer), for every i, at
    each batch, against ONNX Runtime; returns the converted graph."""
    graph = engine_onnx.convert(model).build()
    entries = candidate_entries(graph)
    outputs = [o.name for o in model.graph.output]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {batch: np.random.default_rng(batch).standard_normal((batch, *x_shape)).astype(np.float32)
              for batch in batches}
    expected_at = {batch: sess.run(None, {"x": x}) for batch, x in inputs.items()}
    for i in range(max(len(e) for e in entries)):
        for batch in batches:
            graph.dispatch_table.record((batch,), tuple(min(i, len(e) - 1) for e in entries))
            x, expected = inputs[batch], expected_at[batch]
            actual = [t.numpy() for t in graph.run_async([x])]
            for name, a, e in zip(outputs, actual, expected):
                np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * float(np.abs(e).max()),
                                           err_msg=f"output {name}, candidate {i}, batch {batch}")
    return graph


def _fire(rng, inits, x, c, squeeze, expand, tag=""):
    """SqueezeNet's fire module: a 1x1 squeeze, then a 1x1 and a 3x3 expand concatenated."""
    nodes = _conv(rng, inits, f"s{tag}", x, c, squeeze, 1)
    nodes += _conv(rng, inits, f"e1{tag}", f"s{tag}", squeeze, expand, 1)
    nodes += _conv(rng, inits, f"e3{tag}", f"s{tag}", squeeze, expand, 3, pad=1)
    nodes.append(helper.make_node("Concat", [f"e1{tag}", f"e3{tag}"], [f"fire{tag}"], axis=1))
    return nodes


def test_a_fire_module_concatenates_without_a_kernel():
    rng = np.random.default_rng(0)
    inits: list = []
    nodes = _fire(rng, inits, "x", 24, 16, 40)
    nodes.append(helper.make_node("Relu", ["fire"], ["y"]))
    graph = _check_every_candidate(_model(nodes, [24, 11, 13], inits), [24, 11, 13])
    assert not any(k.startswith("concat") for k in _kernels(graph)), _kernels(graph)


def test_a_concat_that_is_a_graph_output():
    """Axis -3 is the channel axis of a 4-D tensor; the Concat's output is the graph's."""
    rng = np.random.default_rng(1)
    inits: list = []
    nodes = _fire(rng, inits, "x", 16, 8, 24)[:-1]
    nodes.append(helper.make_node("Concat", ["e1", "e3"], ["y"], axis=-3))
    graph = _check_every_candidate(_model(nodes, [16, 9, 9], inits), [16, 9, 9])
    assert not any(k.startswith("concat") for k in _kernels(graph))


def test_only_the_inputs_not_written_in_place_are_copied():
    """A MaxPool in the middle, a Conv with a residual Add, and a Conv whose output is also read
    elsewhere: the Concat runs one kernel, and everything matches."""
    rng = np.random.default_rng(2)
    inits: list = []
    nodes = _conv(rng, inits, "a", "x", 12, 20, 3, pad=1)
    nodes.append(helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    nodes += _conv(rng, inits, "r", "x", 12, 12, 3, pad=1, residual="x")
    nodes += _conv(rng, inits, "shared", "x", 12, 7, 1)
    nodes.append(helper.make_node("Concat", ["a", "p", "r", "shared"], ["cat"], axis=1))
    nodes.append(helper.make_node("Relu", ["cat"], ["y"]))
    nodes.append(helper.make_node("Sigmoid", ["shared"], ["z"]))
    graph = _check_every_candidate(_model(nodes, [12, 10, 7], inits, outputs=("y", "z")), [12, 10, 7])
    assert sum(k.startswith("concat") for k in _kernels(graph)) == 1


def test_a_densenet_chain_of_concats():
    """Each block concatenates the running features (read again by the next block) with a new
    Conv's output: the Conv writes its slice, the Concat copies the running features."""
    rng = np.random.default_rng(3)
    inits: list = []
    nodes, features, c = [], "x", 8
    for block in range(3):
        nodes += _conv(rng, inits, f"d{block}", features, c, 6, 3, pad=1, relu=False)
        nodes.append(helper.make_node("Concat", [features, f"d{block}"], [f"cat{block}"], axis=1))
        features, c = f"cat{block}", c + 6
    nodes.append(helper.make_node("Relu", [features], ["y"]))
    graph = _check_every_candidate(_model(nodes, [8, 6, 6], inits), [8, 6, 6])
    assert sum(k.startswith("concat") for k in _kernels(graph)) == 3


def test_one_dimensional_convs_write_their_slices():
    rng = np.random.default_rng(4)
    inits: list = []
    nodes = _conv(rng, inits, "u", "x", 10, 5, 3, pad=1, rank=1)
    nodes += _conv(rng, inits, "v", "x", 10, 9, 1, rank=1)
    nodes.append(helper.make_node("Concat", ["u", "v"], ["y"], axis=1))
    graph = _check_every_candidate(_model(nodes, [10, 17], inits), [10, 17])
    assert not any(k.startswith("concat") for k in _kernels(graph))


def test_a_concat_along_another_axis_copies():
    rng = np.random.default_rng(5)
    inits: list = []
    nodes = _conv(rng, inits, "u", "x", 6, 8, 3, pad=1)
    nodes += _conv(rng, inits, "v", "x", 6, 8, 1)
    nodes.append(helper.make_node("Concat", ["u", "v"], ["y"], axis=2))
    graph = _check_every_candidate(_model(nodes, [6, 5, 5], inits), [6, 5, 5], batches=(2,))
    assert sum(k.startswith("concat") for k in _kernels(graph)) == 1


def test_the_same_conv_output_twice_is_copied():
    rng = np.random.default_rng(6)
    inits: list = []
    nodes = _conv(rng, inits, "u", "x", 6, 8, 3, pad=1)
    nodes.append(helper.make_node("Concat", ["u", "u"], ["y"], axis=1))
    x = np.random.default_rng(0).standard_normal((2, 6, 5, 5)).astype(np.float32)
    model = _model(nodes, [6, 5, 5], inits)
    graph = engine_onnx.convert(model).build()
    np.testing.assert_allclose(graph.run_async([x])[0].numpy(), ort_output(model, {"x": x}), rtol=RTOL, atol=1e-4)
    assert sum(k.startswith("concat") for k in _kernels(graph)) == 1
