"""Offset assignment for the blocks that live in one workspace slot (DESIGN §6, issue 3).

A *block* is a number of bytes live over an inclusive range of instruction positions: an
intermediate tensor (with every tensor written in place over it), or a kernel's scratch, live only
during its instruction. Two blocks *interfere* when their ranges share a position; interfering
blocks must not share a byte. The planner gives every block an offset so that the workspace (the
largest ``offset + size``) is small. No plan can need less than the **lower bound**: the largest
total of bytes live at one position (``live_peak``).

**Size-ordered best-fit** (``fit``, ``best_fit``). Blocks are taken largest first (ties: by colour,
``tie_ranks``, then earlier start, then index: the result is deterministic). Each goes into the gap,
among the already placed blocks that interfere with it, that wastes the fewest bytes (the lowest
such gap on a tie), or on top of them when no gap is big enough. Why this order and rule: a large
block placed late finds no hole and lands on top, raising the peak by its whole size; placed first,
the large blocks settle at the bottom and the many small ones fill the holes between them, where
best-fit (rather than first-fit) keeps the large holes for the blocks that need them. Placing in
execution order instead (the reference runtime's first-fit arena) cannot know that a small tensor
allocated now will sit under a large one allocated later, and fragments (``docs/memory.md`` has the
figures).

**Refinement** (``plan_blocks``). Greedy orders sometimes strand a block on top of others that
interfere with it at different times, above the lower bound. When that happens the blocks that
reach the peak are moved to the front of the order and best-fit runs again (a "squeaky wheel"
search), a few rounds from the size order and a few from an order by size x lifetime; the lowest
peak wins. It stops as soon as a plan meets the lower bound, which on real model topologies is the
first one. Over 100 random DAGs this took the worst ratio from 1.29 to 1.02
(``benchmarks/planner.py``).

**Compiled** (``engine/runtime/_planner.c``). When the core was built with a C compiler, the best-fit
and refinement passes, the replay, the lower bound and the orders run there (about 0.1 ms a pass for
1,600 blocks), with exactly the results of the numpy and Python passes below, which remain the
fallback (``native_passes()`` tells which are in use; ``tests/test_native_planner.py`` compares them).

**Vectorised** (``fit``, numpy). A block's place depends only on the earlier blocks that interfere with it,
so ``fit`` places blocks in rounds, each round every block whose earlier neighbours are placed, all
at once with numpy; the result is exactly ``best_fit`` in the same order. The rounds are the longest
chain of interfering blocks rising in the order, which is why equal sizes go by colour (an interval
colouring) rather than by start: 7-9 rounds on a 1,000-instruction transformer instead of 664.
``Interference`` (who interferes with whom) depends only on the ranges: a graph computes it once.

The Python pass (``best_fit``, used by refinement) queries overlaps on a bucketed time axis: a
placed block is listed in every bucket of ``_BUCKET`` positions its range touches, so a query reads
the buckets of its own range instead of every placed block (the quadratic scan this replaced took
68 ms for a 1,000-instruction plan).

**Replay** (``ReplayTemplate``). A graph with symbols is planned for every new dispatch key, and
best-fit costs milliseconds for a 1,000-instruction plan in Python. But its *decisions* carry over
from key to key: in a finished plan every pair of interfering blocks is ordered (one lies wholly
below the other), and recomputing each block's offset as the highest top among the blocks below it,
with another key's sizes, gives a valid plan for *any* sizes. ``ReplayTemplate`` keeps that order
(compiled: the blocks sorted by template offset, one walk per replay; numpy: levels by Kahn's
rounds, replayed level by level). With the template's own sizes the replay reproduces the plan
exactly; when all sizes scale alike it reproduces it scaled. Callers compare the replayed peak with
the key's lower bound and fall back to ``plan_array`` when it is not good enough
(``engine.runtime.plan``).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import attrs
import numpy as np

from engine.compiled import HELPERS  # the compiled passes (``_planner.c``) where built and switched on

__all__ = ["Block", "MemoryPlan", "plan_offsets", "lower_bound", "align_up", "best_fit", "plan_blocks",
           "plan_array", "live_peak", "total_bytes", "by_area", "ReplayTemplate", "Interference", "fit", "tie_ranks",
           "native_passes", "segment_offsets", "SizeError"]

# Positions per bucket of the overlap index. Most intermediates live for a few instructions, so a
# query reads one or two buckets; 8 measured fastest on the 1,000-instruction benchmark plans.
_BUCKET = 8
#: Best-fit rounds per starting order in ``plan_blocks`` (the first one included).
REFINE_ROUNDS = 8
_INF = np.iinfo(np.int64).max
#: ``fit`` works in int64 with headroom above every offset; larger totals use the Python pass.
_FIT_LIMIT = 2**62


class SizeError(ValueError):
    """A block cannot be placed under a size limit (it is larger than a segment)."""


def segment_offsets(offsets: np.ndarray, sizes: np.ndarray, segment: int) -> tuple[np.ndarray, int]:
    """The plan ``offsets`` moved so that no block crosses a multiple of ``segment`` bytes.

    Blocks are visited by offset; one that would cross a boundary moves up to it, and every block
    above it moves by as much (the shift only grows with the offset), so two blocks that did not
    overlap still do not. Workspaces larger than a device's largest allocation are then one
    allocation per segment (``engine.runtime.workspace``). ``SizeError`` when a block is larger
    than a segment.
    """
    out = offsets.copy()
    shift = 0
    for i in np.argsort(offsets, kind="stable").tolist():
        size = int(sizes[i])
        if size == 0:
            continue
        if size > segment:
            raise SizeError(f"a block of {size} bytes is larger than the device's largest allocation "
                            f"({segment} bytes)")
        start = int(offsets[i]) + shift
        last = (start + size - 1) // segment
        if start // segment != last:
            bump = last * segment - start
            shift += bump
            start += bump
        out[i] = start
    return out, int((out + sizes).max(initial=0))


def native_passes() -> bool:
    """Whether the compiled passes (``engine.runtime._planner``) were built and are in use."""
    return HELPERS.planner is not None


@attrs.frozen
class Block:
    """``nbytes`` live from instruction ``start`` to instruction ``end``, both included."""

    start: int
    end: int      # inclusive
    nbytes: int


@attrs.frozen
class MemoryPlan:
    """An offset per block, and the workspace size the plan needs (its peak)."""

    offsets: tuple[int, ...]
    total_bytes: int


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_offsets(blocks: Sequence[Block], alignment: int) -> MemoryPlan:
    """Plan ``blocks`` (``plan_blocks``), every size rounded up to ``alignment``.

    A zero-byte block takes no space (offset 0). Deterministic: the same blocks give the same plan.
    """
    sizes = [align_up(b.nbytes, alignment) for b in blocks]
    offsets, total = plan_blocks([b.start for b in blocks], [b.end for b in blocks], sizes)
    return MemoryPlan(tuple(offsets), total)


def lower_bound(blocks: Sequence[Block], alignment: int = 1) -> int:
    """Largest total of simultaneously live (aligned) bytes: no plan can need less."""
    if not blocks:
        return 0
    return live_peak(np.array([b.start for b in blocks], np.int64), np.array([b.end for b in blocks], np.int64),
                     np.array([align_up(b.nbytes, alignment) for b in blocks], np.int64))


def total_bytes(sizes: np.ndarray) -> int:
    """The exact sum of an int64 array (as a Python int): in int64 where that cannot wrap."""
    n = len(sizes)
    if n == 0:
        return 0
    if 0 <= int(sizes.min()) and int(sizes.max()) <= (2**63 - 1) // n:
        return int(sizes.sum())
    return sum(sizes.tolist())


def _i64(values: np.ndarray) -> np.ndarray:
    """The array as the compiled passes take it (no copy when it already is one)."""
    return np.ascontiguousarray(values, np.int64)


def live_peak(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> int:
    """The lower bound from int64 arrays: the largest sum of ``sizes`` over blocks live at one position."""
    if len(sizes) == 0:
        return 0
    native = HELPERS.planner
    if native is not None:
        try:
            return native.live_peak(_i64(starts), _i64(ends), _i64(sizes))
        except native.SizeError:
            pass  # negative sizes or a total over 2**62: below
    if total_bytes(np.abs(sizes)) > _FIT_LIMIT:  # the int64 running sum could wrap: Python ints
        delta = [0] * (int(ends.max()) + 2)
        for s, e, z in zip(starts.tolist(), ends.tolist(), sizes.tolist()):
            delta[s] += z
            delta[e + 1] -= z
        return max(itertools.accumulate(delta))
    steps = np.zeros(int(ends.max()) + 2, np.int64)
    np.add.at(steps, starts, sizes)
    np.add.at(steps, ends + 1, -sizes)
    return int(np.cumsum(steps).max())


def plan_blocks(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int], bound: int | None = None,
                target: int | None = None, rounds: int = REFINE_ROUNDS) -> tuple[list[int], int]:
    """Best-fit with refinement (module docstring): ``(offsets, peak)``, sizes used as given.

    ``bound`` is the lower bound if the caller has it (computed otherwise). Refinement stops at
    the first plan whose peak is at most ``target`` (default: the bound).
    """
    offsets, peak = plan_array(np.asarray(starts, np.int64), np.asarray(ends, np.int64),
                               np.asarray(sizes, np.int64), bound, target, rounds)
    return offsets.tolist(), peak


def plan_array(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, bound: int | None = None,
               target: int | None = None, rounds: int = REFINE_ROUNDS, *, graph: Interference | None = None,
               ties: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``plan_blocks`` on int64 arrays, offsets as an int64 array. ``graph`` (the blocks'
    ``Interference``) and ``ties`` (``tie_ranks``) may be passed by a caller that keeps them: they
    depend only on the ranges (and, for ``ties``, on which blocks always have equal sizes).

    The first pass is ``fit`` in size order (ties: ``tie_ranks``); when its peak is above
    ``target``, refinement runs the Python best-fit from the squeaky-wheel orders.
    """
    n = len(sizes)
    if bound is None:
        bound = live_peak(starts, ends, sizes)
    if target is None:
        target = bound
    if n == 0:
        return np.zeros(0, np.int64), 0
    if ties is None:
        ties = tie_ranks(starts, ends, sizes)
    native = HELPERS.planner
    if native is not None:
        if graph is None:
            graph = Interference(starts, ends)
        sizes = _i64(sizes)
        first_a = np.empty(n, np.int64)
        native.stable_order(sizes, True, _i64(ties), first_a)  # as below, by a radix sort
        best = np.empty(n, np.int64)
        # Peaks the compiled passes make stay within 2**62, so clamping the target changes nothing.
        clamped = max(min(target, _FIT_LIMIT), -1)
        try:
            best_peak = native.plan(graph.indptr, graph.indices, sizes, first_a, best, rounds, clamped)
        except native.SizeError:
            pass  # negative sizes or a total over 2**62: the Python passes below
        else:
            if best_peak > target:
                other = np.empty(n, np.int64)
                peak = native.plan(graph.indptr, graph.indices, sizes, by_area(starts, ends, sizes), other, rounds,
                                   clamped)
                if peak < best_peak:
                    return other, peak
            return best, best_peak
    # Largest first, equal sizes by tie rank: a stable sort by size of the blocks in tie order (one
    # sort where np.lexsort((ties, -sizes)) makes two; ``ties`` ranks 0..n-1 once each).
    by_tie = np.empty(n, np.int64)
    by_tie[ties] = np.arange(n)
    first_a = by_tie[np.argsort(-sizes[by_tie], kind="stable")]
    if total_bytes(sizes) <= _FIT_LIMIT:
        best, best_peak = fit(sizes, first_a, graph if graph is not None else Interference(starts, ends))
        if best_peak <= target:
            return best, best_peak
        best_offsets = best.tolist()
    else:  # beyond fit's int64 headroom: the Python pass, in the same order
        best_offsets, best_peak = best_fit(starts.tolist(), ends.tolist(), sizes.tolist(), first_a.tolist())
        if best_peak <= target:
            return np.array(best_offsets, np.int64), best_peak
    first = first_a.tolist()
    starts_l, ends_l, sizes_l = starts.tolist(), ends.tolist(), sizes.tolist()
    starts_from: list[tuple[list[int], list[int] | None, int]] = [
        (first, best_offsets, best_peak), (by_area(starts, ends, sizes).tolist(), None, 0)]
    for order, offsets, peak in starts_from:
        for _ in range(rounds - (offsets is not None)):
            if offsets is not None:
                # Squeaky wheel: the blocks that reach the peak go first next time.
                hot = [i for i in order if offsets[i] + sizes_l[i] == peak]
                hot_set = set(hot)
                order = hot + [i for i in order if i not in hot_set]
            offsets, peak = best_fit(starts_l, ends_l, sizes_l, order)
            if peak < best_peak:
                best_offsets, best_peak = offsets, peak
                if peak <= target:
                    return np.array(best_offsets, np.int64), best_peak
    return np.array(best_offsets, np.int64), best_peak


