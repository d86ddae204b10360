"""The compiled planner passes (``engine/runtime/_planner.c``) against the numpy and Python ones.

The extension is optional (an install without a C compiler plans with numpy), so both must give the
same plans: every comparison here runs the same call with the extension and inside
``engine.compiled.python_passes()``. ``./scripts/test`` sets ENGINE_REQUIRE_NATIVE=1 so that CI fails, rather than skips,
when the extension was not built.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.build import GraphBuilder
from engine.bundle.contents import read_bundle
from engine.compiled import HELPERS, python_passes
from engine.errors import EngineError
from engine.runtime.memory import (Block, Interference, ReplayTemplate, align_up, best_fit, by_area, live_peak,
                                   plan_array, plan_offsets)
from engine.runtime.plan import GraphPlanner

from engine.testing import block_lists, random_dags  # noqa: E402

NATIVE = HELPERS.planner

if NATIVE is None:
    if os.environ.get("ENGINE_REQUIRE_NATIVE") == "1":
        raise RuntimeError("engine.runtime._planner was not built (ENGINE_REQUIRE_NATIVE=1): "
                           "`pip install -e .` needs a C compiler")
    pytestmark = pytest.mark.skip(reason="engine.runtime._planner was not built (no C compiler at install)")


def _arrays(blocks, alignment=64):
    starts = np.array([b.start for b in blocks], np.int64)
    ends = np.array([b.end for b in blocks], np.int64)
    sizes = np.array([align_up(b.nbytes, alignment) for b in blocks], np.int64)
    return starts, ends, sizes


blocks_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 12), st.one_of(st.integers(0, 300), st.integers(0, 1 << 20))),
    max_size=60,
).map(lambda raw: [Block(s, s + length, size) for s, length, size in raw])


@given(blocks=blocks_strategy, data=st.data())
@settings(max_examples=300, deadline=None)
def test_one_pass_is_python_best_fit_in_any_order(blocks, data):
    starts, ends, sizes = _arrays(blocks)
    order = data.draw(st.permutations(range(len(blocks))))
    graph = Interference(starts, ends)
    offsets = np.empty(len(blocks), np.int64)
    peak = NATIVE.plan(graph.indptr, graph.indices, sizes, np.array(order, np.int64), offsets, 1, 0)
    assert (offsets.tolist(), peak) == best_fit(starts.tolist(), ends.tolist(), sizes.tolist(), order)


@given(blocks=blocks_strategy, rounds=st.integers(1, 8), slack=st.sampled_from([0, 1, 5]))
@settings(max_examples=300, deadline=None)
def test_refined_plans_equal_the_python_refinement(blocks, rounds, slack):
    starts, ends, sizes = _arrays(blocks)
    bound = live_peak(starts, ends, sizes)
    target = bound + bound * slack // 100
    native = plan_array(starts, ends, sizes, bound, target, rounds)
    with python_passes():
        reference = plan_array(starts, ends, sizes, bound, target, rounds)
    assert (native[0].tolist(), native[1]) == (reference[0].tolist(), reference[1])


def test_refinement_equal_on_random_dags_that_need_it():
    """The random DAGs of the benchmark whose first pass misses the bound: the refinement rounds (and
    the second starting order) run in C and in Python with the same result."""
    refined = 0
    for seed in range(100):
        starts, ends, sizes = _arrays(block_lists.random_blocks(seed))
        bound = live_peak(starts, ends, sizes)
        first = plan_array(starts, ends, sizes, bound, rounds=1)[1]
        refined += first > bound
        native = plan_array(starts, ends, sizes, bound)
        with python_passes():
            reference = plan_array(starts, ends, sizes, bound)
        assert (native[0].tolist(), native[1]) == (reference[0].tolist(), reference[1]), seed
    assert refined >= 5  # the comparison above exercised refinement


@given(blocks=blocks_strategy, data=st.data())
@settings(max_examples=200, deadline=None)
def test_replay_equals_the_levelled_numpy_replay(blocks, data):
    starts, ends, sizes = _arrays(blocks)
    padded = np.where(sizes > 0, sizes, 64)
    offsets, _ = plan_array(starts, ends, padded)
    template = ReplayTemplate(starts, ends, offsets, padded)
    new = np.array([align_up(s, 64) for s in data.draw(st.lists(st.integers(0, 1 << 22), min_size=len(blocks),
                                                                max_size=len(blocks)))], np.int64)
    got, got_peak = template.replay(new)
    with python_passes():  # the same template built for the levelled numpy replay
        want, want_peak = ReplayTemplate(starts, ends, offsets, padded).replay(new)
    assert (got.tolist(), got_peak) == (want.tolist(), want_peak)


@given(keys=st.lists(st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.integers(0, 1 << 40)),
                     max_size=300), descending=st.booleans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_stable_order_is_numpys_stable_argsort(keys, descending, data):
    """The radix sort behind the compiled passes' orders (sizes descending in tie order; template
    offsets ascending) against numpy's stable argsort."""
    keys = np.array(keys, np.int64)
    n = len(keys)
    ranks = np.array(data.draw(st.permutations(range(n))), np.int64) if data.draw(st.booleans()) else None
    start = np.arange(n) if ranks is None else np.argsort(ranks)
    if descending:  # -key would overflow at the int64 minimum: sort the reversed ranks of the keys
        order_keys = -np.searchsorted(np.unique(keys), keys[start])
    else:
        order_keys = keys[start]
    want = start[np.argsort(order_keys, kind="stable")]
    got = np.empty(n, np.int64)
    NATIVE.stable_order(keys, descending, ranks, got)
    assert got.tolist() == want.tolist()


