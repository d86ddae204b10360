"""The Winograd Conv candidates ``conv_winograd`` (F(2x2, 3x3)) and ``conv_winograd4`` (F(4x4, 3x3))
give ONNX Runtime's result, and are offered exactly for the geometries they compute (3x3, stride 1,
dilation 1, one group, a constant weight, at least ``MIN_CHANNELS`` input channels; F(4x4) up to a
transformed weight of ``MAX_WEIGHT4_BYTES``).

The candidate is forced through the public dispatch table (``graph.dispatch_table.record``) at
each batch, so it is checked whether or not the tuner would pick it on this machine. The shapes
are chosen against the kernel's blocking: 2x2 or 4x4 output tiles (odd sizes leave partial tiles at
the right and bottom), 16-tile panels that straddle tile rows and images, work items of one or two panels
running over the whole batch's tiles (so they start and end mid-row and mid-image), input channels in
blocks of at most 128 (C = 300 and 512 cross block boundaries), output channels in blocks of at
most 48 rows of 6-row panels (OC not a multiple of 6 or 16), a symbolic batch.
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
from engine_onnx.ops.conv_winograd import MAX_WEIGHT4_BYTES, MIN_CHANNELS, winograd_defs  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4
ENTRIES = ("conv_winograd", "conv_winograd4")
TILE = {"conv_winograd": 2, "conv_winograd4": 4}


@pytest.fixture(params=ENTRIES)
def entry(request) -> str:
    return request.param


def _model(nodes, x_shape, y_shape, inits, extra_inputs=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])
    ins = [x] + [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in extra_inputs]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *y_shape])
    graph = helper.make_graph(nodes, "winograd", ins, [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check_winograd(model, x_shape, entry, batches=(1, 3)):
    """Forces ``entry`` on every task that offers it (candidate 0 elsewhere) at each batch and
    compares with ONNX Runtime; returns the tasks' entry names."""
    return check_forced(model, entry, {"x": tuple(x_shape)}, batches, rtol=RTOL)


def _conv_model(c, h, w, oc, pads, seed, *, bias=True, relu=True):
    rng = np.random.default_rng(seed)
    inits = [random_initializer(rng, "w", [oc, c, 3, 3])] + ([random_initializer(rng, "b", [oc])] if bias else [])
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c" if relu else "y"], pads=pads)]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    return _model(nodes, [c, h, w], [oc, oh, ow], inits)


