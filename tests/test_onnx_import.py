"""The ONNX importer end to end: real models converted, compiled, run on the CPU plugin and
compared with ONNX Runtime; the unsupported-op error; symbols; saving, loading in another process
and memory-mapped weights; ``engine convert``.

Tolerance: ``|engine - ort| <= 1e-4 * |ort| + 1e-4 * max|ort|`` elementwise (float32; the second
term covers outputs near zero, where a relative bound alone is meaningless). Tuning is cut to one
sample per candidate (``warmup=1, repeat=1``) to keep the suite quick: the choice does not change
results, only speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import attrs
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("engine_onnx")

from onnx import TensorProto, helper  # noqa: E402

import engine  # noqa: E402
import engine_onnx  # noqa: E402
from engine_onnx import zoo  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4


def _quick(graph):
    graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
    return graph


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale)


def _check(model: onnx.ModelProto, graph, shapes: list[tuple[int, ...]], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    expected = _ort(model, {vi.name: x for vi, x in zip(zoo.graph_inputs(model), inputs)})
    outputs = graph.run_async(inputs)
    assert len(outputs) == len(expected)
    for out, ref in zip(outputs, expected):
        _assert_close(out.numpy(), ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.LIGHT_MODELS)
def test_light_model_matches_onnxruntime_at_batch_1(name):
    model = zoo.with_random_weights(onnx.load(zoo.light_model_path(name)))
    graph = _quick(engine_onnx.convert(model).build())
    _check(model, graph, [(1, 3, 224, 224)])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_light_model_with_a_dynamic_batch_matches_onnxruntime(name):
    model = zoo.batch_generalised(zoo.with_random_weights(onnx.load(zoo.light_model_path(name))))
    graph = _quick(engine_onnx.convert(model).build())
    assert tuple(graph.meta.symbols) == ("batch",)
    assert graph.meta.inputs[0].shape_str() == "[batch, 3, 224, 224]"
    for batch in (1, 8):
        _check(model, graph, [(batch, 3, 224, 224)], seed=batch)


def test_shipped_light_model_with_its_own_weights_matches_onnxruntime():
    model = onnx.load(zoo.light_model_path("squeezenet"))
    graph = _quick(engine_onnx.convert(zoo.light_model_path("squeezenet")).build())
    _check(model, graph, [(1, 3, 224, 224)])


@pytest.mark.slow
def test_transformer_encoder_with_dynamic_batch_and_sequence():
    pytest.importorskip("torch")
    model = zoo.transformer_encoder(layers=4, seq=16)
    graph = _quick(engine_onnx.convert(model).build())
    assert tuple(graph.meta.symbols) == ("batch", "seq")
    assert graph.meta.outputs[0].shape_str() == "[batch, seq, 64]"
    for batch in (1, 8):
        _check(model, graph, [(batch, 16, 64)], seed=batch)


def _tiny_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_unsupported_nodes_are_all_listed_and_no_bundle_is_made(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="fine"),
             helper.make_node("Hardmax", ["a"], ["b"], name="first_bad"),
             helper.make_node("Relu", ["x"], ["c"], name="also_fine"),
             helper.make_node("TopK", ["c", "k"], ["d", "i"], name="second_bad"),
             helper.make_node("Add", ["b", "d"], ["y"], name="after_bad")]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [3])
    model = _tiny_model(nodes, [x], [y], [k])
    with pytest.raises(engine_onnx.UnsupportedModelError) as info:
        engine_onnx.convert_file(model_path := _save(model, tmp_path), tmp_path / "out.cgb")
    err = info.value
    assert isinstance(err, engine.EngineError)
    assert [(n.name, n.op_type) for n in err.nodes] == [("first_bad", "Hardmax"), ("second_bad", "TopK")]
    assert "first_bad (Hardmax)" in str(err) and "second_bad (TopK)" in str(err) and "\n" not in str(err)
    assert not (tmp_path / "out.cgb").exists()
    assert model_path.exists()


def _save(model, tmp_path, name="model.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_an_unsupported_attribute_names_the_node_and_the_reason():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 3, 3])
    node = helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[2, 2], storage_order=1)
    with pytest.raises(engine_onnx.UnsupportedModelError, match=r"pool \(MaxPool\): storage_order=1"):
        engine_onnx.convert(_tiny_model([node], [x], [y]))


def test_an_opset_out_of_range_is_refused_in_one_line():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    model = _tiny_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], opset=7)
    with pytest.raises(engine_onnx.UnsupportedOpsetError, match="opset 7; expected an opset from 9"):
        engine_onnx.convert(model)


def test_named_dimensions_become_symbols_and_shape_arithmetic_folds():
    # y = Reshape(x * 2, concat(Shape(x)[0], -1)): the target shape is computed from a dynamic shape.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 12])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    minus1 = helper.make_tensor("minus1", TensorProto.INT64, [1], [-1])
    nodes = [helper.make_node("Mul", ["x", "two"], ["m"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n0"]),
             helper.make_node("Concat", ["n0", "minus1"], ["target"], axis=0),
             helper.make_node("Reshape", ["m", "target"], ["y"])]
    model = _tiny_model(nodes, [x], [y], [two, zero, minus1])
    graph = engine_onnx.convert(model).build()
    assert tuple(graph.meta.symbols) == ("n",)
    assert graph.meta.outputs[0].shape_str() == "[n, 12]"
    for n in (1, 5):
        data = np.arange(n * 12, dtype=np.float32).reshape(n, 3, 4)
        np.testing.assert_array_equal(graph.run_async([data])[0].numpy(), (data * 2).reshape(n, 12))


def test_saved_bundle_runs_in_another_process_with_mapped_weights(tmp_path):
    model = zoo.with_random_weights(onnx.load(zoo.light_model_path("squeezenet")))
    path = tmp_path / "squeezenet.cgb"
    engine_onnx.convert(model, batch_symbol="batch").save(path)
    x = np.random.default_rng(3).standard_normal((2, 3, 224, 224)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import numpy as np, engine, attrs
        graph = engine.load_compiled_graph({str(path)!r})
        graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
        (y,) = graph.run_async([np.load({str(tmp_path / 'x.npy')!r})])
        np.save({str(tmp_path / 'y.npy')!r}, y.numpy())
        w = graph.weights[0].numpy()
        address = w.__array_interface__["data"][0]
        mapped = False
        for line in open("/proc/self/maps"):
            span, *_, name = line.split()
            lo, hi = (int(v, 16) for v in span.split("-"))
            mapped |= name == {str(path)!r} and lo <= address < hi
        print("mapped" if mapped and not w.flags.writeable else "copied")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if sys.platform.startswith("linux"):
        assert proc.stdout.strip().endswith("mapped")
    bz = zoo.batch_generalised(model)
    _assert_close(np.load(tmp_path / "y.npy"), _ort(bz, {"data_0": x})[0])


def test_engine_convert_command_writes_a_bundle_that_loads(tmp_path, capsys):
    from engine.cli.main import main

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 4], np.linspace(-1, 1, 32).astype(np.float32).tolist())
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    model = _tiny_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                        [x], [y], [w])
    src = _save(model, tmp_path)
    out = tmp_path / "tiny.cgb"
    assert main(["convert", str(src), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    graph = engine.load_compiled_graph(out)
    data = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    _assert_close(graph.run_async([data])[0].numpy(), _ort(model, {"x": data})[0])
    assert main(["convert", str(tmp_path / "missing.onnx"), "-o", str(out)]) == 2


def test_gemm_and_conv_kernels_offer_several_candidates_with_equal_results():
    rng = np.random.default_rng(5)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], rng.standard_normal(108).astype(np.float32))
    fc = helper.make_tensor("fc", TensorProto.FLOAT, [10, 64], rng.standard_normal(640).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    model = _tiny_model(nodes, [x], [y], [w, fc])
    graph = engine_onnx.convert(model).build()
    candidates = {task.name.rsplit("_", 1)[0]: len(task.candidates) for task in graph.compiled_tasks}
    assert candidates == {"conv": 2, "gemm": 2}  # the Relu is fused into the Conv
    data = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    expected = _ort(model, {"x": data})[0]
    _assert_close(graph.run_async([data])[0].numpy(), expected)
    for choice in graph.tuning_results()[(3,)]:
        assert len(choice.medians_ms) == 2  # both candidates of both tasks were timed at this key
