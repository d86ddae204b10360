"""The third-party plugin template (examples/plugin-template) works as a real plugin would.

It is registered the way the entry point would register it, then used end to end: build a
bundle on device "template", save it, load it and compare against numpy, also with builtin copies
between the cpu and "template". Two broken plugins check the registry's isolation: one whose hook
raises, one that speaks another API major.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.backend import BackendBase, BinaryPayload, CandidateSpec
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.settings import Settings

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "examples" / "plugin-template"
sys.path.insert(0, str(TEMPLATE_DIR))

import engine_template.plugin as template_plugin  # noqa: E402 - needs the sys.path entry above
from engine_template import TemplateBackend  # noqa: E402

VADD_C = r"""
#include <stdint.h>
/* c[n] = a[n] + b[n] */
int32_t vadd(void *const *t, const int64_t *sym, void *ws) {
    const float *a = t[0], *b = t[1];
    float *c = t[2];
    for (int64_t i = 0; i < sym[0]; i++) c[i] = a[i] + b[i];
    return 0;
}
"""


@pytest.fixture()
def registry(tmp_path: Path) -> Registry:
    registry = Registry(Settings(cache_dir=tmp_path / "cache"), autoload=False)
    registry.register_plugin(template_plugin)
    return registry


def _on_template(array: np.ndarray, registry: Registry) -> engine.Tensor:
    return engine.asarray(array, device="template", registry=registry)


def test_devices_lists_the_template_kind(registry: Registry) -> None:
    rows = {row.kind: row for row in engine.devices(registry)}
    row = rows["template"]
    assert row.available and row.reason is None
    assert row.workspace_slot == 7 and row.device_count == 1
    assert row.api_version == (1, 0)
    assert isinstance(registry.backend("template"), TemplateBackend)


def test_build_save_load_run(registry: Registry, tmp_path: Path) -> None:
    graph = _vadd_round_trip(registry, tmp_path / "vadd.cgb")
    formats = [bin_.format for bin_ in graph.compiled_tasks[0].meta.candidates[0].binaries]
    assert formats == ["elf-so", "c-source"]  # the compiled object first, its source as fallback
    assert graph.run_stats().fast_runs == 1


def _vadd_round_trip(registry: Registry, path: Path) -> engine.CompiledGraph:
    """Build the vector add on "template", save it to ``path``, load it and check several sizes."""
    b = GraphBuilder("vadd", registry=registry)
    x = b.input("x", "float32", ["n"], device="template")
    y = b.input("y", "float32", ["n"], device="template")
    k = b.kernel("vadd", device="template", entries=["vadd"], source=VADD_C)
    (z,) = b.call(k, [x, y], [("float32", ["n"])], symbols=["n"])
    b.output(z, "z")
    b.save(path)

    graph = engine.load_compiled_graph(path, registry=registry)
    assert graph.devices == {"template": engine.Device("template")}
    rng = np.random.default_rng(0)
    for n in (1, 17, 1000, 17):  # new keys take the slow path, a repeated key the fast path
        a = rng.standard_normal(n).astype(np.float32)
        c = rng.standard_normal(n).astype(np.float32)
        (out,) = graph.run_async([_on_template(a, registry), _on_template(c, registry)])
        assert out.device == "template"
        np.testing.assert_array_equal(out.numpy(), a + c)  # the graph's registry copies it back
    return graph


def test_numpy_input_for_a_template_graph_is_refused(registry: Registry) -> None:
    b = GraphBuilder("vadd", registry=registry)
    x = b.input("x", "float32", ["n"], device="template")
    k = b.kernel("vadd", device="template", entries=["vadd"], source=VADD_C)
    (z,) = b.call(k, [x, x], [("float32", ["n"])], symbols=["n"])
    b.output(z)
    graph = b.build()
    with pytest.raises(engine.InputError, match=r"'x': expected a tensor on template:0, got a numpy array"):
        graph.run_async([np.ones(4, np.float32)])


def test_first_loadable_binary_wins_and_none_is_a_clear_error(registry: Registry) -> None:
    backend = registry.backend("template")
    source = BinaryPayload("c-source", "any", "vadd.c", VADD_C.encode())
    foreign = BinaryPayload("elf-so", "sparc64-linux", "vadd.so", b"\x7fELF not for this machine")
    spec = CandidateSpec("vadd", 0, "vadd", (foreign, source), None, 2, 1, ("n",), False)
    kernel = backend.load_kernel(spec)
    assert kernel.binary.path == "vadd.c"  # the foreign object was skipped, the source compiled

    a, c = np.arange(5, dtype=np.float32), np.full(5, 2.0, np.float32)
    bufs = [backend.allocate(20) for _ in range(3)]
    backend.copy_from_host(bufs[0].addr, a.ctypes.data, 20)
    backend.copy_from_host(bufs[1].addr, c.ctypes.data, 20)
    kernel.launch([s.addr for s in bufs], [5], 0, backend.current_stream())
    out = np.empty(5, np.float32)
    backend.copy_to_host(out.ctypes.data, bufs[2].addr, 20)
    np.testing.assert_array_equal(out, a + c)

    nothing = CandidateSpec("vadd", 1, "vadd", (foreign,), None, 2, 1, ("n",), False)
    with pytest.raises(engine.KernelError, match=r"kernel 'vadd' candidate 1 .*vadd.so \(elf-so, sparc64-linux\)"):
        backend.load_kernel(nothing)


def _plugin_module(name: str, hook) -> types.ModuleType:
    module = types.ModuleType(name)
    module.engine_backends = engine.hookimpl(hook)
    return module


def test_a_plugin_whose_hook_raises_is_isolated(registry: Registry, tmp_path: Path) -> None:
    def engine_backends():
        raise RuntimeError("driver libfoo.so.3 not found")

    registry.register_plugin(_plugin_module("broken_plugin", engine_backends), distribution="engine-broken")
    rows = engine.devices(registry)
    broken = [r for r in rows if r.distribution == "engine-broken"]
    assert len(broken) == 1 and not broken[0].available
    assert "broken_plugin" in broken[0].reason and "driver libfoo.so.3 not found" in broken[0].reason
    assert any(r.kind == "template" and r.available for r in rows)
    assert registry.kinds() == ["template"]
    _vadd_round_trip(registry, tmp_path / "vadd.cgb")  # the healthy plugin still works


class _FutureBackend(BackendBase):
    kind = "future"
    workspace_slot = 8
    api_version = (2, 0)

    def availability(self):
        raise AssertionError("a refused backend is never asked anything")


def test_a_backend_of_another_api_major_is_refused(registry: Registry) -> None:
    registry.register_plugin(_plugin_module("future_plugin", lambda: [_FutureBackend()]))
    row = next(r for r in engine.devices(registry) if r.kind == "future")
    assert not row.available
    assert "speaks plugin API 2.0, this engine speaks 1.0" in row.reason
    with pytest.raises(engine.PluginError, match=r"'future'.*speaks plugin API 2\.0.*upgrade"):
        registry.backend("future")
    assert registry.backend("template") is not None


def test_builtin_copies_between_cpu_and_template(registry: Registry) -> None:
    import engine_cpu.plugin

    registry.register_plugin(engine_cpu.plugin)
    b = GraphBuilder("roundtrip", registry=registry)
    x = b.input("x", "float32", ["n"])                      # on the cpu
    x_dev = b.copy(x, "template")                           # copy_from_host into template memory
    k = b.kernel("vadd", device="template", entries=["vadd"], source=VADD_C)
    (doubled,) = b.call(k, [x_dev, x_dev], [("float32", ["n"])], symbols=["n"])
    b.output(b.copy(doubled, "cpu"), "doubled")             # copy_to_host back to the cpu
    graph = b.build()
    a = np.arange(6, dtype=np.float32)
    for _ in range(3):  # interpreted, prepared, fast
        (out,) = graph.run_async([a])
        assert out.device == "cpu"
        np.testing.assert_array_equal(out.numpy(), 2 * a)
