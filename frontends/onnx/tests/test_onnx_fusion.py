"""Elementwise fusion in the ONNX importer: connected elementwise nodes become one kernel.

Each model is built here with ``onnx.helper``, converted by ``engine_onnx.convert``, compiled by
the CPU plugin and run; outputs are compared with ONNX Runtime (or numpy where ONNX Runtime has no
kernel for the dtype). Kernels are counted on the loaded graph's plan: one instruction per kernel
call (``graph.graph_execution.instructions``), named by its task (``graph.compiled_tasks``).
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import engine_onnx  # noqa: E402
from engine_onnx import zoo  # noqa: E402

ort.set_default_logger_severity(3)
F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "fusion", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _build(model: onnx.ModelProto):
    graph = engine_onnx.convert(model).build()
    graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
    return graph


def _kernels(graph) -> list[str]:
    """The kernel each instruction of the plan calls, in order."""
    return [graph.compiled_tasks[ins.task_idx].meta.name for ins in graph.graph_execution.instructions]


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _run(graph, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [t.numpy() for t in graph.run_async([feeds[vi.name] for vi in zoo.graph_inputs(model)])]


def _assert_matches_ort(graph, model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    expected = _ort(model, feeds)
    actual = _run(graph, model, feeds)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.abs(e).max() or 1.0))


def _gelu_nodes(x: str, y: str) -> list[onnx.NodeProto]:
    """GELU as torch exports it before opset 20: x * 0.5 * (1 + erf(x / sqrt 2))."""
    return [helper.make_node("Div", [x, "sqrt2"], ["g_div"]), helper.make_node("Erf", ["g_div"], ["g_erf"]),
            helper.make_node("Add", ["g_erf", "one"], ["g_add"]), helper.make_node("Mul", [x, "g_add"], ["g_mul"]),
            helper.make_node("Mul", ["g_mul", "half"], [y])]


GELU_CONSTS = [_const("sqrt2", np.float32(math.sqrt(2))), _const("one", np.float32(1)),
               _const("half", np.float32(0.5))]


def test_gelu_as_five_nodes_is_one_kernel_and_matches_onnxruntime():
    model = _model(_gelu_nodes("x", "y"), [helper.make_tensor_value_info("x", F32, ["batch", 37])],
                   [helper.make_tensor_value_info("y", F32, ["batch", 37])], GELU_CONSTS)
    graph = _build(model)
    kernels = _kernels(graph)
    assert len(kernels) == 1 and kernels[0].startswith("fused_div_erf_add_mul_mul"), kernels
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 37)).astype(np.float32) * 3
        _assert_matches_ort(graph, model, {"x": x})


def test_symbolic_broadcasting_reads_each_input_at_its_own_position():
    # x [batch, seq] + bias [seq], scaled, tanh, minus a per-row offset [batch, 1]: one kernel whose
    # three inputs broadcast three different ways over dimensions known only at run time.
    nodes = [helper.make_node("Add", ["x", "bias"], ["a"]), helper.make_node("Mul", ["a", "scale"], ["b"]),
             helper.make_node("Tanh", ["b"], ["c"]), helper.make_node("Sub", ["c", "row"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", "seq"]),
                           helper.make_tensor_value_info("bias", F32, ["seq"]),
                           helper.make_tensor_value_info("row", F32, ["batch", 1])],
                   [helper.make_tensor_value_info("y", F32, ["batch", "seq"])], [_const("scale", np.float32(0.7))])
    graph = _build(model)
    assert len(_kernels(graph)) == 1
    assert tuple(graph.meta.symbols) == ("batch", "seq")
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 1), (2, 5), (4, 33)):
        feeds = {"x": rng.standard_normal((batch, seq)).astype(np.float32),
                 "bias": rng.standard_normal(seq).astype(np.float32),
                 "row": rng.standard_normal((batch, 1)).astype(np.float32)}
        _assert_matches_ort(graph, model, feeds)


def test_a_value_with_two_consumers_is_computed_once_and_read_by_both():
    # a feeds Relu and Sigmoid (two consumers) and ReduceSum reads the product: a is its own kernel,
    # Relu, Sigmoid and Mul are one, the reduction another; both outputs are right.
    nodes = [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["r", "s"], ["y"]),
             helper.make_node("ReduceSum", ["y", "axes"], ["total"], keepdims=0)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 16])],
                   [helper.make_tensor_value_info("y", F32, ["batch", 16]),
                    helper.make_tensor_value_info("total", F32, ["batch"])],
                   [_const("w", np.linspace(-1, 1, 16, dtype=np.float32)), _const("axes", np.array([1], np.int64))])
    graph = _build(model)
    kernels = _kernels(graph)
    assert len(kernels) == 3, kernels
    assert kernels[1].startswith("fused_relu_sigmoid_mul"), kernels
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    _assert_matches_ort(graph, model, {"x": x})


def test_a_graph_output_inside_a_chain_is_still_written():
    # a is a graph output and the input of the rest of the chain: the chain is cut there.
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Sub", ["a", "one"], ["b"]),
             helper.make_node("Abs", ["b"], ["c"]), helper.make_node("Sqrt", ["c"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 8])],
                   [helper.make_tensor_value_info("a", F32, ["batch", 8]),
                    helper.make_tensor_value_info("y", F32, ["batch", 8])], [_const("one", np.float32(1))])
    graph = _build(model)
    assert len(_kernels(graph)) == 2
    x = np.random.default_rng(2).standard_normal((6, 8)).astype(np.float32)
    _assert_matches_ort(graph, model, {"x": x})


def test_where_with_a_computed_bool_condition_is_one_kernel():
    # leaky ReLU written out: Where(x > 0, x, x * 0.1), the condition computed in the same kernel.
    nodes = [helper.make_node("Greater", ["x", "zero"], ["cond"]), helper.make_node("Mul", ["x", "slope"], ["neg"]),
             helper.make_node("Where", ["cond", "x", "neg"], ["w"]), helper.make_node("Add", ["w", "b"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 4, 6]),
                           helper.make_tensor_value_info("b", F32, [6])],
                   [helper.make_tensor_value_info("y", F32, ["batch", 4, 6])],
                   [_const("zero", np.float32(0)), _const("slope", np.float32(0.1))])
    graph = _build(model)
    assert len(_kernels(graph)) == 1
    rng = np.random.default_rng(3)
    _assert_matches_ort(graph, model, {"x": rng.standard_normal((2, 4, 6)).astype(np.float32),
                                       "b": rng.standard_normal(6).astype(np.float32)})


def test_casts_inside_a_chain_round_as_separate_kernels_would():
    # float32 -> int32 (truncation) -> + 3 -> float32 -> * 0.5, and float32 -> float16 -> * 3 -> float32:
    # each intermediate keeps its own type inside the one kernel of each chain.
    nodes = [helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32), helper.make_node("Add", ["xi", "three"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=F32), helper.make_node("Mul", ["sf", "half"], ["y"]),
             helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["xh", "three_h"], ["h"]), helper.make_node("Cast", ["h"], ["z"], to=F32)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["n"])],
                   [helper.make_tensor_value_info("y", F32, ["n"]), helper.make_tensor_value_info("z", F32, ["n"])],
                   [_const("three", np.int32(3)), _const("half", np.float32(0.5)),
                    _const("three_h", np.float16(3))])
    graph = _build(model)
    assert len(_kernels(graph)) == 2
    x = (np.random.default_rng(4).standard_normal(1000) * 1000).astype(np.float32)
    y, z = _run(graph, model, {"x": x})
    np.testing.assert_array_equal(y, (x.astype(np.int32) + 3).astype(np.float32) * np.float32(0.5))
    np.testing.assert_array_equal(z, (x.astype(np.float16) * np.float16(3)).astype(np.float32))
    # (not compared with ONNX Runtime: its graph optimisations compute the float16 Mul in float32)


def test_integer_wraparound_in_the_middle_of_a_chain():
    # int8 arithmetic wraps at the intermediate, not in the wider type the C expression would use
    nodes = [helper.make_node("Add", ["x", "hundred"], ["a"]), helper.make_node("Cast", ["a"], ["y"], to=F32)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.INT8, [5])],
                   [helper.make_tensor_value_info("y", F32, [5])], [_const("hundred", np.int8(100))])
    graph = _build(model)
    assert len(_kernels(graph)) == 1
    x = np.array([-128, -1, 0, 27, 100], np.int8)
    (y,) = _run(graph, model, {"x": x})
    np.testing.assert_array_equal(y, (x + np.int8(100)).astype(np.float32))  # numpy wraps int8 too


def test_decomposed_layernorm_fuses_between_the_reductions_but_not_across_them():
    # LayerNorm as older exports write it: the [batch, seq, 1] statistics are computed once per row
    # (Add + Sqrt in one kernel), never inlined into the [batch, seq, d] kernel that divides by them.
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]), helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"]),
             helper.make_node("Div", ["d", "std"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
             helper.make_node("Add", ["g", "beta"], ["y"])]
    rng = np.random.default_rng(5)
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", "seq", 32])],
                   [helper.make_tensor_value_info("y", F32, ["batch", "seq", 32])],
                   [_const("two", np.float32(2)), _const("eps", np.float32(1e-5)),
                    _const("gamma", rng.standard_normal(32).astype(np.float32)),
                    _const("beta", rng.standard_normal(32).astype(np.float32))])
    graph = _build(model)
    kernels = _kernels(graph)
    assert len(kernels) == 6, kernels  # mean, sub, pow, mean, add+sqrt, div+mul+add
    assert kernels[4].startswith("fused_add_sqrt") and kernels[5].startswith("fused_div_mul_add"), kernels
    _assert_matches_ort(graph, model, {"x": rng.standard_normal((3, 7, 32)).astype(np.float32)}, rtol=1e-4)


ELEMENTWISE = {"add", "sub", "mul", "div", "pow", "mod", "sqrt", "exp", "log", "erf", "tanh", "sigmoid", "relu",
               "neg", "abs", "reciprocal", "where", "cast", "equal", "less", "greater", "not", "and", "or", "max",
               "min", "sum", "mean", "clip", "gelu"}


def _elementwise(kernel: str) -> bool:
    base = kernel.rsplit("_", 1)[0]
    return base.startswith("fused_") or base in ELEMENTWISE


def _unfused_chains(graph) -> list[tuple[str, str]]:
    """(producer, consumer) kernel pairs that should have been one kernel: an elementwise kernel's
    output read by exactly one instruction, elementwise too, with the same output shape, and not a
    graph output."""
    ex = graph.graph_execution
    kernels = _kernels(graph)
    readers: dict[int, list[int]] = {}
    for i, ins in enumerate(ex.instructions):
        for t in set(ins.inputs):
            readers.setdefault(t, []).append(i)
    pairs = []
    for i, ins in enumerate(ex.instructions):
        for t in ins.outputs:
            users = readers.get(t, [])
            if (_elementwise(kernels[i]) and t not in ex.outputs_index and len(users) == 1
                    and _elementwise(kernels[users[0]])
                    and ex.tensor_signatures[t].shape == ex.tensor_signatures[ex.instructions[users[0]].outputs[0]].shape):
                pairs.append((kernels[i], kernels[users[0]]))
    return pairs


def test_activation_epilogue_after_matmul_still_fused():
    # MatMul -> Relu -> Sigmoid: the activations stay the MatMul kernel's epilogue
    w = np.random.default_rng(6).standard_normal((16, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Sigmoid", ["r"], ["s"]), helper.make_node("Add", ["s", "x2"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 16]),
                           helper.make_tensor_value_info("x2", F32, ["batch", 8])],
                   [helper.make_tensor_value_info("y", F32, ["batch", 8])], [_const("w", w)])
    graph = _build(model)
    kernels = _kernels(graph)
    assert len(kernels) <= 2 and kernels[0].startswith("matmul"), kernels
    assert not any(k.startswith(("relu", "sigmoid", "fused_relu", "fused_sigmoid")) for k in kernels), kernels
    rng = np.random.default_rng(7)
    _assert_matches_ort(graph, model, {"x": rng.standard_normal((3, 16)).astype(np.float32),
                                       "x2": rng.standard_normal((3, 8)).astype(np.float32)}, rtol=1e-4)


@pytest.mark.slow
def test_transformer_encoder_has_no_elementwise_chain_left_unfused():
    pytest.importorskip("torch")
    model = zoo.transformer_encoder(layers=2, seq=16)
    graph = _build(model)
    # before fusion, each layer's feed-forward bias Add fed its residual Add: two kernels, two passes
    assert _unfused_chains(graph) == []
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 16, 64)).astype(np.float32)
        _assert_matches_ort(graph, model, {"x": x}, rtol=1e-4)


def test_erf_in_elementwise_kernels_is_within_two_units_in_the_last_place():
    # elementwise kernels compute float32 erf with their own branch-free polynomial (so the loop
    # vectorises); checked against the exact value on a dense grid and at the special values.
    import math

    model = _model([helper.make_node("Erf", ["x"], ["y"])], [helper.make_tensor_value_info("x", F32, ["n"])],
                   [helper.make_tensor_value_info("y", F32, ["n"])])
    graph = _build(model)
    grid = np.linspace(-6, 6, 480001, dtype=np.float32)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-7, 0.92, -0.92, 2.0, 3.92, -3.92, np.inf, -np.inf],
                       np.float32)
    x = np.concatenate([grid, special])
    (y,) = _run(graph, model, {"x": x})
    exact = np.array([math.erf(float(v)) for v in x])
    err = np.abs(y.astype(np.float64) - exact)
    assert float(err.max()) <= 1.5e-7
    tiny = np.abs(exact) < 1e-3
    assert float((err[tiny] / np.maximum(np.abs(exact[tiny]), 1e-38)).max()) <= 2.4e-7  # relative near 0
    assert np.signbit(y[len(grid) + 1]) and y[len(grid)] == 0  # erf(-0) = -0
    (nan,) = _run(graph, model, {"x": np.array([np.nan], np.float32)})
    assert np.isnan(nan[0])


def test_exp_in_elementwise_kernels_is_within_one_unit_in_the_last_place():
    # float32 Exp (and Sigmoid, Softmax) use a branch-free exp so the loop vectorises: one unit in
    # the last place over the normal range, overflow to inf and gradual underflow as the C library,
    # NaN kept; checked on a dense grid around every edge.
    model = _model([helper.make_node("Exp", ["x"], ["y"])], [helper.make_tensor_value_info("x", F32, ["n"])],
                   [helper.make_tensor_value_info("y", F32, ["n"])])
    graph = _build(model)
    grid = np.linspace(-110, 90, 400001, dtype=np.float32)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 88.72, 88.7228, 88.7229, -87.3, -100.0, -103.9, -104.5,
                        np.inf, -np.inf], np.float32)
    x = np.concatenate([grid, special])
    (y,) = _run(graph, model, {"x": x})
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64))
        exact32 = exact.astype(np.float32)
    normal = np.isfinite(exact32) & (exact32 >= np.finfo(np.float32).tiny)
    ulps = np.abs(y[normal].astype(np.float64) - exact[normal]) / np.spacing(exact32[normal]).astype(np.float64)
    assert float(ulps.max()) <= 1.0
    assert np.array_equal(np.isinf(y), np.isinf(exact32))  # overflow where the float32 result overflows
    small = exact32 < np.finfo(np.float32).tiny
    assert float(np.abs(y[small] - exact[small]).max()) <= 2 * np.finfo(np.float32).smallest_subnormal
    (nan,) = _run(graph, model, {"x": np.array([np.nan], np.float32)})
    assert np.isnan(nan[0])


@pytest.mark.parametrize("shape, axis", [((2, 3, 1000), -1), ((5, 7), 1), ((2, 9, 4), 1), ((1, 4, 13, 13), 1),
                                         ((64, 4, 64, 64), -1)])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_rows_match_onnxruntime(shape, axis, op):
    # contiguous rows (the vectorised eight-lane form, row lengths not a multiple of 8 included),
    # strided rows (a middle axis), and a size large enough to run on every thread
    rng = np.random.default_rng(3)
    model = _model([helper.make_node(op, ["x"], ["y"], axis=axis)],
                   [helper.make_tensor_value_info("x", F32, list(shape))],
                   [helper.make_tensor_value_info("y", F32, list(shape))])
    x = (rng.standard_normal(shape) * 8).astype(np.float32)
    x.flat[::97] = -np.inf  # masked positions, as an attention mask gives
    (expected,) = _ort(model, {"x": x})
    (actual,) = _run(_build(model), model, {"x": x})
    masked = np.isinf(expected)
    assert np.array_equal(masked, np.isinf(actual)) and np.array_equal(expected[masked], actual[masked])
    scale = float(np.abs(expected[~masked]).max())
    np.testing.assert_allclose(actual[~masked], expected[~masked], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("bias_shape, fused", [((24,), True), ((1, 1, 24), True), ((2, 1, 1, 24), False),
                                               ((7, 24), False)])
def test_a_matmul_bias_add_along_the_last_axis_runs_in_the_matmul(bias_shape, fused):
    # torch's Linear on a [batch, seq, d] input exports MatMul then Add(bias [n]): one kernel, the
    # Relu after it too. A bias that broadcasts the output to more axes, or varies along rows, is
    # a kernel of its own; all of them give ONNX Runtime's values.
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    out_shape = [2, 7, 24] if len(bias_shape) < 4 else [2, 2, 7, 24]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [2, 7, 16])],
                   [helper.make_tensor_value_info("y", F32, out_shape)],
                   [_const("w", rng.standard_normal((16, 24)).astype(np.float32)),
                    _const("b", rng.standard_normal(bias_shape).astype(np.float32))])
    graph = _build(model)
    assert (len(_kernels(graph)) == 1) == fused, _kernels(graph)
    _assert_matches_ort(graph, model, {"x": rng.standard_normal((2, 7, 16)).astype(np.float32)})



def _constant(name: str, value, dtype=np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype), name))


def _conv_then(after, x_shape=(2, 6, 9, 9)):
    """A 3x3 Conv (6 -> 5 channels) and its BatchNormalization ``bn``, then the nodes ``after``
    (Constant nodes among them, placed after the Conv as Caffe2 exports its Scale weights)."""
    rng = np.random.default_rng(11)
    oc = 5
    inits = [_const("w", rng.standard_normal((oc, x_shape[1], 3, 3)).astype(np.float32)),
             _const("b", rng.standard_normal(oc).astype(np.float32)),
             _const("gamma", rng.uniform(0.5, 2, oc).astype(np.float32)),
             _const("beta", rng.standard_normal(oc).astype(np.float32)),
             _const("mean", rng.standard_normal(oc).astype(np.float32)),
             _const("var", rng.uniform(0.5, 2, oc).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"]), *after]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, list(x_shape))],
                   [helper.make_tensor_value_info("y", F32, [None] * 4)], inits)
    return model, {"x": rng.standard_normal(x_shape).astype(np.float32)}


@pytest.mark.parametrize("after", [
    # Caffe2's Scale: Mul and Add by per-channel vectors, unsqueezed to [C, 1, 1] after the Conv
    [_constant("s", np.linspace(-2, 2, 5)), _constant("axes", [1, 2], np.int64),
     helper.make_node("Unsqueeze", ["s", "axes"], ["s3"]), helper.make_node("Mul", ["bn", "s3"], ["m"]),
     _constant("t", np.linspace(1, 3, 5).reshape(5, 1, 1)), helper.make_node("Add", ["t", "m"], ["a"]),
     helper.make_node("Relu", ["a"], ["y"])],
    # a scalar Mul, a Sub with the constant first, a Div by a [1, C, 1, 1] vector
    [_constant("k", 1.5), helper.make_node("Mul", ["bn", "k"], ["m"]),
     _constant("t", np.linspace(-1, 1, 5).reshape(5, 1, 1)), helper.make_node("Sub", ["t", "m"], ["s"]),
     _constant("d", np.linspace(0.5, 2, 5).reshape(1, 5, 1, 1)), helper.make_node("Div", ["s", "d"], ["y"])],
], ids=["caffe2_scale", "mul_sub_div"])
def test_per_channel_constant_arithmetic_after_a_conv_folds_into_its_weights(after):
    model, feeds = _conv_then(after)
    graph = _build(model)
    assert len(_kernels(graph)) == 1 and _kernels(graph)[0].startswith("conv"), _kernels(graph)
    _assert_matches_ort(graph, model, feeds)


def test_arithmetic_that_varies_along_the_plane_or_divides_by_zero_is_not_folded():
    model, feeds = _conv_then([
        _constant("row", np.linspace(-1, 1, 9)), helper.make_node("Mul", ["bn", "row"], ["m"]),
        _constant("z", np.array([1, 2, 0, 4, 5]).reshape(5, 1, 1)), helper.make_node("Div", ["m", "z"], ["y"])])
    graph = _build(model)
    assert len(_kernels(graph)) == 2, _kernels(graph)  # the Conv, then Mul and Div as one group
    expected = _ort(model, feeds)[0]
    actual = _run(graph, model, feeds)[0]
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5,
                               atol=1e-5 * float(np.abs(expected[finite]).max()))
