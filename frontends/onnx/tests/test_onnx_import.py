"""The ONNX importer end to end: real models converted, compiled, run on the CPU plugin and
compared with ONNX Runtime; the unsupported-op error; symbols; saving, loading in another process
and memory-mapped weights; ``engine convert``.

Tolerance: ``|engine - ort| <= 1e-4 * |ort| + 1e-4 * max|ort|`` elementwise (float32; the second
term covers outputs near zero, where a relative bound alone is meaningless). Tuning is cut to one
sample per candidate (``warmup=1, repeat=1``) to keep the suite quick: the choice does not change
results, only speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

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
from engine_onnx.ops.gemm_c import GEMM_CANDIDATES  # noqa: E402
from engine.plugins import Registry  # noqa: E402
from engine.settings import Settings  # noqa: E402

ort.set_default_logger_severity(3)
RTOL = 1e-4


def _quick(graph):
    graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
    return graph


#: The ONNX Runtime session of the last model run, kept so that a model checked at two batches is
#: serialised and loaded once (the large light models take seconds each time).
_LAST_SESSION: list[tuple[onnx.ModelProto, ort.InferenceSession]] = []


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    if not _LAST_SESSION or _LAST_SESSION[0][0] is not model:
        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        _LAST_SESSION[:] = [(model, session)]
    return _LAST_SESSION[0][1].run(None, feeds)


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale)


def _check(model: onnx.ModelProto, graph, shapes: list[tuple[int, ...]], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    _check_feeds(model, graph, {vi.name: x for vi, x in zip(zoo.graph_inputs(model), inputs)})


def _check_feeds(model: onnx.ModelProto, graph, feeds: dict[str, np.ndarray]) -> None:
    """engine's outputs for ``feeds`` (by graph input name) against ONNX Runtime's, every output."""
    expected = _ort(model, feeds)
    outputs = graph.run_async([feeds[vi.name] for vi in zoo.graph_inputs(model)])
    assert len(outputs) == len(expected)
    for out, ref in zip(outputs, expected):
        _assert_close(out.numpy(), ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.LIGHT_MODELS)
def test_light_model_matches_onnxruntime_at_batch_1_and_8(name):
    """Every model of ONNX's shipped light set (random weights), its batch made a symbol."""
    model = zoo.batch_generalised(zoo.with_random_weights(onnx.load(zoo.light_model_path(name))))
    graph = _quick(engine_onnx.convert(model).build())
    assert tuple(graph.meta.symbols) == ("batch",)
    assert graph.meta.inputs[0].shape_str() == "[batch, 3, 224, 224]"
    for batch in (1, 8):
        _check(model, graph, [(batch, 3, 224, 224)], seed=batch)


def test_shipped_light_model_with_its_own_weights_matches_onnxruntime():
    # The shipped weights are all 0.02: every class's logit is the same large number, so the softmax
    # is uniform only if every output channel is computed in the same rounding order. Tuned
    # candidates may differ there (OpenBLAS's edge rows): candidate 0 everywhere keeps one order;
    # every candidate's values are checked on random weights (test_onnx_kernels.py, the tests above).
    model = onnx.load(zoo.light_model_path("squeezenet"))
    bundle = engine_onnx.convert(zoo.light_model_path("squeezenet")).to_bytes()
    graph = engine.load_compiled_graph(bundle, dispatch_policy="first")
    _check(model, graph, [(1, 3, 224, 224)])


