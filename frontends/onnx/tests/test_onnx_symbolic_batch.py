"""A symbolic batch never gives a wrong shape: constant shapes that bake in the batch a model was
exported at are rewritten where the batch provably flows through axis 0, else refused with the node.

The reference is ONNX Runtime run on each sample alone, the outputs concatenated: the models here
reshape to a constant ``[1, N]``, which ONNX Runtime cannot run at a larger batch. Tolerance as in
test_onnx_import.py: ``1e-4 * |ort| + 1e-4 * max|ort|`` elementwise.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine  # noqa: E402
import engine_onnx  # noqa: E402
from engine_onnx import zoo  # noqa: E402
from engine_onnx.errors import UnsupportedModelError  # noqa: E402
from onnx_support import gpu_kinds, gpu_reason, random_initializer, small_model, value_info  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4


def _per_sample(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """Every output of ONNX Runtime run on each row of ``x`` alone, concatenated along axis 0."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = zoo.graph_inputs(model)[0].name
    rows = [sess.run(None, {name: x[i:i + 1]}) for i in range(x.shape[0])]
    return [np.concatenate([r[k] for r in rows]) for k in range(len(rows[0]))]


def _check_per_sample(model: onnx.ModelProto, graph, x: np.ndarray) -> float:
    """``graph``'s outputs for ``x`` against ``_per_sample``; returns the largest absolute difference."""
    expected = _per_sample(model, x)
    actual = [a.numpy() for a in graph.run_async([x])]
    assert len(actual) == len(expected)
    worst = 0.0
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape)
        scale = float(np.abs(e).max())
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * scale)
        worst = max(worst, float(np.abs(a - e).max()))
    return worst


