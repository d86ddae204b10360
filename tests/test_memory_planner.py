"""Memory planner (issue 3): liveness, best-fit offsets, replayed plans, key plans of real graphs.

The plans are checked by code that shares nothing with the planner: liveness is recomputed here from
``graph_execution`` and the kernels' ``share_map``, and every pair of storages live at the same
instruction is compared byte for byte. Graph outputs are compared with a numpy evaluation in which
every tensor has its own array (a no-reuse execution), running kernels that fill their scratch with
garbage. Topologies, random DAGs and the reference first-fit planner come from
``benchmarks/planner.py``, which reports the same figures.
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.bundle.contents import read_bundle
from engine.bundle.writer import bundle_to_bytes
from engine.runtime.memory import (Block, Interference, ReplayTemplate, align_up, best_fit, fit, interfering_pairs,
                                  live_peak, lower_bound, plan_offsets, tie_ranks)
from engine.runtime.plan import INPUT, OUTPUT, WEIGHT, WORKSPACE, GraphPlanner, KeyPlan

from engine.testing import block_lists, random_dags  # noqa: E402

# Graph-building examples compile C (a few tenths of a second each): few examples, reproducible.
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


# -- an independent checker of key plans --------------------------------------------------------
def independent_storage(contents) -> tuple[dict[int, list[int]], dict[int, tuple[int, int]]]:
    """Storage groups (root -> members) and each group's live range, from the plan itself."""
    ex, kernels = contents.execution, contents.kernels
    n = len(ex.tensor_signatures)
    end = len(ex.instructions)
    root = list(range(n))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, ins in enumerate(ex.instructions):
        for t in ins.inputs:
            last[t] = pos
        for t in ins.outputs:
            first[t] = pos
            last[t] = pos
        for o, i in kernels[ins.task_idx].share_map.items():
            root[ins.outputs[o]] = root[ins.inputs[i]]
    for t in ex.outputs_index:
        last[t] = end
    groups: dict[int, list[int]] = {}
    for t in range(n):
        groups.setdefault(root[t], []).append(t)
    ranges = {r: (first.get(r, -1), max(last.get(m, first.get(m, -1)) for m in members))
              for r, members in groups.items()}
    return groups, ranges


def check_key_plan(contents, plan: KeyPlan, alignment: dict[str, int]) -> None:
    ex = contents.execution
    n_in, n_w = len(ex.inputs_index), len(ex.weights_index)
    groups, ranges = independent_storage(contents)
    outputs = set(ex.outputs_index)
    spans = []  # (kind, first, last, offset, nbytes, what)
    for r, members in groups.items():
        places = {plan.placements[m] for m in members}
        assert len(places) == 1, f"tensors {members} share storage but are placed at {places}"
        (p,) = places
        where, index, kind = p
        assert kind == ex.tensor_device[r]
        if r < n_in:
            assert p == (INPUT, r, ex.tensor_device[r])
        elif r < n_in + n_w:
            assert p == (WEIGHT, r - n_in, ex.tensor_device[r])
        elif outputs & set(members):
            assert where == OUTPUT
            assert plan.output_slots[index].nbytes >= max(plan.nbytes[m] for m in members)
        else:
            assert where == WORKSPACE, f"intermediate group {members} is not in the workspace: {p}"
            size = plan.nbytes[r]
            assert all(plan.nbytes[m] == size for m in members)
            spans.append((kind, *ranges[r], index, size, f"tensors {members}"))
    for t, shape in enumerate(plan.shapes):
        assert plan.nbytes[t] == ex.tensor_signatures[t].dtype.nbytes * int(np.prod(shape, dtype=np.int64))
    for pos, ins in enumerate(ex.instructions):
        kernel = contents.kernels[ins.task_idx]
        size = kernel.workspace.evaluate(plan.env)
        if size == 0:
            assert plan.scratch[pos] is None
            continue
        kind, offset, nbytes = plan.scratch[pos]
        assert kind == kernel.device and nbytes == size
        spans.append((kind, pos, pos, offset, nbytes, f"scratch of instruction {pos}"))
    for kind, a, b, offset, nbytes, what in spans:
        assert offset % alignment[kind] == 0, f"{what} at offset {offset} is not {alignment[kind]}-aligned"
        assert 0 <= offset and offset + nbytes <= plan.workspace_bytes[kind], f"{what} outside the workspace"
    spans.sort(key=lambda s: (s[0], s[1]))
    for i, (kind, a, b, off, size, what) in enumerate(spans):
        for kind2, a2, b2, off2, size2, what2 in spans[i + 1:]:
            if kind2 != kind or a2 > b:
                break
            if size and size2 and off < off2 + size2 and off2 < off + size:
                raise AssertionError(f"{what} [{a}, {b}] and {what2} [{a2}, {b2}] are live together and overlap "
                                     f"in the {kind} workspace at offsets {off} and {off2}")
    assert plan.lower_bound_bytes.keys() == plan.workspace_bytes.keys()
    for kind in plan.workspace_bytes:
        assert plan.lower_bound_bytes[kind] <= plan.workspace_bytes[kind] <= plan.no_reuse_bytes[kind]