def by_area(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The second starting order of refinement: by size x lifetime (largest first), then start,
    then index."""
    n = len(sizes)
    lengths = ends - starts + 1
    if n and int(sizes.max()) * int(lengths.max()) >= 2**63:  # int64 areas would wrap: Python ints
        s, e, z = starts.tolist(), ends.tolist(), sizes.tolist()
        return np.array(sorted(range(n), key=lambda i: (-z[i] * (e[i] - s[i] + 1), s[i], i)), np.int64)
    return np.lexsort((np.arange(n), starts, -(sizes * lengths)))


def tie_ranks(starts: np.ndarray, ends: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The order among blocks of equal size: a rank per block by (colour, start, index).

    Blocks with the same ``groups`` value (equal sizes) are coloured like an interval graph, greedily
    by start (the fewest colours: as many as blocks of the group live at once), and taken colour by
    colour. In start order, equal blocks that follow one another in time would each wait for the
    previous one (a chain as long as the graph, which ``fit`` would walk one round per block); by
    colour no two blocks of one colour interfere, so the chain is at most as long as the group's
    colours, and the plan is as good (the colouring packs the group as a sweep in start order
    would).
    """
    n = len(starts)
    colour = np.zeros(n, np.int64)
    if n:
        by_start = np.lexsort((np.arange(n), starts, groups))
        g_sorted = groups[by_start]
        cut = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1], True])
        many = np.flatnonzero(np.diff(cut) > 1)  # groups of one block keep colour 0
        if many.size:
            starts_l, ends_l = starts.tolist(), ends.tolist()
            out = colour.tolist()
            members_all = by_start.tolist()
            bounds = cut.tolist()
            for g in many.tolist():
                free: list[int] = []
                busy: list[tuple[int, int]] = []  # (end, colour)
                used = 0
                for i in members_all[bounds[g]:bounds[g + 1]]:
                    s = starts_l[i]
                    while busy and busy[0][0] < s:
                        heapq.heappush(free, heapq.heappop(busy)[1])
                    if free:
                        c = heapq.heappop(free)
                    else:
                        c = used
                        used += 1
                    out[i] = c
                    heapq.heappush(busy, (ends_l[i], c))
            colour = np.array(out, np.int64)
    order = np.lexsort((np.arange(n), starts, colour))
    ranks = np.empty(n, np.int64)
    ranks[order] = np.arange(n)
    return ranks