@pytest.mark.slow
def test_transformer_encoder_with_dynamic_batch_and_sequence():
    pytest.importorskip("torch")
    model = zoo.transformer_encoder(layers=4, seq=16)
    with pytest.warns(engine_onnx.SymbolPinnedWarning, match="seq fixed to 16: /layers.0/self_attn/Reshape"):
        graph = _quick(engine_onnx.convert(model).build())
    # torch baked the traced length into the attention reshapes: seq is pinned, the batch stays.
    assert tuple(graph.meta.symbols) == ("batch",)
    assert graph.meta.outputs[0].shape_str() == "[batch, 16, 64]"
    with pytest.raises(engine.InputError, match="dimension 1 must be 16, got 24"):
        graph.run_async([np.zeros((1, 24, 64), np.float32)])
    for batch in (1, 8):
        _check(model, graph, [(batch, 16, 64)], seed=batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torch_vision_model_matches_onnxruntime_at_batch_1_and_8(name):
    pytest.importorskip("torch")
    model = getattr(zoo, name)()
    # Exported with its BatchNormalization nodes (random statistics): the importer folds them.
    assert "BatchNormalization" in {n.op_type for n in model.graph.node}
    graph = _quick(engine_onnx.convert(model).build())
    assert tuple(graph.meta.symbols) == ("batch",)
    assert graph.meta.outputs[0].shape_str() == "[batch, 1000]"
    assert not [t.name for t in graph.compiled_tasks if "batchnorm" in t.name.lower()]
    for batch in (1, 8):
        _check(model, graph, [(batch, 3, 224, 224)], seed=batch)


@pytest.mark.slow
def test_bert_encoder_with_an_attention_mask_matches_onnxruntime():
    pytest.importorskip("torch")
    model = zoo.bert_encoder(layers=4)
    graph = _quick(engine_onnx.convert(model).build())
    assert tuple(graph.meta.symbols) == ("batch", "seq")
    assert [i.shape_str() for i in graph.meta.inputs] == ["[batch, seq]", "[batch, seq]"]
    assert [o.shape_str() for o in graph.meta.outputs] == ["[batch, seq, 128]", "[batch, 128]"]
    for batch, seq in ((1, 16), (8, 24)):
        feeds = zoo.bert_inputs(batch, seq, seed=batch)
        assert feeds["input_ids"].dtype == feeds["attention_mask"].dtype == np.int64
        _check_feeds(model, graph, feeds)
    # The padded rows' results depend on the mask (so the comparison above covers it).
    feeds = zoo.bert_inputs(8, 24, seed=8)
    unmasked = dict(feeds, attention_mask=np.ones_like(feeds["attention_mask"]))
    padded_row = graph.run_async([feeds["input_ids"], feeds["attention_mask"]])[1].numpy()[1]
    assert not np.allclose(padded_row, _ort(model, unmasked)[1][1], rtol=RTOL, atol=RTOL)


def _tiny_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_unsupported_nodes_are_all_listed_and_no_bundle_is_made(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, None])
    # Two nodes no release can import: an operator of a foreign domain, and NonZero (its output's
    # length depends on the data, which a bundle's symbols cannot express).
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="fine"),
             helper.make_node("Frobnicate", ["a"], ["b"], name="first_bad", domain="com.example"),
             helper.make_node("Relu", ["x"], ["c"], name="also_fine"),
             helper.make_node("NonZero", ["c"], ["i"], name="second_bad"),
             helper.make_node("Add", ["b", "c"], ["y"], name="after_bad")]
    graph = helper.make_graph(nodes, "tiny", [x], [y, i])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(engine_onnx.UnsupportedModelError) as info:
        engine_onnx.convert_file(model_path := _save(model, tmp_path), tmp_path / "out.cgb")
    err = info.value
    assert isinstance(err, engine.EngineError)
    assert [(n.name, n.op_type) for n in err.nodes] == [("first_bad", "Frobnicate"), ("second_bad", "NonZero")]
    assert "first_bad (Frobnicate)" in str(err) and "second_bad (NonZero)" in str(err) and "\n" not in str(err)
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
    newest = onnx.defs.onnx_opset_version()
    model = _tiny_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], opset=newest + 1)
    with pytest.raises(engine_onnx.UnsupportedOpsetError,
                       match=f"opset {newest + 1}; expected an opset from 1 to {newest}"):
        engine_onnx.convert(model)