def _env(spec: random_dags.DagSpec, rng: np.random.Generator) -> dict[str, int]:
    return {s: int(rng.integers(1, 41)) for s in spec.symbols}


def run_and_compare(graph, spec: random_dags.DagSpec, env: dict[str, int], rng: np.random.Generator) -> None:
    xs = random_dags.random_inputs(spec, env, rng)
    want = random_dags.reference(spec, env, xs)
    for _ in range(2):  # the first run at a key is interpreted or prepared, the second is the fast path
        got = graph.run_async([x.copy() for x in xs])  # fresh copies: some graphs write an input in place
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g.numpy(), w, err_msg=f"output {k} at {env}")


# -- liveness (validate.py) ---------------------------------------------------------------------
def _with_execution(members: dict, edit) -> bytes:
    ex = json.loads(members["graph_execution.json"])
    edit(ex)
    return bundle_to_bytes({**members, "graph_execution.json": json.dumps(ex).encode()}, engine_version="test")


@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, **SLOW)
def test_liveness_matches_an_independent_computation(seed, registry2):
    spec = random_dags.random_dag(seed, kinds=("cpu", "hostdev") if seed % 2 else ("cpu",))
    contents = read_bundle(random_dags.build_dag(spec, registry2, noop=True).to_bytes())
    an = contents.analysis
    groups, ranges = independent_storage(contents)
    for r, members in groups.items():
        for m in members:
            assert an.alias_root[m] == r
        if an.roles[r] == "intermediate":
            assert ranges[r] == (an.producer[r], max(an.last_use[m] for m in members))


def _chain_with_in_place(registry):
    """x -> y = k(x) -> z = k(y) in place over y -> w = k(z) -> out = k(w)."""
    b = engine.build.GraphBuilder("inplace", registry=registry)
    x = b.input("x", "uint32", ["n"])
    k = b.kernel("noop", entries=["noop"], source=random_dags.NOOP_SOURCE)
    (y,) = b.call(k, [x], [("uint32", ["n"])])
    (z,) = b.call(k, [y], [("uint32", ["n"])], share_map={0: 0})
    (w,) = b.call(k, [z], [("uint32", ["n"])])
    (out,) = b.call(k, [w, x], [("uint32", ["n"])])
    b.output(out)
    return b


def test_free_lists_are_checked_per_tensor(registry):
    members = _chain_with_in_place(registry).members()
    # tensors: x=0, y=1, z=2 (in place over y), w=3, out=4. Freeing y where z is written over it is
    # honest (its last use as y), even though its storage lives on as z.
    good = _with_execution(members, lambda ex: None)
    ex = read_bundle(good).execution
    assert 1 in ex.instructions[1].free and 2 in ex.instructions[2].free
    contents = read_bundle(good)
    assert contents.analysis.alias_root[2] == 1
    plan = GraphPlanner(contents, {"cpu": 64}).plan((5,))
    assert plan.placements[1] == plan.placements[2]
    check_key_plan(contents, plan, {"cpu": 64})

    def early(ex):
        ex["instructions"][2]["free"] = []
        ex["instructions"][1]["free"] = [2]  # z is read by instruction 2

    with pytest.raises(engine.BundleError, match="frees tensor 2 at instruction 1 but instruction 2 still uses it"):
        read_bundle(_with_execution(members, early))

    def twice(ex):
        ex["instructions"][3]["free"] = [3, 1]

    with pytest.raises(engine.BundleError, match="frees tensor 1 twice"):
        read_bundle(_with_execution(members, twice))

    def output(ex):
        ex["instructions"][3]["free"] = [4]

    with pytest.raises(engine.BundleError, match="graph output 0 .* is freed"):
        read_bundle(_with_execution(members, output))

    def none(ex):  # a tensor missing from every free list is fine
        for ins in ex["instructions"]:
            ins["free"] = []

    read_bundle(_with_execution(members, none))