class Interference:
    """Which blocks interfere, from their ranges alone (so a graph computes it once for every key).

    ``a``, ``b``: every interfering pair once; ``indptr``, ``indices``: the neighbours of block ``i``
    are ``indices[indptr[i]:indptr[i + 1]]`` (CSR, what the compiled passes read); ``nbr``: the same
    rows padded with ``n`` (a sentinel) to one more column than the longest, and ``width[i]``: the
    columns row ``i`` needs (its neighbours and one pad), for the numpy passes, which build them on
    first use (with the compiled passes they are never needed).
    """

    __slots__ = ("n", "a", "b", "indptr", "indices", "_nbr")

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        starts = np.asarray(starts, np.int64)
        ends = np.asarray(ends, np.int64)
        n = len(starts)
        self.n = n
        self.a, self.b = interfering_pairs(starts, ends)
        src = np.concatenate([self.a, self.b])
        dst = np.concatenate([self.b, self.a])
        by_src = np.argsort(src, kind="stable")
        self.indices = np.ascontiguousarray(dst[by_src], np.int64)
        self.indptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=self.indptr[1:])
        self._nbr: np.ndarray | None = None

    @property
    def width(self) -> np.ndarray:
        return np.diff(self.indptr) + 1

    @property
    def nbr(self) -> np.ndarray:
        if self._nbr is None:
            n, indptr = self.n, self.indptr
            degree = np.diff(indptr)
            nbr = np.full((n, int(degree.max(initial=0)) + 1), n, np.int64)
            rows = np.repeat(np.arange(n), degree)
            nbr[rows, np.arange(len(self.indices)) - indptr[rows]] = self.indices
            self._nbr = nbr
        return self._nbr


