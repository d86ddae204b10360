"""Offset assignment for the blocks that live in one workspace slot (DESIGN §6, issue 3).

A *block* is a number of bytes live over an inclusive range of instruction positions: an
intermediate tensor (with every tensor written in place over it), or a kernel's scratch, live only
during its instruction. Two blocks *interfere* when their ranges share a position; interfering
blocks must not share a byte. The planner gives every block an offset so that the workspace (the
largest ``offset + size``) is small. No plan can need less than the **lower bound**: the largest
total of bytes live at one position (``live_peak``).

**Size-ordered best-fit** (``best_fit``). Blocks are taken largest first (ties: earlier start, then
index: the result is deterministic). Each goes into the gap, among the already placed blocks that
interfere with it, that wastes the fewest bytes (the lowest such gap on a tie), or on top of them
when no gap is big enough. Why this order and rule: a large block placed late finds no hole and
lands on top, raising the peak by its whole size; placed first, the large blocks settle at the
bottom and the many small ones fill the holes between them, where best-fit (rather than
first-fit) keeps the large holes for the blocks that need them. Placing in execution order instead
(the reference runtime's first-fit arena) cannot know that a small tensor allocated now will sit
under a large one allocated later, and fragments (``docs/memory.md`` has the figures).

**Refinement** (``plan_blocks``). Greedy orders sometimes strand a block on top of others that
interfere with it at different times, above the lower bound. When that happens the blocks that
reach the peak are moved to the front of the order and best-fit runs again (a "squeaky wheel"
search), a few rounds from the size order and a few from an order by size x lifetime; the lowest
peak wins. It stops as soon as a plan meets the lower bound, which on real model topologies is the
first one. Over 100 random DAGs this took the worst ratio from 1.29 to 1.02
(``benchmarks/planner.py``).

Overlap queries use a bucketed time axis: a placed block is listed in every bucket of ``_BUCKET``
positions its range touches, so a query reads the buckets of its own range instead of every placed
block (the quadratic scan this replaced took 68 ms for a 1,000-instruction plan).

**Replay** (``ReplayTemplate``). A graph with symbols is planned for every new dispatch key, and
best-fit costs milliseconds for a 1,000-instruction plan in Python. But its *decisions* carry over
from key to key: in a finished plan every pair of interfering blocks is ordered (one lies wholly
below the other), and recomputing each block's offset as the highest top among the blocks below it,
with another key's sizes, gives a valid plan for *any* sizes. ``ReplayTemplate`` records that order
once and replays it level by level with numpy. With the template's own sizes the replay reproduces
the plan exactly; when all sizes scale alike it reproduces it scaled. Callers compare the replayed
peak with the key's lower bound and fall back to ``plan_blocks`` when it is not good enough
(``engine.runtime.plan``).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

__all__ = ["Block", "MemoryPlan", "plan_offsets", "lower_bound", "align_up", "best_fit", "plan_blocks",
           "live_peak", "ReplayTemplate"]

# Positions per bucket of the overlap index. Most intermediates live for a few instructions, so a
# query reads one or two buckets; 8 measured fastest on the 1,000-instruction benchmark plans.
_BUCKET = 8
#: Best-fit rounds per starting order in ``plan_blocks`` (the first one included).
REFINE_ROUNDS = 8


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


def live_peak(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> int:
    """The lower bound from int64 arrays: the largest sum of ``sizes`` over blocks live at one position."""
    if len(sizes) == 0:
        return 0
    delta = np.zeros(int(ends.max()) + 2, np.int64)
    np.add.at(delta, starts, sizes)
    np.add.at(delta, ends + 1, -sizes)
    return int(np.cumsum(delta).max())


def plan_blocks(starts: Sequence[int], ends: Sequence[int], sizes: Sequence[int], bound: int | None = None,
                target: int | None = None, rounds: int = REFINE_ROUNDS) -> tuple[list[int], int]:
    """Best-fit with refinement (module docstring): ``(offsets, peak)``, sizes used as given.

    ``bound`` is the lower bound if the caller has it (computed otherwise). Refinement stops at
    the first plan whose peak is at most ``target`` (default: the bound).
    """
    n = len(sizes)
    if bound is None:
        bound = live_peak(np.asarray(starts, np.int64), np.asarray(ends, np.int64), np.asarray(sizes, np.int64))
    if target is None:
        target = bound
    first = sorted(range(n), key=lambda i: (-sizes[i], starts[i], i))
    best_offsets, best_peak = best_fit(starts, ends, sizes, first)
    if best_peak <= target:
        return best_offsets, best_peak
    by_area = sorted(range(n), key=lambda i: (-sizes[i] * (ends[i] - starts[i] + 1), starts[i], i))
    starts_from: list[tuple[list[int], list[int] | None, int]] = [(first, best_offsets, best_peak), (by_area, None, 0)]
    for order, offsets, peak in starts_from:
        for _ in range(rounds - (offsets is not None)):
            if offsets is not None:
                # Squeaky wheel: the blocks that reach the peak go first next time.
                hot = [i for i in order if offsets[i] + sizes[i] == peak]
                hot_set = set(hot)
                order = hot + [i for i in order if i not in hot_set]
            offsets, peak = best_fit(starts, ends, sizes, order)
            if peak < best_peak:
                best_offsets, best_peak = offsets, peak
                if peak <= target:
                    return best_offsets, best_peak
    return best_offsets, best_peak


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

    Replay sets each block's offset to the highest top among the blocks directly below it, level by
    level: level 0 holds the blocks with nothing below them, level k those whose highest lower
    neighbour is on level k-1. Each level is one gather, one ``maximum.reduceat`` and two scatters.
    """

    __slots__ = ("n", "levels")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
        """``offsets`` must be a valid plan of ``sizes`` (all positive) over the ranges."""
        n = len(offsets)
        self.n = n
        a, b = interfering_pairs(starts, ends)
        lower = np.where(offsets[a] < offsets[b], a, b)
        upper = np.where(offsets[a] < offsets[b], b, a)
        by_upper = np.lexsort((lower, upper))
        lower, upper = lower[by_upper], upper[by_upper]
        first_edge = np.searchsorted(upper, np.arange(n + 1))
        # Offsets order the blocks topologically: a lower neighbour has a strictly smaller offset.
        level = np.zeros(n, np.int64)
        lower_list = lower.tolist()
        bounds = first_edge.tolist()
        level_list = level.tolist()
        for i in np.lexsort((np.arange(n), offsets)).tolist():
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                level_list[i] = 1 + max([level_list[j] for j in lower_list[lo:hi]])
        level = np.array(level_list, np.int64)
        levels = []
        for k in range(1, int(level.max()) + 1 if n else 1):
            nodes = np.flatnonzero(level == k)
            counts = first_edge[nodes + 1] - first_edge[nodes]
            src = lower[np.concatenate([np.arange(first_edge[i], first_edge[i + 1]) for i in nodes])]
            seg = np.cumsum(counts) - counts
            levels.append((nodes, src, seg))
        self.levels = tuple(levels)

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
        offsets = np.zeros(self.n, np.int64)
        tops = sizes.copy()
        for nodes, src, seg in self.levels:
            low = np.maximum.reduceat(tops[src], seg)
            offsets[nodes] = low
            tops[nodes] = low + sizes[nodes]
        return offsets, int(tops.max())