# -- the planner on block lists ------------------------------------------------------------------
blocks_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 12), st.one_of(st.integers(0, 300), st.integers(0, 1 << 20))),
    max_size=60,
).map(lambda raw: [Block(s, s + length, size) for s, length, size in raw])


@given(blocks=blocks_strategy, alignment=st.sampled_from([1, 8, 64, 128, 256]))
@settings(max_examples=300, deadline=None)
def test_best_fit_plans_are_valid_and_deterministic(blocks, alignment):
    plan = plan_offsets(blocks, alignment)
    block_lists.check_plan(blocks, plan.offsets, plan.total_bytes, alignment)
    bound = lower_bound(blocks, alignment)
    no_reuse = sum(align_up(b.nbytes, alignment) for b in blocks)
    assert bound <= plan.total_bytes <= no_reuse
    assert plan_offsets(list(blocks), alignment) == plan
    for i, b in enumerate(blocks):
        if b.nbytes == 0:
            assert plan.offsets[i] == 0


@given(blocks=blocks_strategy, data=st.data())
@settings(max_examples=200, deadline=None)
def test_replayed_plans_are_valid_for_any_sizes(blocks, data):
    starts, ends = [b.start for b in blocks], [b.end for b in blocks]
    sizes = [align_up(b.nbytes, 64) for b in blocks]
    template, offsets, peak = ReplayTemplate.from_blocks(starts, ends, sizes)
    if all(sizes):  # with its own sizes the replay is the plan
        again, again_peak = template.replay(np.array(sizes, np.int64))
        assert again.tolist() == offsets and again_peak == peak
    new = [align_up(s, 64) for s in data.draw(st.lists(st.integers(0, 1 << 22), min_size=len(blocks),
                                                       max_size=len(blocks)))]
    replayed, replayed_peak = template.replay(np.array(new, np.int64))
    moved = [Block(s, e, n) for s, e, n in zip(starts, ends, new)]
    block_lists.check_plan(moved, replayed.tolist(), replayed_peak, 64)
    assert replayed_peak >= lower_bound(moved)


@given(blocks=blocks_strategy, data=st.data())
@settings(max_examples=200, deadline=None)
def test_vectorised_fit_is_best_fit_in_the_same_order(blocks, data):
    starts, ends = [b.start for b in blocks], [b.end for b in blocks]
    sizes = [align_up(b.nbytes, 64) for b in blocks]
    order = data.draw(st.permutations(range(len(blocks))))
    arrays = [np.array(v, np.int64) for v in (starts, ends, sizes)]
    offsets, peak = fit(arrays[2], np.array(order, np.int64), Interference(arrays[0], arrays[1]))
    assert (offsets.tolist(), peak) == best_fit(starts, ends, sizes, order)


def _longest_chain(starts, ends, rank) -> int:
    """Blocks in the longest sequence of interfering blocks that rises in ``rank`` (fit's rounds)."""
    a, b = interfering_pairs(np.array(starts), np.array(ends))
    earlier: dict[int, list[int]] = {}
    for x, y in zip(a.tolist(), b.tolist()):
        lo, hi = (x, y) if rank[x] < rank[y] else (y, x)
        earlier.setdefault(hi, []).append(lo)
    depth = {}
    for i in sorted(range(len(starts)), key=lambda i: rank[i]):
        depth[i] = 1 + max((depth[j] for j in earlier.get(i, ())), default=0)
    return max(depth.values(), default=0)


def test_equal_sizes_are_taken_by_colour_not_by_start():
    """1,000 equal tensors, each live with the next two: by start each would wait for the one before
    (1,000 rounds of ``fit``); by colour there are three rounds, and the plan still meets the bound."""
    starts = list(range(1000))
    ends = [s + 2 for s in starts]
    sizes = np.full(1000, 4096, np.int64)
    ties = tie_ranks(np.array(starts), np.array(ends), sizes)
    order = np.lexsort((ties, -sizes))
    rank = np.empty(1000, np.int64)
    rank[order] = np.arange(1000)
    assert _longest_chain(starts, ends, rank.tolist()) == 3
    assert _longest_chain(starts, ends, starts) == 1000
    offsets, peak = fit(sizes, order, Interference(np.array(starts), np.array(ends)))
    assert peak == live_peak(np.array(starts), np.array(ends), sizes) == 3 * 4096
    assert sorted(set(offsets.tolist())) == [0, 4096, 8192]