def fit(sizes: np.ndarray, order: np.ndarray, graph: Interference) -> tuple[np.ndarray, int]:
    """Best-fit in ``order``, vectorised: ``(offsets, peak)``, exactly ``best_fit(..., order)``.

    A block's place depends only on the blocks before it in the order that interfere with it.
    So the blocks are placed in rounds: a round takes every block whose earlier neighbours are all
    placed (no two of them interfere), and finds each one's best gap at once, row by row of a
    matrix of neighbours (sort by offset, running maximum of tops, smallest gap that fits). The
    rounds are the longest chain of interfering blocks in the order: 7-9 on the transformer,
    13-21 on the random DAG (``tie_ranks`` keeps equal sizes from chaining). ``sizes`` is int64
    with a total of at most 2**62; zero-size blocks get offset 0 and take no space.
    """
    n = graph.n
    if n == 0:
        return np.zeros(0, np.int64), 0
    active = sizes > 0
    rank = np.full(n + 1, -1, np.int64)  # -1: inactive, or the pad
    rank[order] = np.arange(n)
    rank[:n][~active] = -1
    ra, rb = rank[graph.a], rank[graph.b]
    later = np.where(ra < rb, graph.b, graph.a)[(ra >= 0) & (rb >= 0)]
    pending = np.bincount(later, minlength=n)  # earlier neighbours not yet placed
    pending[~active] = -1
    low = np.full(n + 1, _INF, np.int64)  # offset of each placed block, _INF while not placed
    high = np.zeros(n + 1, np.int64)      # its top, 0 while not placed
    nbr, width = graph.nbr, graph.width
    ready = np.flatnonzero(pending == 0)
    while ready.size:
        cols = int(width[ready].max())
        near = _place(ready, sizes, low, high, nbr, cols)
        pending[ready] = -1
        pending -= np.bincount(near[rank[near] > rank[ready][:, None]], minlength=n + 1)[:n]
        ready = np.flatnonzero(pending == 0)
    offsets = low[:n]
    offsets[~active] = 0
    return offsets, int(high.max())