GEOMETRIES = {
    # name: (C, H, W, OC, pads)
    "squeezenet_13": (16, 13, 13, 7, [1, 1, 1, 1]),
    "odd_27_odd_channels": (29, 27, 27, 35, [1, 1, 1, 1]),
    "wide_55": (9, 55, 55, 13, [1, 1, 1, 1]),
    "7x7_unpadded": (11, 7, 7, 17, [0, 0, 0, 0]),
    "1x1_image_pad1": (8, 1, 1, 5, [1, 1, 1, 1]),
    "asymmetric_pads": (10, 9, 12, 6, [0, 1, 2, 0]),
    "channel_blocks_and_row_blocks": (300, 6, 9, 50, [1, 1, 1, 1]),
    "deep_512": (512, 8, 7, 64, [1, 1, 1, 1]),
    "many_output_channels": (24, 5, 5, 197, [1, 0, 1, 0]),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_winograd_matches_onnxruntime(name, entry):
    c, h, w, oc, pads = GEOMETRIES[name]
    model = _conv_model(c, h, w, oc, pads, seed=len(name))
    (entries,) = _check_winograd(model, [c, h, w], entry)
    assert entries.index(entry) > entries.index("conv_implicit")  # appended: earlier indices kept
    assert entries[-1] == "conv_winograd4"  # the last one appended


def test_winograd_over_chunks_of_small_images(entry):
    """Small images are transformed several at a time (their tiles share panels): batches of a
    whole chunk, more than one chunk, and a partial last chunk."""
    model = _conv_model(11, 7, 7, 17, [0, 0, 0, 0], seed=7)
    _check_winograd(model, [11, 7, 7], entry, batches=(14, 17, 30))


def _defines(c, oc, oh, ow, entry="conv_winograd") -> dict[str, int]:
    """The geometry defines of ``entry``, by their F(2x2) names."""
    lines = [line.split() for line in winograd_defs(c, oc, oh, ow, m=TILE[entry]).splitlines()]
    return {name.removesuffix("4") if entry.endswith("4") else name: int(value) for _, name, value in lines}


@pytest.mark.parametrize("entry, c, h, w, oc, batches", [
    ("conv_winograd", 16, 13, 13, 50, (8, 5)),    # 49 tiles an image, 32-tile work items straddling images
    ("conv_winograd", 12, 7, 9, 20, (8, 7)),      # 16-tile work items over 20-tile images: runs of 4 and 12 lanes
    ("conv_winograd", 9, 55, 55, 13, (1, 2)),     # 28-tile rows: work items end mid-row; batch 1 ends on a 16-tile item
    ("conv_winograd4", 16, 21, 21, 50, (8, 5)),   # 36 tiles an image, 16-tile work items straddling images
    ("conv_winograd4", 12, 7, 9, 20, (8, 7)),     # 6-tile images, several in one work item
    ("conv_winograd4", 9, 55, 55, 13, (1, 2)),    # 14-tile rows, 32-tile work items end mid-row
])
def test_winograd_work_items_span_images(entry, c, h, w, oc, batches):
    """A work item is a run of consecutive tiles of the whole batch (image, tile row, tile column)
    and may begin or end mid-row or mid-image; batches that end on a partial item and partial panel."""
    wnb = _defines(c, oc, h, w, entry)["WNB"]
    m = TILE[entry]
    tiles = -(-h // m) * -(-w // m)
    assert tiles % wnb  # items do straddle images (and rows)
    model = _conv_model(c, h, w, oc, [1, 1, 1, 1], seed=c + h)
    _check_winograd(model, [c, h, w], entry, batches=batches)


@pytest.mark.parametrize("c, h, w, oc, in_workspace", [
    (300, 14, 14, 40, 0),   # 49-tile images, but 16-tile work items so V of all 300 channels fits the stack
    (520, 7, 7, 40, 1),     # too many channels for the stack: each thread's V in its slot of the workspace
])
def test_winograd_transformed_input_buffer(c, h, w, oc, in_workspace):
    """A thread transforms its group's tiles for every input channel block into a buffer of its own:
    on its stack where it fits (work items narrowed to 16 tiles for it), else its slot of the
    workspace (``WVWS``)."""
    defines = _defines(c, oc, h, w)
    assert defines["WVWS"] == in_workspace and defines["WKC"] < c and defines["WNB"] == 16
    model = _conv_model(c, h, w, oc, [1, 1, 1, 1], seed=c)
    _check_winograd(model, [c, h, w], "conv_winograd", batches=(1, 3))


@pytest.mark.parametrize("c, h, w, oc, in_workspace", [
    (100, 14, 14, 40, 0),   # 36 taps: V of 100 channels fits the stack only with 16-tile work items
    (300, 9, 9, 40, 1),     # V of 300 channels does not: each thread's V in its slot of the workspace
])
def test_winograd4_transformed_input_buffer(c, h, w, oc, in_workspace):
    """F(4x4)'s 36 taps fill the thread's buffer 2.25x sooner: the same two places for ``V``."""
    defines = _defines(c, oc, h, w, "conv_winograd4")
    assert defines["WVWS"] == in_workspace and defines["WNB"] == 16
    model = _conv_model(c, h, w, oc, [1, 1, 1, 1], seed=c)
    _check_winograd(model, [c, h, w], "conv_winograd4", batches=(1, 3))


def test_winograd_without_bias_or_activation(entry):
    model = _conv_model(12, 10, 11, 9, [1, 1, 1, 1], seed=5, bias=False, relu=False)
    _check_winograd(model, [12, 10, 11], entry)


def test_winograd_with_folded_batchnorm_residual_add_and_relu(entry):
    """ResNet's block tail: Conv -> BatchNormalization (folded into the weight before the transform)
    -> Add (the residual, read in the epilogue) -> Relu, one kernel."""
    rng = np.random.default_rng(2)
    ch = 12
    inits = [random_initializer(rng, "w", [ch, ch, 3, 3]),
             helper.make_tensor("scale", TensorProto.FLOAT, [ch], rng.uniform(0.5, 1.5, ch).astype(np.float32)),
             random_initializer(rng, "shift", [ch]), random_initializer(rng, "mean", [ch]),
             helper.make_tensor("var", TensorProto.FLOAT, [ch], rng.uniform(0.5, 2.0, ch).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
             helper.make_node("Add", ["n", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = _model(nodes, [ch, 9, 10], [ch, 9, 10], inits)
    entries = _check_winograd(model, [ch, 9, 10], entry, batches=(1, 3, 8))
    assert len(entries) == 1  # BN, Add and Relu fused into the Conv kernel


def test_winograd_residual_over_work_items_straddling_images(entry):
    """The residual plane of each output tile is the one of its own image, where a work item's
    tiles belong to two images (49 tiles an image, 32-tile items) and output channels span blocks."""
    rng = np.random.default_rng(3)
    ch = 52
    inits = [random_initializer(rng, "w", [ch, ch, 3, 3]), random_initializer(rng, "b", [ch])]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["x", "c"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = _model(nodes, [ch, 13, 13], [ch, 13, 13], inits)
    entries = _check_winograd(model, [ch, 13, 13], entry, batches=(8, 3))
    assert len(entries) == 1


def _offered(c, oc, kernel, attrs, runtime_weight=False, entry="conv_winograd") -> bool:
    rng = np.random.default_rng(0)
    group = attrs.get("group", 1)
    w_shape = [oc, c // group, *kernel]
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    inits = [] if runtime_weight else [random_initializer(rng, "w", w_shape)]
    extra = [("w", w_shape)] if runtime_weight else []
    probe = onnx.shape_inference.infer_shapes(_model([node], [c, 12, 12], [oc, "oh", "ow"], inits, extra))
    out = [d.dim_value for d in probe.graph.output[0].type.tensor_type.shape.dim][1:]
    graph = engine_onnx.convert(_model([node], [c, 12, 12], out, inits, extra)).build()
    (entries,) = candidate_entries(graph)
    return entry in entries


@pytest.mark.parametrize("kernel, attrs, expected", [
    ([3, 3], {"pads": [1, 1, 1, 1]}, True),
    ([3, 3], {}, True),
    ([3, 3], {"pads": [0, 2, 1, 0]}, True),
    ([3, 3], {"auto_pad": "SAME_UPPER"}, True),
    ([3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2]}, False),
    ([3, 3], {"pads": [1, 1, 1, 1], "strides": [1, 2]}, False),
    ([3, 3], {"pads": [2, 2, 2, 2], "dilations": [2, 2]}, False),
    ([3, 3], {"pads": [1, 1, 1, 1], "group": 2}, False),
    ([5, 5], {"pads": [2, 2, 2, 2]}, False),
    ([3, 1], {"pads": [1, 0, 1, 0]}, False),
    ([1, 1], {}, False),
])
def test_winograd_is_offered_exactly_for_3x3_stride_1(kernel, attrs, expected, entry):
    assert _offered(16, 8, kernel, attrs, entry=entry) == expected


def test_winograd_is_not_offered_for_a_weight_computed_at_run_time(entry):
    assert not _offered(16, 8, [3, 3], {"pads": [1, 1, 1, 1]}, runtime_weight=True, entry=entry)


def test_winograd_is_not_offered_below_the_channel_floor(entry):
    assert not _offered(MIN_CHANNELS - 1, 8, [3, 3], {"pads": [1, 1, 1, 1]}, entry=entry)
    assert _offered(MIN_CHANNELS, 8, [3, 3], {"pads": [1, 1, 1, 1]}, entry=entry)


def test_winograd4_is_not_offered_for_a_large_weight():
    """F(4x4)'s transformed weight (36 floats per channel pair) is kept under ``MAX_WEIGHT4_BYTES``;
    F(2x2) is offered at any size."""
    pairs = MAX_WEIGHT4_BYTES // (36 * 4)
    c = 64
    fits, over = pairs // c, pairs // c + 1
    assert _offered(c, fits, [3, 3], {"pads": [1, 1, 1, 1]}, entry="conv_winograd4")
    assert not _offered(c, over, [3, 3], {"pads": [1, 1, 1, 1]}, entry="conv_winograd4")
    assert _offered(c, over, [3, 3], {"pads": [1, 1, 1, 1]}, entry="conv_winograd")