def test_stable_order_refuses_bad_ranks():
    out = np.empty(3, np.int64)
    with pytest.raises(ValueError, match="ranks is not a permutation"):
        NATIVE.stable_order(np.array([3, 1, 2], np.int64), False, np.array([0, 0, 1], np.int64), out)
    with pytest.raises(ValueError, match="differ in length"):
        NATIVE.stable_order(np.array([3, 1, 2], np.int64), False, None, np.empty(2, np.int64))


@given(blocks=blocks_strategy)
@settings(max_examples=200, deadline=None)
def test_live_peak_equals_numpy(blocks):
    starts, ends, sizes = _arrays(blocks)
    got = live_peak(starts, ends, sizes)
    with python_passes():
        assert got == live_peak(starts, ends, sizes)


def test_key_plans_are_the_same_with_either_passes(registry):
    """Whole key plans of the two 1,000-instruction benchmark graphs, at first keys, new buckets and
    replayed keys, with the extension and without it."""
    dag = random_dags.random_dag(101, n_ops=1000)
    cases = [(read_bundle(random_dags.transformer_bundle(registry).to_bytes()), [(1, 16), (3, 300), (4, 290), (32, 1000)]),
             (read_bundle(random_dags.build_dag(dag, registry, noop=True).to_bytes()),
              [tuple(range(k, k + len(dag.symbols))) for k in (1, 7, 50, 199)])]
    for contents, keys in cases:
        native = GraphPlanner(contents, {"cpu": 64})
        native_plans = [native.plan(k) for k in keys]
        with python_passes():
            python = GraphPlanner(contents, {"cpu": 64})
            python_plans = [python.plan(k) for k in keys]
        assert native_plans == python_plans
        assert {p.planned_by["cpu"] for p in native_plans} >= {"replay"}


def test_planning_from_threads_gives_the_same_plans(registry):
    """Threads planning keys of one planner at once (the compiled passes release the GIL)."""
    contents = read_bundle(random_dags.transformer_bundle(registry, layers=20).to_bytes())
    keys = [(b, s) for b in (1, 3, 8) for s in (17, 100, 250, 513)]
    serial = [GraphPlanner(contents, {"cpu": 64}).plan(k) for k in keys]
    shared = GraphPlanner(contents, {"cpu": 64})
    results: dict[int, list] = {}

    def work(t: int) -> None:
        results[t] = [shared.plan(k) for k in (keys if t % 2 else keys[::-1])]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t, plans in results.items():
        assert plans == (serial if t % 2 else serial[::-1])


# -- the extension refuses bad arguments instead of reading out of bounds --------------------------
def _graph3():
    g = Interference(np.array([0, 0, 1], np.int64), np.array([1, 2, 2], np.int64))
    return g.indptr, g.indices


