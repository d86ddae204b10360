"""Where a bundle can be loaded from: paths, and any buffer (used in place), including pickles whose
bundle bytes travel out of band (protocol 5), as Ray's object store and multiprocessing send them."""

from __future__ import annotations

import mmap
import pickle

import numpy as np
import pytest

import engine


@pytest.fixture(scope="module")
def bundle_bytes(mlp_bundle) -> bytes:
    return mlp_bundle.read_bytes()


def _probs(graph) -> np.ndarray:
    x = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)
    (y,) = graph.run_async([x])
    return y.numpy().copy()


def test_buffers_of_every_kind_load_in_place(mlp_bundle, bundle_bytes):
    expected = _probs(engine.load_compiled_graph(mlp_bundle))
    with open(mlp_bundle, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for source in (bundle_bytes, bytearray(bundle_bytes), memoryview(bundle_bytes),
                   np.frombuffer(bundle_bytes, np.uint8), mapped):
        graph = engine.load_compiled_graph(source)
        np.testing.assert_array_equal(_probs(graph), expected)
        graph.close()
    # The weights are views of the map (in place): it cannot be closed under a live graph.
    with pytest.raises(BufferError):
        mapped.close()


def test_a_pickle_carries_the_bundle_out_of_band(mlp_bundle):
    graph = engine.load_compiled_graph(mlp_bundle)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(graph, protocol=5, buffer_callback=buffers.append)
    (buffer,) = buffers
    assert len(data) < 1024 < buffer.raw().nbytes  # the bundle is the one buffer, not in the stream
    clone = pickle.loads(data, buffers=buffers)
    np.testing.assert_array_equal(_probs(clone), _probs(graph))
    np.testing.assert_array_equal(_probs(pickle.loads(pickle.dumps(graph, protocol=4))), _probs(graph))


@pytest.mark.parametrize("source, expected", [
    (3.5, "expected a bundle path, a directory or a buffer (bytes, memoryview, numpy uint8 array), got float"),
    (np.zeros((4, 4), np.uint8)[:, ::2], "the bundle buffer must be contiguous"),
])
def test_what_is_not_a_bundle_source_is_an_input_error(source, expected):
    with pytest.raises(engine.InputError) as info:
        engine.load_compiled_graph(source)
    assert str(info.value) == f"load_compiled_graph: {expected}"


def test_a_missing_bundle_is_a_file_not_found_error_and_a_bundle_error(tmp_path):
    missing = tmp_path / "missing.cgb"
    with pytest.raises(FileNotFoundError) as info:  # what code written for files catches
        engine.load_compiled_graph(missing)
    error = info.value
    assert isinstance(error, engine.BundleNotFoundError) and isinstance(error, engine.BundleError)
    assert (error.errno, error.filename) == (2, str(missing))
    assert str(error) == f"not a bundle: cannot read {str(missing)!r}: No such file or directory"
