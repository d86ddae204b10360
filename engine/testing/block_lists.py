"""Block lists for memory-planner tests and benchmarks: realistic topologies and random DAGs.

A block is one intermediate tensor or kernel scratch, live over an inclusive instruction range
(``engine.runtime.memory.Block``). The topologies (a chain, fork-joins, a transformer, ResNet-50,
U-Net) carry realistic sizes; ``random_blocks`` draws DAGs from a seed. ``check_plan`` is the
independent check every plan must pass (no two interfering blocks share a byte, every offset
aligned), and ``first_fit_128`` is the reference runtime's planner, reimplemented for comparison
only. Shared by tests/ and benchmarks/planner.py, so both plan and check the same lists.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

from engine.runtime.memory import Block, align_up

__all__ = ["F32", "first_fit_128", "check_plan", "Net", "chain", "diamonds", "transformer", "resnet50", "unet",
           "random_blocks", "TOPOLOGIES"]

#: Bytes of a float32 element.
F32 = 4


# -- the reference runtime's planner (comparison only) --------------------------------------------
def first_fit_128(blocks: Sequence[Block]) -> tuple[list[int], int]:
    """First-fit in execution order over one arena, sizes rounded up to 128 bytes.

    At each position the blocks that died before it are returned to the free list (adjacent free
    ranges merged), then the blocks born there are given, in index order, the lowest free range
    that fits, or the end of the arena.
    """
    sizes = [align_up(max(b.nbytes, 1), 128) for b in blocks]
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].start, i))
    by_end = sorted(range(len(blocks)), key=lambda i: blocks[i].end)
    offsets = [0] * len(blocks)
    free: list[list[int]] = []  # [offset, size], sorted by offset
    arena = 0
    k = 0
    for i in order:
        start = blocks[i].start
        while k < len(by_end) and blocks[by_end[k]].end < start:
            j = by_end[k]
            k += 1
            if offsets[j] >= 0 and blocks[j].start < start:
                _release(free, offsets[j], sizes[j])
        for r in free:
            if r[1] >= sizes[i]:
                offsets[i] = r[0]
                r[0] += sizes[i]
                r[1] -= sizes[i]
                if r[1] == 0:
                    free.remove(r)
                break
        else:
            if free and free[-1][0] + free[-1][1] == arena:  # grow the free tail instead of skipping it
                offsets[i] = free.pop()[0]
                arena = offsets[i] + sizes[i]
            else:
                offsets[i] = arena
                arena += sizes[i]
    return offsets, arena


def _release(free: list[list[int]], offset: int, size: int) -> None:
    free.append([offset, size])
    free.sort()
    merged: list[list[int]] = []
    for r in free:
        if merged and merged[-1][0] + merged[-1][1] == r[0]:
            merged[-1][1] += r[1]
        else:
            merged.append(r)
    free[:] = merged


def check_plan(blocks: Sequence[Block], offsets: Sequence[int], total: int, alignment: int) -> None:
    """Independent check: aligned offsets inside ``total``; interfering blocks never share a byte."""
    events = sorted(range(len(blocks)), key=lambda i: blocks[i].start)
    live: list[int] = []
    for i in events:
        b = blocks[i]
        if offsets[i] % alignment:
            raise AssertionError(f"block {i} at offset {offsets[i]} is not {alignment}-aligned")
        if offsets[i] < 0 or offsets[i] + b.nbytes > total:
            raise AssertionError(f"block {i} [{offsets[i]}, +{b.nbytes}) lies outside the {total}-byte workspace")
        live = [j for j in live if blocks[j].end >= b.start]
        if b.nbytes:
            for j in live:
                if offsets[j] < offsets[i] + b.nbytes and offsets[i] < offsets[j] + blocks[j].nbytes:
                    raise AssertionError(f"blocks {j} {blocks[j]} and {i} {b} are live together and overlap "
                                         f"at offsets {offsets[j]} and {offsets[i]}")
            live.append(i)


# -- topologies as block lists --------------------------------------------------------------------
class Net:
    """A tiny program builder: ops read tensors and write new ones; liveness gives the blocks.

    Tensors written in place share their input's block (it lives until the last use of either).
    Graph inputs and outputs are not planned (they are the caller's and fresh buffers).
    """

    def __init__(self) -> None:
        self.size: list[int] = []
        self.root: list[int] = []
        self.producer: list[int] = []
        self.last: list[int] = []
        self.scratch: list[tuple[int, int]] = []
        self.n_ops = 0
        self.outputs: set[int] = set()

    def input(self, nbytes: int) -> int:
        return self._tensor(nbytes, -1)

    def _tensor(self, nbytes: int, producer: int) -> int:
        self.size.append(nbytes)
        self.root.append(len(self.size) - 1)
        self.producer.append(producer)
        self.last.append(producer)
        return len(self.size) - 1

    def op(self, inputs: Sequence[int], outputs: Sequence[int], *, scratch: int = 0,
           in_place: bool = False) -> list[int]:
        pos = self.n_ops
        self.n_ops += 1
        for t in inputs:
            self.last[t] = pos
        outs = [self._tensor(n, pos) for n in outputs]
        if in_place:
            self.root[outs[0]] = self.root[inputs[0]]
        if scratch:
            self.scratch.append((pos, scratch))
        return outs

    def op1(self, inputs: Sequence[int], nbytes: int, **kw: Any) -> int:
        return self.op(inputs, [nbytes], **kw)[0]

    def blocks(self) -> list[Block]:
        groups: dict[int, list[int]] = {}
        for t, r in enumerate(self.root):
            groups.setdefault(r, []).append(t)
        out = []
        for r, members in groups.items():
            if self.producer[r] < 0 or any(m in self.outputs for m in members):
                continue
            out.append(Block(self.producer[r], max(self.last[m] for m in members), self.size[r]))
        out.extend(Block(pos, pos, n) for pos, n in self.scratch)
        return out


def chain(n: int = 1000, seed: int = 1) -> list[Block]:
    """A long chain: every op reads the previous tensor (sizes 4 KiB..4 MiB, some scratch)."""
    rng = random.Random(seed)
    net = Net()
    x = net.input(1 << 20)
    for _ in range(n):
        x = net.op1([x], rng.choice([4, 16, 64, 256, 1024, 4096]) << 10,
                    scratch=rng.choice([0, 0, 64 << 10, 1 << 20]))
    net.outputs.add(x)
    return net.blocks()


def diamonds(n: int = 300, seed: int = 2) -> list[Block]:
    """Diamonds and wider fork-joins (2-4 branches of unequal sizes, some two ops deep), stacked."""
    rng = random.Random(seed)
    net = Net()
    x = net.input(1 << 20)
    for _ in range(n):
        width = rng.choice([2, 2, 3, 4])
        branches = []
        for _ in range(width):
            b = net.op1([x], rng.choice([64, 256, 512, 1024, 2048]) << 10, scratch=rng.choice([0, 128 << 10]))
            if rng.random() < 0.4:
                b = net.op1([b], rng.choice([64, 512, 1024]) << 10)
            branches.append(b)
        x = net.op1(branches, rng.choice([256, 1024, 2048]) << 10)
    net.outputs.add(x)
    return net.blocks()


def transformer(layers: int = 12, batch: int = 8, seq: int = 512, d: int = 768, heads: int = 12,
                ff: int = 3072) -> list[Block]:
    """A BERT-base-like encoder (fp32): attention with separate q, k, v projections, softmax in place
    over [batch, heads, seq, seq] scores, residuals, layer norms and an MLP with GELU in place;
    matrix multiplications use a 1 MiB packing scratch, layer norms a per-row scratch."""
    net = Net()
    tok = batch * seq
    act = tok * d * F32
    x = net.input(act)
    pack = 1 << 20
    for _ in range(layers):
        h = net.op1([x], act, scratch=tok * 2 * F32)
        q = net.op1([h], act, scratch=pack)
        k = net.op1([h], act, scratch=pack)
        v = net.op1([h], act, scratch=pack)
        s = net.op1([q, k], batch * heads * seq * seq * F32, scratch=pack)
        p = net.op1([s], batch * heads * seq * seq * F32, in_place=True, scratch=tok * heads * F32)
        c = net.op1([p, v], act, scratch=pack)
        o = net.op1([c], act, scratch=pack)
        x1 = net.op1([x, o], act)
        h2 = net.op1([x1], act, scratch=tok * 2 * F32)
        u = net.op1([h2], tok * ff * F32, scratch=pack)
        g = net.op1([u], tok * ff * F32, in_place=True)
        dn = net.op1([g], act, scratch=pack)
        x = net.op1([x1, dn], act)
    net.outputs.add(x)
    return net.blocks()


def resnet50(batch: int = 8, image: int = 224) -> list[Block]:
    """ResNet-50 (fp32, NCHW, batch norm folded into the convolutions): stem, 3-4-6-3 bottlenecks with
    projection shortcuts, add and ReLU in place, global pooling and the classifier. 3x3 and 7x7
    convolutions use an im2col scratch for one image."""
    net = Net()

    def conv(x: int, c_in: int, c_out: int, hw: int, k: int, stride: int = 1) -> tuple[int, int]:
        out_hw = hw // stride
        col = c_in * k * k * out_hw * out_hw * F32 if k > 1 or stride > 1 else 0
        return net.op1([x], batch * c_out * out_hw * out_hw * F32, scratch=col), out_hw

    x = net.input(batch * 3 * image * image * F32)
    x, hw = conv(x, 3, 64, image, 7, 2)
    hw //= 2
    x = net.op1([x], batch * 64 * hw * hw * F32)  # max pool
    c_in = 64
    for stage, (blocks, mid) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            a, _ = conv(x, c_in, mid, hw, 1)
            b, out_hw = conv(a, mid, mid, hw, 3, stride)
            c, _ = conv(b, mid, mid * 4, out_hw, 1)
            if i == 0:
                shortcut, _ = conv(x, c_in, mid * 4, hw, 1, stride)
            else:
                shortcut = x
            y = net.op1([c, shortcut], batch * mid * 4 * out_hw * out_hw * F32, in_place=True)
            x = net.op1([y], batch * mid * 4 * out_hw * out_hw * F32, in_place=True)  # relu
            c_in, hw = mid * 4, out_hw
    x = net.op1([x], batch * c_in * F32)  # global average pool
    x = net.op1([x], batch * 1000 * F32)  # classifier
    net.outputs.add(x)
    return net.blocks()


def unet(batch: int = 4, image: int = 256, base: int = 32, depth: int = 4) -> list[Block]:
    """A U-Net: the encoder's outputs stay live until the decoder level that concatenates them."""
    net = Net()
    x = net.input(batch * 3 * image * image * F32)
    skips = []
    hw, c = image, base
    for _ in range(depth):
        x = net.op1([x], batch * c * hw * hw * F32, scratch=c * 9 * hw * hw * F32)
        x = net.op1([x], batch * c * hw * hw * F32, scratch=c * 9 * hw * hw * F32)
        skips.append((x, c, hw))
        hw //= 2
        x = net.op1([x], batch * c * hw * hw * F32)
        c *= 2
    x = net.op1([x], batch * c * hw * hw * F32, scratch=c * 9 * hw * hw * F32)
    for skip, sc, shw in reversed(skips):
        up = net.op1([x], batch * sc * shw * shw * F32)
        x = net.op1([up, skip], batch * 2 * sc * shw * shw * F32)  # concat
        x = net.op1([x], batch * sc * shw * shw * F32, scratch=2 * sc * 9 * shw * shw * F32)
    x = net.op1([x], batch * 2 * image * image * F32)
    net.outputs.add(x)
    return net.blocks()


def random_blocks(seed: int, n_ops: int | None = None) -> list[Block]:
    """A random DAG: each op reads 1-3 live tensors (mostly recent ones, sometimes old ones, which
    makes long lives), writes 1-2 (sometimes the first in place), maybe with scratch. Sizes are
    log-uniform from 64 B to 4 MiB, odd byte counts included."""
    rng = random.Random(seed)
    n_ops = n_ops if n_ops is not None else rng.randint(10, 200)
    net = Net()
    live = [net.input(rng.randint(1, 1 << 16)) for _ in range(rng.randint(1, 3))]
    consumed: set[int] = set()

    def size() -> int:
        return int(math.exp(rng.uniform(math.log(64), math.log(4 << 20)))) + rng.randint(0, 63)

    for _ in range(n_ops):
        pool = [t for t in live if t not in consumed]
        k = min(len(pool), rng.randint(1, 3))
        ins = [pool[-1 - min(int(rng.expovariate(0.4)), len(pool) - 1)] for _ in range(k)]
        in_place = rng.random() < 0.2 and net.producer[ins[0]] >= 0
        if in_place:
            outs = net.op(ins, [net.size[ins[0]]], in_place=True, scratch=size() if rng.random() < 0.4 else 0)
            consumed.add(ins[0])
        else:
            outs = net.op(ins, [size() for _ in range(rng.randint(1, 2))],
                          scratch=size() if rng.random() < 0.4 else 0)
        live.extend(outs)
    pool = [t for t in live if t not in consumed and net.producer[t] >= 0]
    net.outputs.update(pool[-rng.randint(1, 3):])
    return net.blocks()


TOPOLOGIES: dict[str, Callable[[], list[Block]]] = {
    "chain (1000 ops)": chain,
    "diamonds (300 fork-joins)": diamonds,
    "transformer (BERT-base, b8 s512)": transformer,
    "resnet-50 (b8 224x224)": resnet50,
    "u-net (b4 256x256)": unet,
}
