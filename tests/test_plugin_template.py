"""The third-party plugin template (examples/plugin-template) works as a real plugin would.

It is registered the way the entry point would register it, then used end to end: build a
bundle on device "template", save it, load it and compare against numpy, also with builtin copies
between the cpu and "template". Broken plugins check the registry's isolation: one whose hook
raises, ones that speak another API major, one that takes a reserved workspace slot. Binary
selection (``BackendBase.load_kernel``) is checked with shared objects that really fail to open.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.backend import BackendBase, BinaryPayload, CandidateSpec, KernelBase
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.settings import Settings

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "examples" / "plugin-template"
sys.path.insert(0, str(TEMPLATE_DIR))

import engine_template.plugin as template_plugin  # noqa: E402 - needs the sys.path entry above
from engine_template import TemplateBackend  # noqa: E402
from support import check_reference_kernels  # noqa: E402

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
    assert row.api_version == (2, 0) == engine.backend.API_VERSION
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
    assert isinstance(kernel, KernelBase)

    a, c = np.arange(5, dtype=np.float32), np.full(5, 2.0, np.float32)
    stream = backend.current_stream()
    bufs = [backend.allocate(20, 0, stream) for _ in range(3)]
    backend.copy_from_host(bufs[0].ptr, a.ctypes.data, 20, stream)
    backend.copy_from_host(bufs[1].ptr, c.ctypes.data, 20, stream)
    kernel.launch([s.ptr for s in bufs], [5], None, stream)
    out = np.empty(5, np.float32)
    backend.copy_to_host(out.ctypes.data, bufs[2].ptr, 20, stream)
    backend.synchronize(0, stream)
    np.testing.assert_array_equal(out, a + c)

    nothing = CandidateSpec("vadd", 1, "vadd", (foreign,), None, 2, 1, ("n",), False)
    with pytest.raises(engine.KernelError, match=r"kernel 'vadd' candidate 1 .*vadd.so \(elf-so, sparc64-linux\)"):
        backend.load_kernel(nothing)


def _unresolved_object(backend: TemplateBackend, missing: str, path: str) -> BinaryPayload:
    """A real shared object for this machine that dlopen refuses (an unresolved symbol)."""
    (payload,) = backend.compile(f"int {missing}(void);\nint vadd(void) {{ return {missing}(); }}\n", "c")
    return BinaryPayload(payload.format, payload.target, path, payload.data)


def test_a_binary_that_does_not_open_moves_selection_to_the_next(registry: Registry) -> None:
    backend = registry.backend("template")
    broken = _unresolved_object(backend, "missing_a", "a.so")
    assert backend.loadable(broken.format, broken.target) is None  # it looks loadable ...
    source = BinaryPayload("c-source", "any", "vadd.c", VADD_C.encode())
    kernel = backend.load_kernel(CandidateSpec("vadd", 0, "vadd", (broken, source), None, 2, 1, ("n",), False))
    assert kernel.binary is source  # ... but _load_binary refused it (BinaryRefused), so the source won

    also_broken = _unresolved_object(backend, "missing_b", "b.so")
    with pytest.raises(engine.KernelError) as info:
        backend.load_kernel(CandidateSpec("vadd", 2, "vadd", (broken, also_broken), None, 2, 1, ("n",), False))
    message = str(info.value)
    assert message.startswith("kernel 'vadd' candidate 2 (entry 'vadd'): no loadable binary for template:0: ")
    assert "a.so (elf-so, " in message and "missing_a" in message
    assert "b.so (elf-so, " in message and "missing_b" in message
    assert message.index("missing_a") < message.index("missing_b")  # in the bundle's order
    assert "cannot open the shared object" in message
    assert message.endswith("or ship a c-source binary")


def test_reference_kernels_run_on_the_template(registry: Registry) -> None:
    backend = registry.backend("template")
    refs = backend.reference_kernels()
    assert {"add", "scale_ws", "busy", "fail_code", "mlp_matmul", "mlp_softmax"} <= set(refs)
    check_reference_kernels(backend)


def test_the_template_uses_only_the_public_engine_api() -> None:
    # A vendor's plugin cannot import the CPU plugin or the engine's private names; neither may the template.
    for module in sorted((TEMPLATE_DIR / "engine_template").glob("*.py")):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [(alias.name, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "", alias.name) for alias in node.names]
            else:
                continue
            for source, name in names:
                parts = [*source.split("."), *name.split(".")]
                assert parts[0] != "engine_cpu", f"{module.name} imports {source}"
                if parts[0] == "engine":
                    assert not any(part.startswith("_") for part in parts), f"{module.name} imports {source}.{name}"


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


class _RefusedBackend(BackendBase):
    def availability(self):
        raise AssertionError("a refused backend is never asked anything")


class _FutureBackend(_RefusedBackend):
    kind = "future"
    workspace_slot = 8
    api_version = (3, 0)


class _OldBackend(_RefusedBackend):
    kind = "old"
    workspace_slot = 9
    api_version = (1, 0)


class _SlotThreeBackend(_RefusedBackend):
    kind = "slotthree"
    workspace_slot = 3


def test_a_backend_for_a_newer_api_major_is_refused(registry: Registry) -> None:
    registry.register_plugin(_plugin_module("future_plugin", lambda: [_FutureBackend()]))
    row = next(r for r in engine.devices(registry) if r.kind == "future")
    assert not row.available
    assert "speaks plugin API 3.0, this engine speaks 2.0" in row.reason
    assert "upgrade the engine" in row.reason
    with pytest.raises(engine.PluginError, match=r"'future'.*speaks plugin API 3\.0.*upgrade the engine"):
        registry.backend("future")
    assert registry.backend("template") is not None


def test_a_backend_for_api_1_is_told_to_upgrade_and_what_changed(registry: Registry) -> None:
    registry.register_plugin(_plugin_module("old_plugin", lambda: [_OldBackend()]), distribution="engine-old")
    row = next(r for r in engine.devices(registry) if r.kind == "old")
    assert not row.available and row.distribution == "engine-old"
    assert "speaks plugin API 1.0, this engine speaks 2.0" in row.reason
    assert "upgrade the plugin" in row.reason
    assert "2.0:" in row.reason and "DevicePtr" in row.reason and "_load_binary" in row.reason
    with pytest.raises(engine.PluginError, match=r"'old'.*upgrade the plugin"):
        registry.backend("old")
    assert registry.kinds() == ["template"]


def test_a_third_party_kind_on_the_opencl_slot_is_refused(registry: Registry) -> None:
    registry.register_plugin(_plugin_module("slot_plugin", lambda: [_SlotThreeBackend()]))
    row = next(r for r in engine.devices(registry) if r.kind == "slotthree")
    assert not row.available
    assert "declares 3" in row.reason and "opencl 3" in row.reason
    with pytest.raises(engine.PluginError, match=r"'slotthree'.*workspace slot"):
        registry.backend("slotthree")


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