def best_fit(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int],
             order: Sequence[int] | None = None) -> tuple[list[int], int]:
    """One best-fit pass in ``order`` (default: size-ordered): ``(offsets, peak)``.

    ``sizes`` are used as given (already aligned); zero-size blocks get offset 0 and no space.
    """
    n = len(sizes)
    offsets = [0] * n
    if n == 0:
        return offsets, 0
    if order is None:
        order = sorted(range(n), key=lambda i: (-sizes[i], starts[i], i))
    width = _BUCKET
    # Entries are (offset, top, start, end, index): sorting them sorts by offset, and the index
    # keeps entries of distinct blocks distinct when a set merges several buckets.
    buckets: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(max(ends) // width + 1)]
    peak = 0
    for i in order:
        size = sizes[i]
        if size <= 0:
            continue
        s = starts[i]
        e = ends[i]
        b0 = s // width
        b1 = e // width
        if b0 == b1:
            busy = [x for x in buckets[b0] if x[2] <= e and x[3] >= s]
        else:  # a block spanning several buckets is listed in each: the set drops the repeats
            busy = [x for x in set().union(*buckets[b0:b1 + 1]) if x[2] <= e and x[3] >= s]
        offset = 0
        if busy:
            busy.sort()
            best = -1
            best_waste = 0
            cursor = 0
            for lo, hi, _, _, _ in busy:
                if lo - cursor >= size:
                    waste = lo - cursor - size
                    if best < 0 or waste < best_waste:
                        best = cursor
                        best_waste = waste
                        if waste == 0:
                            break
                if hi > cursor:
                    cursor = hi
            offset = best if best >= 0 else cursor
        top = offset + size
        offsets[i] = offset
        if top > peak:
            peak = top
        entry = (offset, top, s, e, i)
        if b0 == b1:
            buckets[b0].append(entry)
        else:
            for b in range(b0, b1 + 1):
                buckets[b].append(entry)
    return offsets, peak


def _place(rows: np.ndarray, sizes: np.ndarray, low: np.ndarray, high: np.ndarray, nbr: np.ndarray,
           cols: int) -> np.ndarray:
    """Best-fit for blocks that do not interfere with one another, against the placed ones; returns
    their rows of neighbours (reordered)."""
    m = rows.size
    near = nbr[rows, :cols]
    by_offset = np.argsort(low[near], axis=1, kind="stable")  # stable: the faster kind for short rows
    by_offset += np.arange(0, m * cols, cols)[:, None]
    near = near.ravel()[by_offset]
    below = np.zeros((m, cols), np.int64)  # the top of everything placed below each gap
    np.maximum.accumulate(high[near[:, :-1]], axis=1, out=below[:, 1:])
    size = sizes[rows]
    # Free bytes from ``below`` up to the next placed block, minus the size: the waste of that
    # gap. Unplaced neighbours and pads sort last with offset _INF, so the first of them is the
    # space above all the placed ones, whose "waste" exceeds that of any real gap.
    waste = low[near] - below - size[:, None]
    waste[waste < 0] = _INF
    offsets = below[np.arange(m), waste.argmin(axis=1)]
    low[rows] = offsets
    high[rows] = offsets + size
    return near


def interfering_pairs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of blocks whose ranges share a position, as two index arrays (each pair once)."""
    order = np.lexsort((np.arange(len(starts)), starts))
    s_sorted = starts[order]
    # Blocks after i in start order that start no later than i ends interfere with i, and every
    # interfering pair is found this way from the one that starts first.
    hi = np.searchsorted(s_sorted, ends[order], side="right")
    lo = np.arange(1, len(order) + 1)
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    first = np.repeat(np.arange(len(order)), counts)
    steps = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    second = np.repeat(lo, counts) + steps
    return order[first], order[second]


class ReplayTemplate:
    """The stacking order of a finished plan, replayable with other sizes (see the module docstring).

    Replay sets each block's offset to the highest top among the blocks directly below it. The
    compiled pass walks the blocks in template-offset order (sorted once per template), which puts
    every block after all the blocks below it. The numpy pass goes level by level instead: level 0 holds the blocks with
    nothing below them, level k those whose highest lower neighbour is on level k-1, and each level
    is one gather, one ``maximum.reduceat`` and two scatters. Levels are recorded on the first
    numpy replay (never, when the compiled pass serves every replay).
    """

    __slots__ = ("n", "_graph", "_offsets", "_by_offset", "_levels", "_native")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 graph: Interference | None = None):
        """``offsets`` must be a valid plan of ``sizes`` (all positive) over the ranges; ``graph``: the
        blocks' ``Interference`` if the caller has it."""
        self.n = len(offsets)
        self._graph = graph if graph is not None else Interference(starts, ends)
        self._offsets = np.ascontiguousarray(offsets, np.int64)
        native = HELPERS.planner
        if native is not None:
            self._by_offset = np.empty(self.n, np.int64)
            native.stable_order(self._offsets, False, None, self._by_offset)
        else:
            self._by_offset = np.argsort(self._offsets, kind="stable")
        self._levels: tuple | None = None
        self._native = native

    @property
    def levels(self) -> tuple:
        """Per level above the ground: (its blocks, their lower neighbours, where each block's start)."""
        if self._levels is None:
            self._levels = self._record_levels()
        return self._levels

    def _record_levels(self) -> tuple:
        # Levels by rounds (Kahn): a round takes the blocks whose lower neighbours all have a level;
        # each one's lower neighbours are read from its row of the neighbour matrix.
        n, offsets, graph = self.n, self._offsets, self._graph
        if n == 0:
            return ()
        a, b, nbr, width = graph.a, graph.b, graph.nbr, graph.width
        offset = np.append(offsets, _INF)  # the pad counts as above everything, and is dropped
        pending = np.bincount(np.where(offsets[a] < offsets[b], b, a), minlength=n)  # lower neighbours
        levels = []
        ready = np.flatnonzero(pending == 0)  # level 0: nothing below
        ground = True
        while True:
            near = nbr[ready, :int(width[ready].max())]
            rise = offset[near] - offsets[ready][:, None]  # > 0: above the block, < 0: below it
            if not ground:  # each block's lower neighbours, grouped by block
                lower = rise < 0
                count = lower.sum(axis=1)
                levels.append((ready, near[lower], np.cumsum(count) - count))
            ground = False
            pending[ready] = -1
            pending -= np.bincount(near[rise > 0], minlength=n + 1)[:n]
            ready = np.flatnonzero(pending == 0)
            if not ready.size:
                break
        return tuple(levels)

    @classmethod
    def from_blocks(cls, starts: Sequence[int], ends: Sequence[int],
                    sizes: Sequence[int]) -> tuple["ReplayTemplate", list[int], int]:
        """Plan the blocks (``plan_blocks``) and record the plan's order: ``(template, offsets, peak)``.

        Empty blocks count as one unit here so that the template orders them too: a block empty
        at the template's key may be large at another.
        """
        unit = min((s for s in sizes if s > 0), default=1)
        padded = [s if s > 0 else unit for s in sizes]
        offsets, peak = plan_blocks(starts, ends, padded)
        template = cls(np.asarray(starts, np.int64), np.asarray(ends, np.int64), np.asarray(offsets, np.int64),
                       np.asarray(padded, np.int64))
        return template, offsets, peak

    def replay(self, sizes: np.ndarray) -> tuple[np.ndarray, int]:
        """Offsets (int64 array) and peak for ``sizes`` (aligned, an int64 array of ``n`` blocks)."""
        if self.n == 0:
            return np.zeros(0, np.int64), 0
        native = self._native
        if native is not None:
            offsets = np.empty(self.n, np.int64)
            try:
                peak = native.replay(self._graph.indptr, self._graph.indices, _i64(sizes), self._offsets,
                                     self._by_offset, offsets)
            except native.SizeError:
                pass  # negative sizes or a total over 2**62: level by level below
            else:
                return offsets, peak
        offsets = np.zeros(self.n, np.int64)
        tops = sizes.copy()
        for nodes, src, seg in self.levels:
            low = np.maximum.reduceat(tops[src], seg)
            offsets[nodes] = low
            tops[nodes] = low + sizes[nodes]
        return offsets, int(tops.max())