def _flatten_head(batch, target=(1, 8), *, before: list | None = None) -> onnx.ModelProto:
    """Conv → GlobalAveragePool → Reshape(constant ``target``) → Gemm, as the light models end;
    ``batch`` is the input's declared leading size (an int, or a ``dim_param`` name)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), *(before or []),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Reshape", ["p", "shape"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc", "bias"], ["y"], name="fc", transB=1)]
    inits = [random_initializer(rng, "w", [8, 4, 3, 3]), random_initializer(rng, "fc", [5, 8]),
             random_initializer(rng, "bias", [5]),
             helper.make_tensor("shape", TensorProto.INT64, [len(target)], list(target))]
    return small_model(nodes, [value_info("x", TensorProto.FLOAT, [batch, 4, 6, 6])],
                       [value_info("y", TensorProto.FLOAT, [batch, 5])], inits, opset=13)


def _refusal(model: onnx.ModelProto, **kwargs) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        engine_onnx.convert(model, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("batch", [1, 3])
def test_constant_reshape_under_batch_symbol_keeps_the_batch(batch):
    model = _flatten_head(1)
    graph = engine_onnx.convert(model, batch_symbol="batch").build()
    assert graph.meta.outputs[0].shape_str() == "[batch, 5]"
    x = np.random.default_rng(batch).standard_normal((batch, 4, 6, 6)).astype(np.float32)
    _check_per_sample(model, graph, x)


def test_constant_reshape_of_a_dim_param_batch_keeps_the_batch():
    model = _flatten_head("N")
    graph = engine_onnx.convert(model).build()
    assert tuple(graph.meta.symbols) == ("N",)
    assert graph.meta.outputs[0].shape_str() == "[N, 5]"
    x = np.random.default_rng(3).standard_normal((3, 4, 6, 6)).astype(np.float32)
    _check_per_sample(model, graph, x)


def test_reshape_that_splits_the_batch_into_static_axes_is_refused_with_the_node():
    text = _refusal(_flatten_head("N", (2, 4)))
    assert "flatten (Reshape)" in text
    assert "[N, 8, 1, 1] (N * 8 elements) to the constant shape [2, 4] (8 elements): valid only at N = 1" in text


def test_constant_reshape_after_rows_are_mixed_is_refused():
    # A Softmax over axis 0 mixes the samples: keeping the batch in the Reshape would not be what
    # each sample alone gives, so nothing is rewritten.
    text = _refusal(_mixing_model())
    assert "flatten (Reshape)" in text and "not proved to flow through axis 0" in text


def _mixing_model() -> onnx.ModelProto:
    model = _flatten_head("N")
    for node in model.graph.node:
        if node.name == "relu":
            node.CopyFrom(helper.make_node("Softmax", ["c"], ["r"], name="relu", axis=0))
    return model


def test_flatten_with_minus_one_keeps_onnx_semantics_and_a_batch_symbol_refuses_its_output():
    # [1, -1] is defined by ONNX at any batch ([1, N * 8]): a dim_param model keeps that meaning
    # (ONNX Runtime agrees); the Gemm after it then cannot take N * 8 inputs and says so.
    text = _refusal(_flatten_head("N", (1, -1)))
    assert "fc (Gemm)" in text and "N * 8" in text
    # Without the Gemm, under a batch symbol, the output no longer has the batch on axis 0.
    x = value_info("x", TensorProto.FLOAT, [1, 8, 1, 1])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["y"], name="flat")]
    model = small_model(nodes, [x], [value_info("y", TensorProto.FLOAT, [1, 8])],
                        [helper.make_tensor("shape", TensorProto.INT64, [2], [1, -1])])
    text = _refusal(model, batch_symbol="batch")
    assert "y (output): declared with the batch on axis 0, but its shape is [1, batch * 8]" in text


def test_concat_of_a_batch_one_constant_beside_a_symbolic_batch_is_refused():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Concat", ["x", "row"], ["y"], name="join", axis=1)]
    model = small_model(nodes, [value_info("x", TensorProto.FLOAT, ["N", 4])],
                        [value_info("y", TensorProto.FLOAT, [None, 7])], [random_initializer(rng, "row", [1, 3])])
    text = _refusal(model)
    assert "join (Concat)" in text and "[1, 3] does not match [N, 4]" in text


def test_squeeze_of_the_batch_axis_is_refused():
    nodes = [helper.make_node("Squeeze", ["x", "axes"], ["y"], name="drop")]
    model = small_model(nodes, [value_info("x", TensorProto.FLOAT, [1, 4])], [value_info("y", TensorProto.FLOAT, [4])],
                        [helper.make_tensor("axes", TensorProto.INT64, [1], [0])])
    text = _refusal(model, batch_symbol="batch")
    assert "drop (Squeeze)" in text and "axis 0 of size batch" in text


# -- the shipped light models that end with a constant Reshape, with their own weights ----------------

#: The shipped models with a ``Reshape`` of the batch to a constant target.
RESHAPED = ("bvlc_alexnet", "inception_v1", "inception_v2", "resnet50", "shufflenet", "vgg19", "zfnet512")


def _with_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its final Softmax's input as a second output: the shipped weights (all 0.02)
    make every class's probability equal, so the logits are what tells the samples apart."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"][-1]
    model.graph.output.append(value_info(softmax.input[0], TensorProto.FLOAT, [1, 1000]))
    return model


@pytest.fixture(scope="module", params=RESHAPED)
def light(request):
    """(name, the model with its logits as an output, its graph under ``batch_symbol="batch"``),
    converted once per module. Candidate 0 everywhere keeps one rounding order for the equal
    logits of the shipped weights (as test_onnx_import.py's shipped-weights test does)."""
    model = _with_logits(onnx.load(zoo.light_model_path(request.param)))
    bundle = engine_onnx.convert(model, batch_symbol="batch").to_bytes()
    return request.param, model, engine.load_compiled_graph(bundle, dispatch_policy="first")


@pytest.mark.slow
def test_shipped_light_model_at_batch_3_matches_onnxruntime_per_sample(light):
    name, model, graph = light
    assert tuple(graph.meta.symbols) == ("batch",)
    assert [o.shape_str() for o in graph.meta.outputs] == ["[batch, 1000]", "[batch, 1000]"]
    x = np.random.default_rng(3).standard_normal((3, 3, 224, 224)).astype(np.float32)
    _check_per_sample(model, graph, x)


@pytest.mark.parametrize("kind", ["cpu", "opencl"])
def test_reshape_valid_at_one_value_of_another_symbol_pins_it(kind):
    # torch bakes the traced sequence length into an attention reshape: [N, S, 4] to [0, 8] holds
    # at S = 2 only. The conversion says so, naming the node, and the bundle takes S = 2 alone:
    # any other S is refused by input validation before a kernel runs, on the CPU and on a GPU kind.
    if kind != "cpu" and kind not in gpu_kinds():
        pytest.skip(str(gpu_reason()))
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="fold")]
    model = small_model(nodes, [value_info("x", TensorProto.FLOAT, ["N", "S", 4])],
                        [value_info("y", TensorProto.FLOAT, ["N", 8])],
                        [helper.make_tensor("shape", TensorProto.INT64, [2], [0, 8])])
    with pytest.warns(engine_onnx.SymbolPinnedWarning, match=r"S fixed to 2: fold \(Reshape\)") as caught:
        builder = engine_onnx.convert(model, device=kind, io_device="cpu")
    pins = [w.message.pin for w in caught if isinstance(w.message, engine_onnx.SymbolPinnedWarning)]
    assert [(p.symbol, p.value, p.node) for p in pins] == [("S", 2, "fold")]
    graph = builder.build()
    assert graph.meta.symbols == ("N",)
    assert [i.shape_str() for i in graph.meta.inputs] == ["[N, 2, 4]"]
    assert graph.meta.outputs[0].shape_str() == "[N, 8]"
    x = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    np.testing.assert_array_equal(graph.run_async([x])[0].numpy(), x.reshape(3, 8))
    with pytest.raises(engine.InputError, match="dimension 1 must be 2, got 3"):
        graph.run_async([np.zeros((3, 3, 4), np.float32)])


def test_engine_convert_reports_a_pinned_symbol(tmp_path, capsys):
    import json

    from engine.cli.main import main

    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="fold")]
    model = small_model(nodes, [value_info("x", TensorProto.FLOAT, ["N", "S", 4])],
                        [value_info("y", TensorProto.FLOAT, ["N", 8])],
                        [helper.make_tensor("shape", TensorProto.INT64, [2], [0, 8])])
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "a.cgb")]) == 0
    out = capsys.readouterr()
    assert out.err == ("note: S fixed to 2: fold (Reshape) holds only at S = 2 (reshape of [N, S, 4] to [N, 8]); "
                       "the bundle takes S = 2 only\n")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "b.cgb"), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["pins"] == [{"symbol": "S", "value": 2, "node": "fold", "op_type": "Reshape",
                                            "reason": "reshape of [N, S, 4] to [N, 8]"}]
    assert out.err == ""


def test_reshape_that_holds_at_one_batch_only_is_still_refused():
    # The batch is never pinned: a symbolic batch the user asked for that a reshape holds at one
    # value only is refused, naming the node.
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="fold")]
    model = small_model(nodes, [value_info("x", TensorProto.FLOAT, [1, 3, 4])],
                        [value_info("y", TensorProto.FLOAT, [3, 4])],
                        [helper.make_tensor("shape", TensorProto.INT64, [2], [3, 4])])
    with pytest.raises(UnsupportedModelError, match=r"fold \(Reshape\).*valid only at batch = 1"):
        engine_onnx.convert(model, batch_symbol="batch")
