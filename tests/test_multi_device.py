"""Plans over two device kinds (issue 3): each kind's intermediates and scratch in its own workspace slot.

The second kind is ``hostdev`` from ``support.py``: host memory under its own kind name and slot 4
(3 is reserved for opencl), registered by the test suite, not by an installed plugin (the shape a third-party plugin takes).
A third kind declared here, ``hostdev256``, asks for 256-byte alignment, as GPU backends do.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.storage import Storage
from support import HostKindBackend, make_registry
from test_memory_planner import check_key_plan, run_and_compare

from engine.testing import random_dags  # noqa: E402

from engine.runtime.plan import WORKSPACE  # noqa: E402
import engine  # noqa: E402
from engine.build import GraphBuilder  # noqa: E402
from engine.plugins import Registry  # noqa: E402
from engine.settings import Settings as EngineSettings  # noqa: E402

CHAIN_C = r"""
#include <stdint.h>
int32_t twice(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] * 2.0f;
    return 0;
}
"""


class Host256Backend(HostKindBackend):
    """Like hostdev, but with 256-byte alignment (allocations and planned offsets) and slot 5."""

    kind = "hostdev256"
    workspace_slot = 5
    alignment = 256

    def _allocate(self, nbytes: int, device_index: int, stream: object = None) -> Storage:
        buf = np.empty(nbytes + 256, np.uint8)
        addr = buf.ctypes.data
        return Storage(self.device(device_index), addr + (-addr % 256), nbytes, owner=buf)


@pytest.fixture(scope="module")
def registry256(session_cache):
    registry = make_registry(session_cache)
    registry.register_backend(Host256Backend(registry.backend("cpu")), distribution="tests")
    return registry


def _two_kind_spec(device: str) -> random_dags.DagSpec:
    """x (cpu) -> a = f(x) [scratch] -> copy to `device` -> c = g(b) [scratch] -> d = h(c) in place
    -> copy back -> out = k(e, a): `a` stays live on the cpu while the other kind works."""
    spec = random_dags.DagSpec(("n",))
    x = spec.add("uint32", ["n", "3"], "cpu")
    spec.n_inputs = 1

    def op(dev, ins, shape, *, in_place=False, scratch="0", seed=1):
        out = spec.add("uint32" if not in_place else spec.tensors[ins[0]].dtype,
                       spec.tensors[ins[0]].shape if in_place else shape, dev)
        spec.ops.append(random_dags.OpSpec(dev, ins, [out], in_place=in_place, scratch=scratch,
                                     coefs=[(3, 5, 7, seed)], seed=seed))
        return out

    def copy(t, dev):
        out = spec.add(spec.tensors[t].dtype, spec.tensors[t].shape, dev)
        spec.ops.append(random_dags.OpSpec(dev, [t], [out], copy=True))
        return out

    a = op("cpu", [x], ["n", "3"], scratch="n * 40 + 3", seed=11)
    b = copy(a, device)
    c = op(device, [b], ["n", "5"], scratch="n * 8", seed=12)
    d = op(device, [c, b], None, in_place=True, scratch="77", seed=13)
    e = copy(d, "cpu")
    out = op("cpu", [e, a], ["n", "4"], seed=14)
    spec.outputs = [out]
    return spec


def test_each_kind_plans_into_its_own_slot(registry2):
    spec = _two_kind_spec("hostdev")
    graph = random_dags.build_dag(spec, registry2).build()
    assert {t.meta.device for t in graph.compiled_tasks} == {"cpu", "hostdev"}
    assert sum(t.is_copy for t in graph.compiled_tasks) == 2
    rng = np.random.default_rng(0)
    for n in (1, 9, 4, 30):
        run_and_compare(graph, spec, {"n": n}, rng)
        plan = graph.runtime.key_plan((n,))
        check_key_plan(graph.runtime.contents, plan, {"cpu": 64, "hostdev": 64})
        ex = graph.graph_execution
        for t, (where, _, kind) in enumerate(plan.placements):
            if where == WORKSPACE:
                assert kind == ex.tensor_device[t]
        assert set(plan.workspace_bytes) == {"cpu", "hostdev"}
        assert plan.scratch[0][0] == "cpu" and plan.scratch[2][0] == "hostdev" and plan.scratch[3][0] == "hostdev"
    # one workspace per kind, allocated by that kind's backend, in the running thread
    workspaces = graph.runtime.lane().workspaces
    assert {k: w.storages[0].device.kind for k, w in workspaces.items()} == {"cpu": "cpu", "hostdev": "hostdev"}
    report = graph.memory_report(n=30)
    assert {slot: m.kind for slot, m in report.items()} == {0: "cpu", 4: "hostdev"}
    for m in report.values():
        assert 0 < m.lower_bound_bytes <= m.planned_bytes <= m.no_reuse_bytes
        assert m.planned_bytes == graph.runtime.key_plan((30,)).workspace_bytes[m.kind]


@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
def test_random_two_kind_graphs(seed, registry2):
    spec = random_dags.random_dag(seed, kinds=("cpu", "hostdev"))
    graph = random_dags.build_dag(spec, registry2).build()
    rng = np.random.default_rng(seed)
    for _ in range(3):
        env = {s: int(rng.integers(1, 41)) for s in spec.symbols}
        run_and_compare(graph, spec, env, rng)
        check_key_plan(graph.runtime.contents, graph.runtime.key_plan(tuple(env[s] for s in graph.meta.symbols)),
                       {"cpu": 64, "hostdev": 64})


def test_a_kind_declares_its_own_alignment(registry256):
    spec = _two_kind_spec("hostdev256")
    graph = random_dags.build_dag(spec, registry256).build()
    rng = np.random.default_rng(1)
    for n in (3, 17):
        run_and_compare(graph, spec, {"n": n}, rng)
        plan = graph.runtime.key_plan((n,))
        check_key_plan(graph.runtime.contents, plan, {"cpu": 64, "hostdev256": 256})
        offsets = [index for where, index, kind in plan.placements if where == WORKSPACE and kind == "hostdev256"]
        offsets += [s[1] for s in plan.scratch if s is not None and s[0] == "hostdev256"]
        assert offsets and all(o % 256 == 0 for o in offsets)
        assert any(o % 256 for o in (plan.nbytes[t] for t in range(len(plan.nbytes))))  # sizes are not
    runtime = graph.runtime
    lane = runtime.lane()
    first = lane.workspaces["hostdev256"]
    assert first.base % 256 == 0
    runtime.ensure_workspaces(lane, runtime.key_plan((5,)))  # fits: nothing happens
    assert lane.workspaces["hostdev256"] is first
    runtime.ensure_workspaces(lane, runtime.key_plan((500,)))  # grows: a new one, as aligned
    assert lane.workspaces["hostdev256"] is not first and lane.workspaces["hostdev256"].base % 256 == 0
    report = graph.memory_report(n=17)
    assert report[5].kind == "hostdev256" and report[0].kind == "cpu"


# ---- a real second device: OpenCL on PoCL ------------------------------------------------------
def _opencl_registry(cache):
    opencl = pytest.importorskip("engine_opencl.plugin", reason="engine-opencl is not installed")
    import engine_cpu.plugin

    registry = Registry(EngineSettings(cache_dir=cache), autoload=False)
    registry.register_plugin(engine_cpu.plugin)
    registry.register_plugin(opencl)
    avail = registry.backend("opencl").availability()
    if not avail.available:
        pytest.skip(f"no OpenCL device: {avail.reason}")
    return registry


def test_a_plan_mixing_cpu_and_opencl_with_copies_between_them(tmp_path):
    """cpu kernel -> copy -> OpenCL kernels (device memory, BufferPtr) -> copy -> cpu kernel, both
    ways within one plan, plus a tensor read on both kinds; equal to numpy at several sizes."""
    registry = _opencl_registry(tmp_path)
    refs = registry.backend("opencl").reference_kernels()
    b = GraphBuilder("cpu_opencl", registry=registry)
    x = b.input("x", "float32", ["n"])
    y = b.input("y", "float32", ["n"], device="opencl")
    twice = b.kernel("twice", entries=["twice"], source=CHAIN_C)
    add = refs["add"]
    scale = refs["scale_ws"]
    k_add = b.kernel("add", device="opencl", entries=list(add.entries), source=add.source, language=add.language,
                     launch=add.launch)
    k_scale = b.kernel("scale_ws", device="opencl", entries=list(scale.entries), source=scale.source,
                       language=scale.language, launch=scale.launch)
    (h,) = b.call(twice, [x], [("float32", ["n"])], symbols=["n"])                       # cpu: 2x
    (hd,) = b.call(k_add, [b.copy(h, "opencl"), y], [("float32", ["n"])], symbols=["n"])  # opencl: 2x + y
    (sd,) = b.call(k_scale, [hd], [("float32", ["n"])], symbols=["n"], workspace="n * 4")  # opencl: 2(2x+y)+1
    (back,) = b.call(twice, [b.copy(sd, "cpu")], [("float32", ["n"])], symbols=["n"])     # cpu: 4(2x+y)+2
    b.output(back, "z")
    b.output(sd, "on_device")
    graph = b.build()
    assert {t.meta.device for t in graph.compiled_tasks} == {"cpu", "opencl"}
    assert sum(t.is_copy for t in graph.compiled_tasks) == 2
    rng = np.random.default_rng(0)
    for n in (1, 63, 1000, 4097):
        xv = rng.standard_normal(n).astype(np.float32)
        yv = rng.standard_normal(n).astype(np.float32)
        for _ in range(2):  # the slow path, then the prepared fast path
            z, on_device = graph.run_async([xv, engine.asarray(yv, device="opencl", registry=registry)])
            assert z.device == "cpu" and on_device.device == "opencl:0"
            np.testing.assert_allclose(z.numpy(), 4 * (2 * xv + yv) + 2, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(on_device.numpy(), 2 * (2 * xv + yv) + 1, rtol=1e-5, atol=1e-5)
    report = graph.memory_report(n=100)
    assert {m.kind for m in report.values()} == {"cpu", "opencl"} and 3 in report  # opencl's reserved slot