def test_zero_and_empty_cases():
    assert plan_offsets([], 64).total_bytes == 0 and lower_bound([]) == 0
    plan = plan_offsets([Block(0, 3, 0), Block(1, 2, 0)], 64)
    assert plan.offsets == (0, 0) and plan.total_bytes == 0
    assert best_fit([0, 0], [5, 5], [64, 64])[0] == [0, 64]
    # two blocks live at different times share their bytes; scratch lives at one position only
    assert plan_offsets([Block(0, 1, 100), Block(2, 2, 100)], 64).total_bytes == 128


def _ratio(blocks, alignment=64):
    plan = plan_offsets(blocks, alignment)
    block_lists.check_plan(blocks, plan.offsets, plan.total_bytes, alignment)
    return plan.total_bytes / lower_bound(blocks, alignment)


def test_peak_near_the_lower_bound_on_100_random_dags():
    ratios = [_ratio(block_lists.random_blocks(seed)) for seed in range(100)]
    print(f"\nbest-fit / lower bound over 100 random DAGs: mean {statistics.mean(ratios):.4f}, max {max(ratios):.4f}")
    assert statistics.mean(ratios) <= 1.05
    assert max(ratios) <= 1.15


@pytest.mark.parametrize("name", list(block_lists.TOPOLOGIES))
def test_peak_near_the_lower_bound_on_model_topologies(name):
    blocks = block_lists.TOPOLOGIES[name]()
    bound = lower_bound(blocks, 64)
    ratio = _ratio(blocks)
    ff_offsets, ff_total = block_lists.first_fit_128(blocks)
    block_lists.check_plan(blocks, ff_offsets, ff_total, 128)
    print(f"\n{name}: best-fit {ratio:.3f}, first-fit-128 {ff_total / bound:.3f}, "
          f"no reuse {sum(align_up(b.nbytes, 64) for b in blocks) / bound:.3f} x the lower bound")
    assert ratio <= 1.05
    assert ratio * bound <= ff_total


def test_live_peak_is_the_largest_live_total():
    blocks = [Block(0, 2, 10), Block(1, 1, 5), Block(2, 4, 7), Block(5, 5, 100)]
    assert lower_bound(blocks) == 100
    starts, ends, sizes = (np.array(v, np.int64) for v in ([0, 1, 2], [2, 1, 4], [10, 5, 7]))
    assert live_peak(starts, ends, sizes) == 17


# -- key plans of real graphs ------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=8, **SLOW)
def test_random_graphs_match_a_no_reuse_execution(seed, registry):
    spec = random_dags.random_dag(seed)
    graph = random_dags.build_dag(spec, registry).build()
    rng = np.random.default_rng(seed)
    alignment = {k: b.alignment for k, b in graph.runtime.devices.backends.items()}
    for _ in range(3):
        env = _env(spec, rng)
        run_and_compare(graph, spec, env, rng)
        key = tuple(env[s] for s in graph.meta.symbols)
        plan = graph.runtime.key_plan(key)
        check_key_plan(graph.runtime.contents, plan, alignment)
        for t in range(len(spec.tensors)):
            assert plan.shapes[t] == random_dags.shape_at(spec, t, env)


@pytest.fixture(scope="module")
def dag_graph(registry):
    spec = random_dags.random_dag(7, n_ops=40)
    return spec, random_dags.build_dag(spec, registry).build()


def test_plans_are_cached_per_key_and_deterministic(dag_graph, registry):
    spec, graph = dag_graph
    other = engine.load_compiled_graph(graph.to_bytes(), registry=registry)
    keys = [tuple(int(v) for v in np.random.default_rng(i).integers(1, 200, len(spec.symbols))) for i in range(6)]
    first = [graph.runtime.key_plan(k) for k in keys]
    second = [other.runtime.key_plan(k) for k in reversed(keys)][::-1]
    assert first == second  # whatever order keys arrive in, a key's plan is the same
    assert all(graph.runtime.key_plan(k) is p for k, p in zip(keys, first))
    report = graph.memory_report(**dict(zip(graph.meta.symbols, keys[0])))
    assert report[0].planned_bytes == first[0].workspace_bytes["cpu"]


def test_replayed_keys_stay_near_the_lower_bound(dag_graph):
    spec, graph = dag_graph
    alignment = {"cpu": 64}
    rng = np.random.default_rng(3)
    ratios = []
    for _ in range(30):
        key = tuple(int(v) for v in rng.integers(1, 300, len(spec.symbols)))
        plan = graph.runtime.key_plan(key)
        check_key_plan(graph.runtime.contents, plan, alignment)
        ratios.append(plan.workspace_bytes["cpu"] / plan.lower_bound_bytes["cpu"])
    assert max(ratios) <= 1.10 and statistics.mean(ratios) <= 1.03


