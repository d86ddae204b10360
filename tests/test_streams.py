"""Per-stream workspaces: a backend whose current stream changes within a thread (DESIGN §6)."""

from __future__ import annotations

import threading

import numpy as np

import engine
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.settings import Settings
from support import HostKindBackend

CHAIN_C = r"""
#include <stdint.h>
/* y = x * 2 + 1 through an intermediate; the intermediate lives in the workspace. */
int32_t twice(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] * 2.0f;
    return 0;
}
int32_t plus_one(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + 1.0f;
    return 0;
}
"""


class StreamedBackend(HostKindBackend):
    """Host memory posing as a GPU with streams: the current stream is chosen per thread."""

    kind = "streamdev"
    workspace_slot = 6
    has_streams = True

    def __init__(self, cpu):
        super().__init__(cpu)
        self._current = threading.local()

    def use_stream(self, stream: int) -> None:
        self._current.stream = stream

    def current_stream(self, device_index: int = 0) -> object:
        return getattr(self._current, "stream", 0)


def _graph(tmp_path):
    registry = Registry(Settings(cache_dir=tmp_path), autoload=False)
    import engine_cpu.plugin

    registry.register_plugin(engine_cpu.plugin)
    backend = StreamedBackend(registry.backend("cpu"))
    registry.register_backend(backend, distribution="tests")
    b = GraphBuilder("streams", registry=registry)
    x = b.input("x", "float32", ["n"], device="streamdev")
    k1 = b.kernel("twice", entries=["twice"], source=CHAIN_C, device="streamdev")
    k2 = b.kernel("plus_one", entries=["plus_one"], source=CHAIN_C, device="streamdev")
    (h,) = b.call(k1, [x], [("float32", ["n"])], symbols=["n"])
    (y,) = b.call(k2, [h], [("float32", ["n"])], symbols=["n"])
    b.output(y)
    return b.build(), backend, registry


def test_each_stream_gets_its_own_workspace(tmp_path):
    graph, backend, registry = _graph(tmp_path)
    x = engine.asarray(np.arange(8, dtype=np.float32), device="streamdev", registry=registry)
    workspaces = {}
    for stream in (1, 2, 1, 2):
        backend.use_stream(stream)
        (y,) = graph.run_async([x])
        np.testing.assert_array_equal(y.numpy(), np.arange(8) * 2 + 1)
        workspaces.setdefault(stream, set()).add(graph.runtime.lane().workspaces["streamdev"].base)
    assert len(workspaces[1]) == 1 and len(workspaces[2]) == 1  # reused per stream ...
    assert workspaces[1] != workspaces[2]                          # ... and distinct across streams
    stats = graph.run_stats()
    assert stats.prepared_runs == 2 and stats.fast_runs == 2      # one prepared run per stream


def test_cpu_only_graphs_never_ask_for_streams(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    assert graph.runtime.devices.stream_kinds == ()