def test_an_old_opset_imports_through_the_version_converter():
    # Relu means the same at opset 7 as at 9: the model imports and runs. Add changed at 6 and 7
    # (its ``consumed_inputs`` and ``broadcast`` attributes went away): ONNX's version converter
    # rewrites the opset-5 model to the importer's opset, and it imports and runs too. Where the
    # converter cannot help, the node is refused with its opset named (the PyTorch reference cases'
    # PRelu v6, test_onnx_pytorch_cases.py).
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    model = _tiny_model([helper.make_node("Relu", ["x"], ["y"])], [x], [y], opset=7)
    graph = engine_onnx.convert(model).build()
    out = graph.run_async([np.array([-1.0, 0.5, 2.0], np.float32)])[0].numpy()
    np.testing.assert_array_equal(out, [0.0, 0.5, 2.0])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3])
    old = _tiny_model([helper.make_node("Add", ["x", "b"], ["y"], name="add0"),
                       helper.make_node("Sigmoid", ["x"], ["z"], name="sig")], [x, b], [y, z], opset=5)
    xs, bs = np.array([-1.0, 0.5, 2.0], np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    got = [t.numpy() for t in engine_onnx.convert(old).build().run_async([xs, bs])]
    np.testing.assert_allclose(got[0], xs + bs)
    np.testing.assert_allclose(got[1], 1 / (1 + np.exp(-xs)), rtol=1e-6)


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


def test_saved_bundle_tunes_runs_and_replays_captured_in_another_process_with_mapped_weights(tmp_path):
    model = zoo.with_random_weights(onnx.load(zoo.light_model_path("squeezenet")))
    path = tmp_path / "squeezenet.cgb"
    engine_onnx.convert(model, batch_symbol="batch").save(path)
    rng = np.random.default_rng(3)
    x, x2 = (rng.standard_normal((2, 3, 224, 224)).astype(np.float32) for _ in range(2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "x2.npy", x2)
    # ENGINE_DISPATCH_CACHE=0: no row from an earlier run in the cache, so the key is tuned here.
    script = textwrap.dedent(f"""
        import numpy as np, engine, attrs
        graph = engine.load_compiled_graph({str(path)!r})
        graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
        rows = graph.tune(batch=[2])
        assert list(rows) == [(2,)] and list(graph.tuning_results()) == [(2,)], (rows, graph.tuning_results())
        slow = graph.run_stats().slow_runs
        (y,) = graph.run_async([np.load({str(tmp_path / 'x.npy')!r})])
        np.save({str(tmp_path / 'y.npy')!r}, y.numpy())
        assert graph.run_stats().slow_runs == slow, "a tuned key took the slow path"
        captured = graph.capture(np.zeros((2, 3, 224, 224), np.float32))
        captured.inputs[0].numpy()[:] = np.load({str(tmp_path / 'x2.npy')!r})
        captured.replay()
        np.save({str(tmp_path / 'y2.npy')!r}, captured.outputs[0].numpy())
        print("method:", captured.method)
        captured.close()
        w = graph.weights[0].numpy()
        address = w.__array_interface__["data"][0]
        mapped = False
        for line in open("/proc/self/maps"):
            span, *_, name = line.split()
            lo, hi = (int(v, 16) for v in span.split("-"))
            mapped |= name == {str(path)!r} and lo <= address < hi
        print("weights:", "mapped" if mapped and not w.flags.writeable else "copied")
    """)
    env = dict(os.environ, ENGINE_DISPATCH_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    report = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert report["method"] == "native launches"  # the CPU replays its prepared launches (no recorder)
    if sys.platform.startswith("linux"):
        assert report["weights"] == "mapped"
    bz = zoo.batch_generalised(model)
    _assert_close(np.load(tmp_path / "y.npy"), _ort(bz, {"data_0": x})[0])
    _assert_close(np.load(tmp_path / "y2.npy"), _ort(bz, {"data_0": x2})[0])


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


def test_engine_convert_takes_one_known_device_kind_and_refuses_others_saying_why(tmp_path, capsys):
    from engine.cli.main import main

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    model = _tiny_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    src, out = _save(model, tmp_path), tmp_path / "out.cgb"
    capsys.readouterr()
    assert main(["convert", str(src), "-o", str(out), "--device", "cpu,cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--device 'cpu,cuda'" in err and "one of cpu, cuda, opencl" in err and "convert once per kind" in err
    assert "\n" not in err and not out.exists()
    assert main(["convert", str(src), "-o", str(out), "--device", "tpu"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err and not out.exists()
    assert main(["convert", str(src), "-o", str(out), "--device", "cpu", "--io-device", "gpu"]) == 2
    assert "--io-device 'gpu'" in capsys.readouterr().err and not out.exists()


def test_engine_convert_for_cuda_writes_compiled_kernels_and_refuses_what_has_no_gpu_kernels(tmp_path, capsys):
    from engine.cli.main import main

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    relu = _tiny_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    out = tmp_path / "relu_cuda/"
    assert main(["convert", str(_save(relu, tmp_path, "relu.onnx")), "-o", str(out) + "/", "--device", "cuda"]) == 0
    formats = {(b["format"], b["target"]) for meta in out.glob("kernels/*/meta.json")
               for cand in json.loads(meta.read_text())["candidates"] for b in cand["binaries"]}
    assert {("cubin", "sm_80"), ("cubin", "sm_90")} <= formats and any(f == "ptx" for f, _ in formats)
    x16 = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 4])
    half = _tiny_model([helper.make_node("Relu", ["x"], ["y"], name="the_relu")], [x16],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 4])])
    capsys.readouterr()
    bad = tmp_path / "half.cgb"
    assert main(["convert", str(_save(half, tmp_path, "half.onnx")), "-o", str(bad), "--device", "cuda"]) != 0
    err = capsys.readouterr().err
    assert "the_relu" in err and "float16 has no GPU kernels yet" in err and not bad.exists()
    assert main(["convert", str(_save(half, tmp_path, "half.onnx")), "-o", str(bad)]) == 0  # the CPU has them


@pytest.fixture(scope="module")
def encoder_onnx(tmp_path_factory):
    """A 2-layer torch transformer encoder (dynamic batch and seq, traced at seq 16, so seq is pinned
    there at conversion) as an .onnx file."""
    pytest.importorskip("torch")
    return _save(zoo.transformer_encoder(layers=2, seq=16), tmp_path_factory.mktemp("encoder"), "encoder.onnx")


def _read_terminal(master: int, timeout_s: float) -> bytes:
    """Everything written to a pty until the other side closes it (EIO on Linux)."""
    import select

    poller = select.poll()  # not select.select: the descriptor may be above FD_SETSIZE in a long session
    poller.register(master, select.POLLIN)
    data = b""
    while poller.poll(timeout_s * 1000):
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a Linux pseudo-terminal")
def test_engine_convert_draws_its_progress_bar_on_a_terminal_and_nowhere_else(encoder_onnx, tmp_path, capsys):
    import pty
    import re

    from engine.cli.main import main

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "convert", str(encoder_onnx), "-o",
                             str(tmp_path / "a.cgb")], stdout=subprocess.PIPE, stderr=slave,
                            env=dict(os.environ, TERM="xterm"))
    os.close(slave)
    try:
        drawn = _read_terminal(master, timeout_s=600).decode()
    finally:
        os.close(master)
    assert proc.wait(timeout=60) == 0
    assert b"wrote" in proc.stdout.read()
    note = "note: seq fixed to 16: "  # printed once the bar is erased (the encoder's sequence is pinned)
    assert drawn.count(note) == 1 and drawn.endswith("the bundle takes seq = 16 only\r\n")  # the pty's newline
    frames = [f for f in drawn[:drawn.index(note)].split("\r") if f]
    assert frames[0].startswith("compiling kernels [") and frames[0].endswith("\x1b[K")
    assert re.match(r"compiling kernels \[#{24}\] (\d+)/\1\b", frames[-2]), frames[-2]  # the last draw: all done
    assert frames[-1] == "\x1b[K"  # then erased: only the command's output stays on screen
    capsys.readouterr()
    assert main(["convert", str(encoder_onnx), "-o", str(tmp_path / "b.cgb")]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out  # not a terminal: no bar, no control characters; only the pin's note
    assert captured.err.splitlines() == [
        "note: seq fixed to 16: /layers.0/self_attn/Reshape_4 (Reshape) holds only at seq = 16 (reshape of "
        "[seq, batch, 64] to [16, batch * 4, 16]); the bundle takes seq = 16 only"]


@pytest.mark.slow
def test_engine_tune_and_bench_run_a_converted_bundle(encoder_onnx, tmp_path):
    import json

    from engine.cli.main import main

    bundle = str(tmp_path / "encoder.cgb")
    grid = ["--symbol", "batch=1,8"]
    assert main(["convert", str(encoder_onnx), "-o", bundle]) == 0
    assert main(["tune", bundle, *grid, "--warmup", "1", "--repeat", "1", "--save"]) == 0
    # Another process, the dispatch cache off: only the bundle's own table can say "already tuned".
    proc = subprocess.run([sys.executable, "-m", "engine", "bench", bundle, *grid, "--warmup", "1", "--repeat", "3",
                           "--json"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, ENGINE_DISPATCH_CACHE="0"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    results = doc["results"]
    assert [r["symbols"] for r in results] == [{"batch": 1}, {"batch": 8}]
    assert all(r["samples"] and r["median_ms"] > 0 for r in results)
    assert not any(r["tuned_here"] for r in results)  # the table `engine tune --save` wrote into the bundle


@pytest.mark.skipif("blas" not in dict(GEMM_CANDIDATES), reason="the scipy-openblas32 wheel is not installed "
                    "(pip install 'engine-onnx[blas]'), so conversion offers no BLAS candidate")
def test_blas_candidates_have_own_binaries_and_a_machine_without_the_wheel_runs_the_others(tmp_path):
    """Where the wheel is installed at conversion, MatMul/Gemm/Conv offer a BLAS candidate in binaries
    of its own; on a machine without it (a child process where the import fails) the bundle loads,
    says which candidates it cannot use, and runs the portable ones with the same results."""
    rng = np.random.default_rng(9)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 12, 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 3, 3, 3], rng.standard_normal(216).astype(np.float32))
    fc = helper.make_tensor("fc", TensorProto.FLOAT, [10, 8 * 144], rng.standard_normal(11520).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    model = _tiny_model(nodes, [x], [y], [w, fc])
    path = tmp_path / "blas.cgb"
    engine_onnx.convert(model).save(path)
    with zipfile.ZipFile(path) as z:
        metas = [json.loads(z.read(n)) for n in z.namelist() if n.startswith("kernels/") and n.endswith("meta.json")]
    blas = {c["entry"]: {b["path"] for b in c["binaries"]} for m in metas for c in m["candidates"]
            if c["entry"].endswith("_blas")}
    assert set(blas) == {"conv_im2col_blas", "mm_blas"}
    others = {p for m in metas for c in m["candidates"] if not c["entry"].endswith("_blas") for b in c["binaries"]
              for p in [b["path"]]}
    assert all(paths and not paths & others for paths in blas.values())
    data = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    np.save(tmp_path / "x.npy", data)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["scipy_openblas32"] = None   # this machine has no wheel: its import fails
        import numpy as np, engine
        graph = engine.load_compiled_graph({str(path)!r})   # tunes every candidate, the stand-ins too
        entries = [t.meta.candidates[c].entry for t in graph.compiled_tasks for c in t.unavailable]
        print("entries:", ",".join(sorted(entries)))
        (out,) = graph.run_async([np.load({str(tmp_path / 'x.npy')!r})])
        np.save({str(tmp_path / 'y.npy')!r}, out.numpy())
    """)
    env = dict(os.environ, ENGINE_DISPATCH_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    report = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert report["entries"] == "conv_im2col_blas,mm_blas"
    _assert_close(np.load(tmp_path / "y.npy"), _ort(model, {"x": data})[0])


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
    # No dispatch cache: a row an earlier run cached would leave nothing to tune here.
    registry = Registry(Settings.from_env({**os.environ, "ENGINE_DISPATCH_CACHE": "0"}))
    graph = engine_onnx.convert(model, registry=registry).build()
    candidates = {task.name.rsplit("_", 1)[0]: len(task.candidates) for task in graph.compiled_tasks}
    # the Relu is fused into the Conv; one Gemm candidate per GEMM routine, and the Conv's im2col
    # path once per tuned routine (not the straightforward one) next to its direct, implicit
    # (packed, fused) and, as it has 3 input channels, strided (first-layer) candidates
    routines = len(GEMM_CANDIDATES)
    assert candidates == {"conv": routines + 2, "gemm": routines}
    data = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    expected = _ort(model, {"x": data})[0]
    _assert_close(graph.run_async([data])[0].numpy(), expected)
    timed = sorted(len(choice.medians_ms) for choice in graph.tuning_results()[(3,)])
    assert timed == sorted(candidates.values())  # every candidate of both tasks was timed at this key
    # each candidate forced in turn gives the same result (test_onnx_kernels.py: many shapes)
