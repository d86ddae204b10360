"""The few-input-channel Conv candidate ``conv_strided`` gives ONNX Runtime's result, and is offered
exactly where ``strided_eligible`` says (one group, at most ``MAX_CHANNELS`` input channels and
``MAX_TAPS`` taps, not a plain 1x1, one output row's buffer within ``MAX_BUFFER_FLOATS``).

The candidate is forced through the public dispatch table (``graph.dispatch_table.record``) at
each batch, so it is checked whether or not the tuner would pick it on this machine. The shapes
are chosen against the kernel's blocking: 6 output channels x 16 pixels per register tile (OC not a
multiple of 6, output rows not a multiple of 16, so both edges are partial), groups of up to 8
output rows sharing one copy of their input rows (output heights that leave a short last group),
the copy split by stride phase (strides 1, 2 and 3, different along H and W), zero padding on
either side (asymmetric pads, pads wider than a stride), dilations, and the four first layers
this candidate is for (squeezenet, ResNet, MobileNetV2, ShuffleNet) at their real sizes.
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
from engine_onnx.ops.conv_strided import MAX_BUFFER_FLOATS, MAX_CHANNELS, MAX_TAPS  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4
ENTRY = "conv_strided"


def _model(nodes, x_shape, inits, y_channels, extra_inputs=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])
    ins = [x] + [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *s]) for n, s in extra_inputs]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", y_channels] + [None] * (len(x_shape) - 1))
    graph = helper.make_graph(nodes, "strided", ins, [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_model(c, hw, oc, kernel, attrs, seed, *, bias=True, act="Relu"):
    rng = np.random.default_rng(seed)
    inits = [random_initializer(rng, "w", [oc, c, *kernel])] + ([random_initializer(rng, "b", [oc])] if bias else [])
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c" if act else "y"], **attrs)]
    if act == "Relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif act == "Clip":  # ReLU6 (MobileNetV2's activation)
        inits += [helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]),
                  helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    return _model(nodes, [c, *hw], inits, oc)


def _check_strided(model, x_shape, batches=(1, 3), extra=None):
    """Forces ``conv_strided`` on every task that offers it (candidate 0 elsewhere) at each batch
    and compares with ONNX Runtime; returns the tasks' entry names."""
    return check_forced(model, ENTRY, {"x": tuple(x_shape), **(extra or {})}, batches, rtol=RTOL)


