"""The 1x1 Conv candidate ``conv_batch_gemm`` (one GEMM over the batch's pixels, the weight packed at
import) gives ONNX Runtime's result, and is offered exactly for a plain 1x1, ungrouped Conv of a
constant weight with at most ``MAX_CHANNELS`` input channels.

The candidate is forced through the public dispatch table at each batch, so it is checked whether
or not the tuner would pick it on this machine. The shapes are chosen against the kernel's
blocking: 16-column panels that straddle images (7x7 and 5x5 images, 49 and 25 pixels), column
chunks narrowed as the channel count grows, input channels in even blocks of at most 256 (960
and 300 cross block boundaries), output channels not a multiple of 6 and more than one 72-row
block, a batch-1 classifier with more output channels than pixels (row bands per thread), the
batch sizes that end on partial panels, a residual, and an output written into a Concat's slice.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine_onnx  # noqa: E402
from onnx_support import candidate_entries, check_forced, random_initializer  # noqa: E402
from engine_onnx.ops.conv_batch_gemm import MAX_CHANNELS  # noqa: E402

ort.set_default_logger_severity(3)
ENTRY = "conv_batch_gemm"


def _model(nodes, inputs, y_shape, inits):
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *s]) for n, s in inputs.items()]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *y_shape])
    graph = helper.make_graph(nodes, "batch_gemm", ins, [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_model(c, spatial, oc, seed, *, bias=True, relu=True):
    rng = np.random.default_rng(seed)
    kernel = [1] * len(spatial)
    inits = [random_initializer(rng, "w", [oc, c, *kernel])] + ([random_initializer(rng, "b", [oc])] if bias else [])
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c" if relu else "y"])]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    return _model(nodes, {"x": [c, *spatial]}, [oc, *spatial], inits)


GEOMETRIES = {
    # name: (C, spatial, OC, batches)
    "mobilenet_7x7_expand": (160, (7, 7), 960, (1, 3, 8)),
    "mobilenet_7x7_project": (960, (7, 7), 160, (1, 8)),        # 4 channel blocks of 240
    "channel_blocks_odd_rows": (300, (5, 5), 50, (1, 3, 8)),     # 2 blocks of 150, OC % 6 == 2
    "classifier_batch_1": (512, (3, 3), 1000, (1, 2)),           # more rows than columns: row bands
    "wide_image": (64, (13, 17), 20, (1, 3)),                    # 221 pixels, several column chunks
    "one_pixel": (24, (1, 1), 7, (1, 5)),
    "conv_1d": (40, (11,), 30, (1, 4)),
    "most_channels": (MAX_CHANNELS, (2, 3), 7, (1, 3)),        # one 16-column panel fills the buffer
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_batch_gemm_matches_onnxruntime(name):
    c, spatial, oc, batches = GEOMETRIES[name]
    model = _conv_model(c, spatial, oc, seed=len(name))
    (entries,) = check_forced(model, ENTRY, {"x": (c, *spatial)}, batches)
    assert entries[-1] == ENTRY  # appended last: earlier indices kept


def test_batch_gemm_without_bias_or_activation():
    model = _conv_model(33, (6, 6), 13, seed=3, bias=False, relu=False)
    check_forced(model, ENTRY, {"x": (33, 6, 6)}, (1, 3))


def test_batch_gemm_with_residual_add_and_relu():
    """ResNet's projection tail: Conv 1x1 -> Add (another input, read per image in the epilogue) -> Relu."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
             helper.make_node("Add", ["c", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    inits = [random_initializer(rng, "w", [40, 70, 1, 1]), random_initializer(rng, "b", [40])]
    model = _model(nodes, {"x": [70, 7, 7], "r": [40, 7, 7]}, [40, 7, 7], inits)
    (entries,) = check_forced(model, ENTRY, {"x": (70, 7, 7), "r": (40, 7, 7)}, (1, 3, 8))
    assert ENTRY in entries  # one kernel: the Add and Relu fused into the Conv


def test_batch_gemm_writes_its_concat_slice():
    """A fire module: two Convs whose outputs are only a channel Concat's inputs write their planes
    into the Concat's buffer (its channel stride, their channel offset), across images."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["e1"]),
             helper.make_node("Conv", ["x", "w2", "b2"], ["e2"]),
             helper.make_node("Concat", ["e1", "e2"], ["y"], axis=1)]
    inits = [random_initializer(rng, "w1", [10, 24, 1, 1]), random_initializer(rng, "b1", [10]),
             random_initializer(rng, "w2", [14, 24, 1, 1]), random_initializer(rng, "b2", [14])]
    model = _model(nodes, {"x": [24, 5, 5]}, [24, 5, 5], inits)
    entries = check_forced(model, ENTRY, {"x": (24, 5, 5)}, (1, 3, 8))
    assert len(entries) == 2  # no Concat kernel: both Convs wrote their slices


def _entries(c, oc, kernel, attrs, runtime_weight=False):
    rng = np.random.default_rng(0)
    group = attrs.get("group", 1)
    w_shape = [oc, c // group, *kernel]
    inits = [] if runtime_weight else [random_initializer(rng, "w", w_shape)]
    ins = {"x": [c, 8, 8]} | ({"w": w_shape} if runtime_weight else {})
    probe = onnx.shape_inference.infer_shapes(_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
                                                     ins, [oc, "oh", "ow"], inits))
    out = [d.dim_value for d in probe.graph.output[0].type.tensor_type.shape.dim][1:]
    model = _model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], ins, out, inits)
    if runtime_weight:  # the weight input has no batch dimension
        model.graph.input[1].CopyFrom(helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape))
    (entries,) = candidate_entries(engine_onnx.convert(model).build())
    return entries


@pytest.mark.parametrize("c, kernel, attrs, offered", [
    (16, [1, 1], {}, True),
    (MAX_CHANNELS, [1, 1], {}, True),
    (MAX_CHANNELS + 8, [1, 1], {}, False),
    (16, [1, 1], {"strides": [2, 2]}, False),
    (16, [1, 1], {"pads": [1, 1, 1, 1]}, False),
    (16, [1, 1], {"group": 2}, False),
    (16, [3, 3], {"pads": [1, 1, 1, 1]}, False),
])
def test_batch_gemm_offered_exactly_where_eligible(c, kernel, attrs, offered):
    assert (ENTRY in _entries(c, 8, kernel, attrs)) == offered


def test_batch_gemm_not_offered_for_a_weight_computed_at_run_time():
    assert ENTRY not in _entries(16, 8, [1, 1], {}, runtime_weight=True)
