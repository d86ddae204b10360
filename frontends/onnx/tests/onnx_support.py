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


def _kinds() -> dict:
    import engine

    return {d.kind: d for d in engine.devices()}


def gpu_kinds() -> list[str]:
    """The GPU kinds the ONNX GPU tests run on: those of ``ENGINE_TEST_GPU_KINDS`` (comma-separated;
    default ``opencl,cuda``) whose plugin can run kernels here."""
    wanted = [k.strip() for k in os.environ.get("ENGINE_TEST_GPU_KINDS", "opencl,cuda").split(",") if k.strip()]
    kinds = _kinds()
    return [k for k in wanted if kinds.get(k) is not None and kinds[k].available]


def gpu_reason() -> str | None:
    """Why no GPU kind (``gpu_kinds``) can run kernels here, or None when one can."""
    try:
        if gpu_kinds():
            return None
        kinds = _kinds()
    except Exception as exc:  # pragma: no cover - reported as the skip reason
        return f"engine.devices() failed: {exc}"
    wanted = os.environ.get("ENGINE_TEST_GPU_KINDS", "opencl,cuda")
    why = "; ".join(f"{k}: {kinds[k].reason if k in kinds else 'plugin not installed'}" for k in wanted.split(","))
    return f"no GPU kind of {wanted} can run kernels here ({why})"


def check_gpu(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], tmp_path, *, rtol: float = 1e-4,
              batch_symbol: str | None = None) -> list[str]:
    """The model's GPU kernels checked for real where this machine can: converted for ``cuda`` and
    saved, every kernel compiled by NVRTC into cubins for sm_80 and sm_90 (ELF) and PTX; then run
    on each kind of ``gpu_kinds()`` (``opencl``: PoCL in CI; ``cuda`` on a GPU machine) with host
    inputs and outputs, for each of ``feeds``, every output against ONNX Runtime's (``rtol``
    relative plus ``rtol`` of its largest magnitude). Returns the kernel names of the last kind run."""
    import json

    import engine_onnx
    import onnxruntime as ort

    run_kinds = gpu_kinds()
    assert run_kinds, gpu_reason()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    cuda_builder = engine_onnx.convert(model, device="cuda", io_device="cpu", batch_symbol=batch_symbol)
    path = tmp_path / "cuda.cgb/"
    cuda_builder.save(path, form="dir")
    for meta_path in sorted(path.glob("kernels/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("builtin"):
            continue
        for cand in meta["candidates"]:
            found = {(b["format"], b["target"]) for b in cand["binaries"]}
            assert {("cubin", "sm_80"), ("cubin", "sm_90")} <= found, (meta["name"], found)
            assert any(f == "ptx" for f, _ in found), (meta["name"], found)
            for b in cand["binaries"]:
                if b["format"] == "cubin":
                    assert (meta_path.parent / b["path"]).read_bytes()[:4] == b"\x7fELF"
    runs = [(kind, cuda_builder if kind == "cuda" else
             engine_onnx.convert(model, device=kind, io_device="cpu", batch_symbol=batch_symbol)) for kind in run_kinds]
    names: list[str] = []
    for kind, builder in runs:
        graph = builder.build()
        names = [task.meta.name for task in graph.compiled_tasks]
        for i, feed in enumerate(feeds):
            expected = sess.run(None, feed)
            actual = graph.run_async([feed[n.name] for n in model.graph.input if n.name in feed])
            assert len(actual) == len(expected)
            for k, (a, e) in enumerate(zip(actual, expected)):
                a = a.numpy()
                assert a.shape == e.shape and a.dtype == e.dtype, (kind, i, k, a.shape, e.shape, a.dtype, e.dtype)
                scale = float(np.abs(e).max()) if e.size and e.dtype.kind == "f" else 0.0
                np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=f"{kind} feed {i} output {k}")
    return names


def small_model(nodes, inputs, outputs, inits=(), opset: int = 18) -> onnx.ModelProto:
    """A one-graph model of ``nodes``, its shapes inferred (the importer reads ONNX's inference)."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def value_info(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def check_gpu_candidates(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], tmp_path, *,
                         rtol: float = 1e-4) -> list[tuple[str, ...]]:
    """``check_gpu``, then on each GPU kind that runs here, candidate ``j`` of every task forced in
    turn through the public dispatch table (a task's last where it has fewer), every output against
    ONNX Runtime's. Returns the tasks' candidate entries."""
    import engine_onnx
    import onnxruntime as ort

    check_gpu(model, feeds, tmp_path, rtol=rtol)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in model.graph.input if i.name in feeds[0]]
    entries: list[tuple[str, ...]] = []
    for kind in gpu_kinds():
        graph = engine_onnx.convert(model, device=kind, io_device="cpu").build()
        entries = candidate_entries(graph)
        for j in range(1, max(len(e) for e in entries)):
            choice = tuple(min(j, max(len(e), 1) - 1) for e in entries)
            for feed in feeds:
                key = tuple(_symbol_values(graph, [feed[n] for n in names]))
                graph.dispatch_table.record(key, choice)
                for a, e in zip(graph.run_async([feed[n] for n in names]), sess.run(None, feed)):
                    scale = float(np.abs(e).max()) if e.size and e.dtype.kind == "f" else 0.0
                    np.testing.assert_allclose(a.numpy(), e, rtol=rtol, atol=rtol * scale,
                                               err_msg=f"{kind} candidates {choice}")
    return entries


def _symbol_values(graph, arrays: list[np.ndarray]) -> list[int]:
    """The values of the graph's symbols for inputs ``arrays``, in the dispatch table's order."""
    values: dict[str, int] = {}
    for sig, array in zip(graph.meta.inputs, arrays):
        for dim, size in zip(sig.shape, array.shape):
            if str(dim).isidentifier():
                values[str(dim)] = size
    return [values[s] for s in graph.dispatch_table.symbols]