@pytest.mark.parametrize("change, message", [
    (dict(sizes=np.array([64, 64, 64], np.int32)), "sizes must be a 1-D C-contiguous int64 array"),
    (dict(sizes=np.array([[64, 64, 64]], np.int64)), "sizes must be a 1-D"),
    (dict(sizes=np.arange(6, dtype=np.int64)[::2]), "contiguous"),
    (dict(sizes=np.array([64, -1, 64], np.int64)), "sizes[1] = -1 is negative"),
    (dict(sizes=np.array([2**61, 2**61, 64], np.int64)), "more than 2**62"),
    (dict(indptr=np.array([0, 2, 4], np.int64)), "indptr has 3 entries for 3 blocks; expected 4"),
    (dict(indptr=np.array([0, 2, 1, 6], np.int64)), "indptr decreases at block 1"),
    (dict(indptr=np.array([0, 2, 4, 5], np.int64)), "indptr must run from 0 to len(indices) = 6"),
    (dict(indices=np.array([1, 2, 0, 9, 0, 1], np.int64)), "indices[3] = 9 is not a block"),
    (dict(order=np.array([0, 0, 1], np.int64)), "order is not a permutation"),
    (dict(order=np.array([0, 1], np.int64)), "order has 2 entries for 3 blocks"),
    (dict(offsets=np.zeros(2, np.int64)), "offsets has 2 entries for 3 blocks"),
    (dict(rounds=0), "rounds must be at least 1"),
    (dict(), None),
])
def test_plan_rejects_bad_arguments(change, message):
    indptr, indices = _graph3()
    args = dict(indptr=indptr, indices=indices, sizes=np.array([64, 128, 64], np.int64),
                order=np.array([1, 0, 2], np.int64), offsets=np.zeros(3, np.int64), rounds=1, target=0)
    args.update(change)
    def call():
        return NATIVE.plan(args["indptr"], args["indices"], args["sizes"], args["order"], args["offsets"],
                           args["rounds"], args["target"])
    if message is None:  # the control: these arguments are fine
        assert call() == 256  # the three blocks all meet at position 1
        return
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_read_only_offsets_and_bad_replay_and_live_peak_arguments_are_refused():
    indptr, indices = _graph3()
    sizes = np.array([64, 128, 64], np.int64)
    frozen = np.zeros(3, np.int64)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        NATIVE.plan(indptr, indices, sizes, np.array([1, 0, 2], np.int64), frozen, 1, 0)
    template = np.array([0, 64, 192], np.int64)
    by_offset = np.array([0, 1, 2], np.int64)
    out = np.zeros(3, np.int64)
    assert NATIVE.replay(indptr, indices, sizes, template, by_offset, out) == 256
    assert out.tolist() == [0, 64, 192]
    assert NATIVE.replay(indptr, indices, np.array([128, 64, 32], np.int64), template, by_offset, out) == 224
    assert out.tolist() == [0, 128, 192]  # other sizes, the same stack
    with pytest.raises(ValueError, match="not sorted by template offset at entry 1"):
        NATIVE.replay(indptr, indices, sizes, template, np.array([1, 0, 2], np.int64), out)
    with pytest.raises(ValueError, match="order is not a permutation"):
        NATIVE.replay(indptr, indices, sizes, template, np.array([0, 0, 2], np.int64), out)
    with pytest.raises(ValueError, match="template_offsets and offsets need 3 entries"):
        NATIVE.replay(indptr, indices, sizes, template[:2].copy(), by_offset, out)
    with pytest.raises(ValueError, match=r"block 1 has range 3\.\.2"):
        NATIVE.live_peak(np.array([0, 3], np.int64), np.array([1, 2], np.int64), np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        NATIVE.live_peak(np.array([0], np.int64), np.array([1, 2], np.int64), np.array([1, 1], np.int64))


def test_sizes_beyond_the_compiled_range_use_the_python_passes():
    """Totals over 2**62 (possible through the block-list API, not through graph keys) are planned by
    the Python pass, exactly."""
    blocks = [Block(0, 1, 2**62), Block(1, 2, 2**62), Block(2, 3, 2**61)]
    plan = plan_offsets(blocks, 64)
    assert plan.total_bytes == 2**63 and plan.offsets == (0, 2**62, 0)
    starts, ends, sizes = _arrays(blocks)
    assert live_peak(starts, ends, sizes) == 2**63  # beyond int64: counted in Python ints
    assert by_area(starts, ends, sizes).tolist() == [0, 1, 2]  # areas of 2**63: sorted in Python ints


def test_bad_keys_give_the_same_errors_with_either_passes(registry):
    """The compiled key sizes only accept a clean key; numpy then finds and names the problem."""
    b = GraphBuilder("bad", registry=registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("noop", entries=["noop"], source=random_dags.NOOP_SOURCE)
    (y,) = b.call(k, [x], [("float32", ["n - 5", "n", "n"])])
    (z,) = b.call(k, [y], [("float32", ["n"])], workspace="n * 1099511627776")
    (w,) = b.call(k, [z], [("float32", ["0", "n * 1099511627776", "n * 1099511627776"])])
    b.output(w)
    contents = read_bundle(b.to_bytes())
    for key in [(2,), (6,), ((1 << 22) + 1,), (1 << 23,), (1 << 21,)]:
        outcomes = []
        for passes in ("compiled", "python"):
            with (python_passes() if passes == "python" else contextlib.nullcontext()):
                try:
                    outcomes.append(GraphPlanner(contents, {"cpu": 64}).plan(key))
                except EngineError as e:
                    outcomes.append((type(e).__name__, str(e)))
        assert outcomes[0] == outcomes[1], key
    assert outcomes[0][0] == "InputError" and "is too large" in outcomes[0][1]  # 2**21 cubed x 4 bytes


def test_the_environment_switch_starts_a_process_on_the_python_passes():
    import subprocess
    import sys

    script = ("from engine.compiled import built; from engine.runtime import memory; from engine.expr import "
              "ExprBatch, parse_expr; b = ExprBatch([parse_expr(f'a * {k} + a // 3') for k in range(30)], ['a']); "
              "print(memory.native_passes(), b.compiled, built()['planner'], b.evaluate([7])[2])")
    for value, want in (("0", "False False True 16"), ("1", "True True True 16")):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ENGINE_COMPILED_HELPERS": value})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want.split()