GEOMETRIES = {
    # name: (C, (H, W), OC, kernel, attrs)
    "squeezenet_conv1": (3, (224, 224), 64, [3, 3], {"strides": [2, 2]}),
    "resnet_conv1": (3, (224, 224), 64, [7, 7], {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    "mobilenet_v2_conv1": (3, (224, 224), 32, [3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "shufflenet_conv1": (3, (224, 224), 24, [3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "odd_sizes_stride2": (3, (37, 41), 13, [3, 3], {"strides": [2, 2]}),
    "stride1_one_channel": (1, (19, 23), 7, [3, 3], {"pads": [1, 1, 1, 1]}),
    "stride3_four_channels": (4, (29, 31), 11, [5, 5], {"strides": [3, 3], "pads": [2, 2, 2, 2]}),
    "strides_3x1_asymmetric_pads": (3, (20, 33), 5, [3, 3], {"strides": [3, 1], "pads": [0, 2, 1, 0]}),
    "strides_1x2_wide_pads": (8, (9, 18), 17, [3, 3], {"strides": [1, 2], "pads": [2, 3, 0, 4]}),
    "dilation_2_stride_2": (4, (25, 27), 9, [3, 3], {"strides": [2, 2], "dilations": [2, 2], "pads": [2, 1, 2, 1]}),
    "dilation_3x1_stride_3": (3, (30, 26), 6, [3, 2], {"strides": [3, 3], "dilations": [3, 1]}),
    "six_channels_5x5": (6, (40, 35), 20, [5, 5], {"strides": [2, 2], "pads": [1, 2, 2, 1]}),
    "one_output_channel": (3, (16, 16), 1, [3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "output_one_pixel_wide": (3, (20, 3), 8, [3, 3], {"strides": [2, 2]}),
    "1x1_stride_2": (3, (15, 17), 7, [1, 1], {"strides": [2, 2]}),
    "1x1_padded": (3, (6, 7), 5, [1, 1], {"pads": [1, 0, 0, 1]}),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_strided_matches_onnxruntime(name):
    c, hw, oc, kernel, attrs = GEOMETRIES[name]
    model = _conv_model(c, hw, oc, kernel, attrs, seed=len(name))
    (entries,) = _check_strided(model, [c, *hw])
    assert entries[-1] == ENTRY  # appended: the other candidates keep their indices


@pytest.mark.parametrize("act", ["Clip", None])
def test_strided_with_clip_or_no_activation_and_no_bias(act):
    model = _conv_model(3, (23, 22), 10, [3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, seed=3,
                        bias=act is not None, act=act)
    _check_strided(model, [3, 23, 22])


def test_strided_with_folded_batchnorm_residual_add_and_relu():
    """Conv -> BatchNormalization (folded) -> Add (a residual, read in the epilogue) -> Relu: one
    kernel, the residual read at each tile's pixels, the row's last block included."""
    rng = np.random.default_rng(4)
    oc = 13
    inits = [random_initializer(rng, "w", [oc, 3, 3, 3]),
             helper.make_tensor("scale", TensorProto.FLOAT, [oc], rng.uniform(0.5, 1.5, oc).astype(np.float32)),
             random_initializer(rng, "shift", [oc]), random_initializer(rng, "mean", [oc]),
             helper.make_tensor("var", TensorProto.FLOAT, [oc], rng.uniform(0.5, 2.0, oc).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
             helper.make_node("Add", ["n", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = _model(nodes, [3, 37, 35], inits, oc, extra_inputs=[("r", [oc, 19, 18])])
    entries = _check_strided(model, [3, 37, 35], extra={"r": [oc, 19, 18]})
    assert len(entries) == 1  # BN, Add and Relu fused into the Conv kernel


def test_strided_1d():
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=[2], pads=[2, 1], dilations=[2])]
    model = _model(nodes, [3, 53], [random_initializer(rng, "w", [10, 3, 4]), random_initializer(rng, "b", [10])], 10)
    _check_strided(model, [3, 53])


def test_strided_outputs_concatenated_along_channels():
    """Two first-layer Convs whose outputs meet in a channel Concat: each may write its planes
    straight into its channel slice of the Concat's output, so the batch stride is not its own."""
    rng = np.random.default_rng(8)
    inits = [random_initializer(rng, "w1", [7, 3, 3, 3]), random_initializer(rng, "w2", [5, 3, 3, 3]),
             random_initializer(rng, "b1", [7]), random_initializer(rng, "b2", [5])]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["x", "w2", "b2"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["r1", "c2"], ["y"], axis=1)]
    model = _model(nodes, [3, 21, 20], inits, 12)
    entries = _check_strided(model, [3, 21, 20])
    assert len(entries) == 2  # the Concat has no kernel of its own: both Convs write into its output
    assert all(ENTRY in e for e in entries)


@pytest.mark.parametrize("case, offered", [
    ("first_layer", True),
    ("at_max_channels", True),
    ("past_max_channels", False),
    ("at_max_taps", True),
    ("past_max_taps", False),
    ("two_groups", False),
    ("depthwise", False),
    ("plain_1x1", False),
    ("row_buffer_too_wide", False),
])
def test_strided_offered_exactly_where_eligible(case, offered):
    """Offered for one group, few channels and taps (any stride, pad, dilation), and not for
    grouped Convs, plain 1x1s (read in place by ``conv_pointwise`` and the GEMMs), more than
    ``MAX_CHANNELS`` channels or ``MAX_TAPS`` taps, nor where even one output row's input copy
    would not fit the thread's buffer."""
    side = int(MAX_TAPS ** 0.5)
    wide = MAX_BUFFER_FLOATS // MAX_CHANNELS  # one row of MAX_CHANNELS channels past the buffer
    c, hw, oc, kernel, attrs = {
        "first_layer": (3, (12, 12), 8, [3, 3], {"strides": [2, 2]}),
        "at_max_channels": (MAX_CHANNELS, (10, 10), 4, [3, 3], {"strides": [2, 2]}),
        "past_max_channels": (MAX_CHANNELS + 1, (10, 10), 4, [3, 3], {"strides": [2, 2]}),
        "at_max_taps": (MAX_TAPS // (side * side), (side + 2, side + 3), 5, [side, side], {}),
        "past_max_taps": (MAX_TAPS // (side * side) + 1, (side + 2, side + 3), 5, [side, side], {}),
        "two_groups": (4, (10, 10), 4, [3, 3], {"group": 2}),
        "depthwise": (4, (10, 10), 4, [3, 3], {"group": 4}),
        "plain_1x1": (3, (10, 10), 4, [1, 1], {}),
        "row_buffer_too_wide": (MAX_CHANNELS, (3, wide), 4, [3, 3], {}),
    }[case]
    group = attrs.get("group", 1)
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)]
    model = _model(nodes, [c, *hw], [random_initializer(rng, "w", [oc, c // group, *kernel])], oc)
    (entries,) = candidate_entries(engine_onnx.convert(model).build())
    assert (ENTRY in entries) == offered, entries
    if offered:
        _check_strided(model, [c, *hw], batches=(2,))
