"""The runtime on the kind: the demo model end to end, from many threads, captured, and DLPack."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import engine
from engine.demo.mlp import mlp_weights, reference_mlp
from engine.device import Device
from engine.testing.checks import check, lacks, values_differ
from engine.testing.graphs import DEMO_SHAPE, load_demo_graph
from engine.testing.reference import MLP_KERNELS

conformance = pytest.mark.conformance

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def weights():
    d_in, hidden, classes = DEMO_SHAPE
    return mlp_weights(d_in, hidden, classes, seed=0)


@pytest.fixture(scope="module")
def demo_graph(registry, backend, device_index, kit, weights):
    refs = kit.references()
    missing = [name for name in MLP_KERNELS if name not in refs]
    if missing:
        lacks("reference.mlp", f"the {backend.kind} backend's reference_kernels() lacks {missing}")
    graph = load_demo_graph(registry, backend.kind, device_index, refs, weights)
    yield graph
    graph.close()


def batch_input(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, DEMO_SHAPE[0])).astype(np.float32)


def run(graph, registry, device, x: np.ndarray) -> np.ndarray:
    (out,) = graph.run_async([engine.asarray(x, device=device, registry=registry)])
    return out.numpy(registry=registry)


@conformance("graph.demo_model")
def test_demo_model(demo_graph, registry, backend, device_index, weights):
    device = Device(backend.kind, device_index)
    for batch in (1, 3, 64):
        x = batch_input(batch, batch)
        got, want = run(demo_graph, registry, device, x), reference_mlp(x, weights)
        check(values_differ(want, got, rtol=RTOL, atol=ATOL) is None, "graph.demo_model",
              f"the demo model at batch {batch} to match reference_mlp", lambda: values_differ(want, got, rtol=RTOL,
                                                                                             atol=ATOL))


@conformance("graph.threads")
def test_demo_model_threads(demo_graph, registry, backend, device_index, weights):
    device = Device(backend.kind, device_index)
    failures: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8, timeout=120)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for r in range(5):
                x = batch_input(3 + t, 100 * t + r)
                got, want = run(demo_graph, registry, device, x), reference_mlp(x, weights)
                problem = values_differ(want, got, rtol=RTOL, atol=ATOL)
                if problem is not None:
                    failures.append(f"thread {t} run {r}: {problem}")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors and not isinstance(errors[0], threading.BrokenBarrierError):
        raise errors[0]
    check(not failures, "graph.threads", "8 threads x 5 runs of the demo model, all correct",
          lambda: f"{len(failures)} wrong; {'; '.join(failures[:3])}")


@conformance("graph.capture")
def test_demo_model_capture(demo_graph, registry, backend, device_index, weights):
    device = Device(backend.kind, device_index)
    example = engine.asarray(batch_input(3, 7), device=device, registry=registry)
    with demo_graph.capture(example) as captured:
        x = batch_input(3, 8)
        out = captured(engine.asarray(x, device=device, registry=registry))
        got = out.numpy(registry=registry)
    eager = run(demo_graph, registry, device, x)
    check(values_differ(eager, got, rtol=RTOL, atol=ATOL) is None, "graph.capture",
          f"the captured replay ({captured.method}) to equal run_async", lambda: values_differ(eager, got, rtol=RTOL,
                                                                                               atol=ATOL))


@conformance("dlpack.roundtrip")
def test_dlpack_roundtrip(registry, backend, device_index):
    device = Device(backend.kind, device_index)
    data = np.arange(4099, dtype=np.float32) * np.float32(0.5) - np.float32(7)
    tensor = engine.asarray(data, device=device, registry=registry)
    for max_version in ((1, 0), None):
        try:
            capsule = tensor.__dlpack__(max_version=max_version)
        except BufferError as exc:
            lacks("dlpack", f"{backend.kind} tensors do not export through DLPack: {exc}")
        back = engine.from_dlpack(capsule, registry=registry)
        check(back.device == device, "dlpack.roundtrip", f"the imported tensor on {device}", back.device)
        got = back.numpy(registry=registry)
        check(got.tobytes() == data.tobytes(), "dlpack.roundtrip",
              f"the same bytes after a {'versioned' if max_version else 'legacy'} capsule round trip",
              lambda: values_differ(data, got))
