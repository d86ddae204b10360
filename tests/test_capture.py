"""graph.capture(): static buffers, replay, and the reference's cuda_graph() name (DESIGN §6)."""

from __future__ import annotations


import numpy as np
import pytest

import engine
from engine.demo.mlp import mlp_weights, reference_mlp
from support import run_in_threads


@pytest.fixture()
def graph(mlp_bundle, registry):
    return engine.load_compiled_graph(mlp_bundle, registry=registry)


def test_capture_replays_on_static_buffers(graph):
    w = mlp_weights()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    with graph.capture(x) as captured:
        assert captured.method == "native launches" and captured.key == (4,)
        (out,) = captured.outputs
        np.testing.assert_allclose(out.numpy(), reference_mlp(x, w), rtol=1e-5, atol=1e-6)
        # write new values into the static input, replay, read the same output buffer
        captured.inputs[0].numpy()[:] = x * 3
        captured.replay()
        np.testing.assert_allclose(out.numpy(), reference_mlp(x * 3, w), rtol=1e-5, atol=1e-6)
        # or hand new inputs to __call__, which copies them in
        result = captured(x * -1)
        assert result is out
        np.testing.assert_allclose(out.numpy(), reference_mlp(-x, w), rtol=1e-5, atol=1e-6)
        with pytest.raises(engine.InputError, match="captured at batch=4; these inputs give batch=5"):
            captured(np.zeros((5, 64), np.float32))
    with pytest.raises(engine.InputError, match="closed"):
        captured.replay()


def test_capture_is_independent_of_later_runs(graph):
    x = np.ones((2, 64), np.float32)
    captured = graph.capture(x)
    before = captured.outputs[0].numpy().copy()
    for batch in (2, 7):  # ordinary runs use the thread's own workspaces and fresh outputs
        graph.run_async([np.full((batch, 64), 5.0, np.float32)])
    captured.replay()
    np.testing.assert_array_equal(captured.outputs[0].numpy(), before)


def test_concurrent_replays_are_serialised(graph):
    w = mlp_weights()
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    captured = graph.capture(x)
    expected = reference_mlp(x, w)

    def worker(_: int) -> None:
        for _ in range(200):
            captured.replay()
        np.testing.assert_allclose(captured.outputs[0].numpy(), expected, rtol=1e-5, atol=1e-6)

    run_in_threads(worker, 4)


def test_cuda_graph_needs_cuda(graph):
    with pytest.raises(engine.Unsupported, match="cuda_graph\\(\\) needs a graph that runs on CUDA; .*use capture"):
        graph.cuda_graph(np.ones((1, 64), np.float32))
