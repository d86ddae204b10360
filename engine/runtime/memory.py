"""Offset assignment for tensors that live in a workspace slot.

Each item is a block of bytes live over an inclusive range of instruction positions. Items are
placed largest first, each at the lowest-waste gap among blocks that overlap it in time
(size-ordered best-fit). Large blocks placed first leave small ones to fill the holes between them,
which keeps the peak close to the largest total of simultaneously live bytes (the lower bound).
"""

from __future__ import annotations

from typing import Sequence

import attrs

__all__ = ["Block", "MemoryPlan", "plan_offsets", "lower_bound"]


@attrs.frozen
class Block:
    start: int
    end: int      # inclusive
    nbytes: int


@attrs.frozen
class MemoryPlan:
    offsets: tuple[int, ...]
    total_bytes: int


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_offsets(blocks: Sequence[Block], alignment: int) -> MemoryPlan:
    order = sorted(range(len(blocks)), key=lambda i: (-blocks[i].nbytes, blocks[i].start, i))
    offsets = [0] * len(blocks)
    placed: list[int] = []
    total = 0
    for i in order:
        block = blocks[i]
        size = _align(max(block.nbytes, 1), alignment)
        busy = sorted(
            (offsets[j], offsets[j] + _align(max(blocks[j].nbytes, 1), alignment))
            for j in placed
            if blocks[j].start <= block.end and block.start <= blocks[j].end
        )
        best, best_waste, cursor = None, None, 0
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best_waste is None or gap - size < best_waste):
                best, best_waste = cursor, gap - size
            cursor = max(cursor, hi)
        offsets[i] = best if best is not None else cursor
        placed.append(i)
        total = max(total, offsets[i] + size)
    return MemoryPlan(tuple(offsets), total)


def lower_bound(blocks: Sequence[Block], alignment: int = 1) -> int:
    """Largest total of simultaneously live (aligned) bytes: no plan can need less."""
    events: dict[int, int] = {}
    for b in blocks:
        size = _align(max(b.nbytes, 1), alignment) if b.nbytes else 0
        events[b.start] = events.get(b.start, 0) + size
        events[b.end + 1] = events.get(b.end + 1, 0) - size
    live = peak = 0
    for pos in sorted(events):
        live += events[pos]
        peak = max(peak, live)
    return peak