def _scratch_chain(registry, n_ops: int, scratch: str = "n * 16"):
    b = engine.build.GraphBuilder("chain", registry=registry)
    x = b.input("x", "float32", ["n", 4])
    k = b.kernel("noop", entries=["noop"], source=random_dags.NOOP_SOURCE)
    for _ in range(n_ops):
        (x,) = b.call(k, [x], [("float32", ["n", 4])], workspace=scratch)
    b.output(x)
    return b


def test_scratch_lives_only_during_its_instruction(registry):
    graph = _scratch_chain(registry, 10).build()
    plan = graph.runtime.key_plan((8,))
    # one tensor in, one out and one scratch at a time: three 128-byte blocks at most
    assert plan.lower_bound_bytes["cpu"] == plan.workspace_bytes["cpu"] == 3 * 128
    assert plan.no_reuse_bytes["cpu"] == (9 + 10) * 128
    offsets = {s[1] for s in plan.scratch}
    assert len(offsets) <= 3
    check_key_plan(graph.runtime.contents, plan, {"cpu": 64})


def test_a_template_key_uses_its_own_plan(registry):
    contents = read_bundle(_scratch_chain(registry, 10).to_bytes())
    planner = GraphPlanner(contents, {"cpu": 64})
    plan = planner.plan((8,))  # 8 is its own template key: planned once, no replay recorded
    assert plan.planned_by == {"cpu": "template"}
    assert planner.kinds["cpu"].templates[(8,)].replayer is None
    check_key_plan(contents, plan, {"cpu": 64})
    again = planner.plan((7,))  # replays the template of 8
    assert again.planned_by == {"cpu": "replay"} and planner.kinds["cpu"].templates[(8,)].replayer is not None
    check_key_plan(contents, again, {"cpu": 64})
    assert GraphPlanner(contents, {"cpu": 64}).plan((8,)) == plan


def test_bad_sizes_are_input_errors(registry):
    b = engine.build.GraphBuilder("bad", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("noop", entries=["noop"], source=random_dags.NOOP_SOURCE)
    (y,) = b.call(k, [x], [("float32", ["n - 5"])])
    (z,) = b.call(k, [y], [("float32", ["n"])], workspace="n * 1099511627776")
    b.output(z)
    planner = GraphPlanner(read_bundle(b.to_bytes()), {"cpu": 64})
    with pytest.raises(engine.InputError, match="tensor 1 would have a negative dimension"):
        planner.plan((2,))
    plan = planner.plan((6,))  # planned, never allocated here
    assert plan.scratch[1][2] == 6 << 40 and plan.workspace_bytes["cpu"] == (6 << 40) + 64
    with pytest.raises(engine.InputError, match="workspace 'n \\* 1099511627776' is too large"):
        planner.plan(((1 << 22) + 1,))
    with pytest.raises(engine.InputError, match="int64 overflow"):  # the key is at fault, not the bundle
        planner.plan((1 << 23,))


def test_memory_report_per_slot(dag_graph):
    spec, graph = dag_graph
    symbols = {s: 17 for s in graph.meta.symbols}
    report = graph.memory_report(**symbols)
    cpu = report[0]
    assert (cpu.slot, cpu.kind) == (0, "cpu")
    assert cpu.lower_bound_bytes <= cpu.planned_bytes <= cpu.no_reuse_bytes
    assert cpu.ratio == cpu.planned_bytes / cpu.lower_bound_bytes
    text = str(report)
    assert "lower bound" in text and "no reuse" in text and f"{cpu.ratio:.3f}" in text
    with pytest.raises(engine.InputError, match="needs exactly the symbols"):
        graph.memory_report(batch=3)


def test_new_keys_of_a_1000_instruction_graph_plan_at_the_lower_bound(registry):
    """Every new key of a long graph, from a warm planner (its template reused) and from fresh
    ones, plans at the lower bound. How fast that is is measured by benchmarks/planner.py."""
    contents = read_bundle(_scratch_chain(registry, 1000, scratch="n * 64 + 4").to_bytes())
    planner = GraphPlanner(contents, {"cpu": 64})
    planner.plan((1,))
    for n in range(2, 12):
        plan = planner.plan((n,))
        assert plan.workspace_bytes["cpu"] == plan.lower_bound_bytes["cpu"]
    for n in (3, 5, 6):
        plan = GraphPlanner(contents, {"cpu": 64}).plan((n,))
        assert plan.workspace_bytes["cpu"] == plan.lower_bound_bytes["cpu"]
