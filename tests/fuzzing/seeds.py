"""The valid bundles every case starts from, with the input and the output a run must give.

Seeds are built in-process, so the fuzzer needs no files: the demo MLP (elf-so and C source
binaries, in-place kernels, a workspace, a dispatch table), a graph of C sources only with two
symbols, a graph-level ``share_map`` and a symbolic workspace, and a graph over two device kinds
(builtin copies to and from the test-only ``hostdev`` kind). Members are plain bytes so mutators
can edit them; the manifest is written later, by ``craft``.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from engine.build import GraphBuilder
from engine.bundle.dispatch_text import format_dispatch_table
from engine.demo.mlp import build_mlp
from engine.plugins import Registry

__all__ = ["Seed", "build_seeds", "SEED_NAMES"]


@attrs.frozen
class Seed:
    """A valid bundle's members (manifest excluded) and how to run it."""

    name: str
    members: dict[str, bytes]
    #: Fresh inputs for one run (a new copy each call: in-place graphs write into their inputs).
    make_inputs: Callable[[], list[np.ndarray]]
    #: Filled in by the worker after loading the pristine seed.
    expected: list[np.ndarray] = attrs.field(factory=list)


def _joined(members: dict[str, object]) -> dict[str, bytes]:
    """Builder members (bytes or chunk lists) as plain bytes."""
    out = {}
    for name, data in members.items():
        if isinstance(data, (bytes, bytearray, memoryview)):
            out[name] = bytes(data)
        else:
            out[name] = b"".join(bytes(memoryview(c).cast("B")) for c in data)
    return out


def _with_dispatch_table(members: dict[str, bytes], symbols: list[str], key: tuple[int, ...]) -> dict[str, bytes]:
    """Add a table row at ``key`` choosing every task's last candidate, plus one at another key."""
    import json

    counts = []
    k = 0
    while f"kernels/{k}/meta.json" in members:
        meta = json.loads(members[f"kernels/{k}/meta.json"])
        counts.append(max(len(meta.get("candidates") or []), 1))
        k += 1
    rows = {key: tuple(c - 1 for c in counts), tuple(v + 7 for v in key): tuple(0 for _ in counts)}
    members = dict(members)
    members["dispatch_table.txt"] = format_dispatch_table(symbols, rows).encode()
    return members


def _mlp(registry: Registry) -> Seed:
    members = _joined(build_mlp(registry=registry).members())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    return Seed("mlp", _with_dispatch_table(members, ["batch"], (2,)), lambda: [x.copy()])


_INPLACE_SOURCE = r"""
#include <stdint.h>
/* y = 2 * x, in place over the graph input (share_map {0: 0}). */
int32_t scale_ip(void *const *t, const int64_t *sym, void *ws) {
    float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0] * sym[1]; i++) y[i] = 2.0f * x[i];
    return 0;
}
/* z = x + b[j], through the workspace (n * m floats); two candidates, same result. */
int32_t add_ws_a(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *b = t[1]; float *z = t[2]; float *tmp = ws;
    int64_t n = sym[0], m = sym[1];
    for (int64_t i = 0; i < n * m; i++) tmp[i] = x[i] + b[i % m];
    for (int64_t i = 0; i < n * m; i++) z[i] = tmp[i];
    return 0;
}
int32_t add_ws_b(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *b = t[1]; float *z = t[2]; float *tmp = ws;
    int64_t n = sym[0], m = sym[1];
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < m; c++) tmp[r * m + c] = x[r * m + c] + b[c];
    for (int64_t i = 0; i < n * m; i++) z[i] = tmp[i];
    return 0;
}
"""


def _c_kernel(b: GraphBuilder, name: str, entries: list[str], device: str = "cpu"):
    """A kernel shipped as C source only: nothing compiler-specific in the bundle."""
    return b.kernel(name, device=device, entries=entries,
                    binaries=[{"format": "c-source", "target": "any", "path": f"{name}.c",
                               "data": _INPLACE_SOURCE.encode()}])


def _inplace(registry: Registry) -> Seed:
    b = GraphBuilder("inplace", registry=registry)
    x = b.input("x", "float32", ["n", "m"])
    bias = b.weight("b", np.arange(4, dtype=np.float32) - 1.5)
    (y,) = b.call(_c_kernel(b, "scale", ["scale_ip"]), [x], [("float32", ["n", "m"])], symbols=["n", "m"],
                  share_map={0: 0})
    (z,) = b.call(_c_kernel(b, "add_ws", ["add_ws_a", "add_ws_b"]), [y, bias], [("float32", ["n", "m"])],
                  symbols=["n", "m"], workspace="n * m * 4")
    b.output(y, "scaled")
    b.output(z, "shifted")
    members = _with_dispatch_table(_joined(b.members()), ["n", "m"], (3, 4))
    x0 = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return Seed("inplace", members, lambda: [x0.copy()])


def _twokind(registry: Registry) -> Seed:
    b = GraphBuilder("twokind", registry=registry)
    x = b.input("x", "float32", ["n", "m"])
    bias = b.weight("b", np.full(4, 0.25, dtype=np.float32), device="hostdev")
    xd = b.copy(x, "hostdev")
    (z,) = b.call(_c_kernel(b, "add_ws", ["add_ws_a", "add_ws_b"], device="hostdev"), [xd, bias],
                  [("float32", ["n", "m"])], symbols=["n", "m"], workspace="n * m * 4")
    b.output(b.copy(z, "cpu"), "z")
    x0 = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
    return Seed("twokind", _joined(b.members()), lambda: [x0.copy()])


_BUILDERS = {"mlp": _mlp, "inplace": _inplace, "twokind": _twokind}
SEED_NAMES = tuple(_BUILDERS)


def build_seeds(registry: Registry) -> dict[str, Seed]:
    return {name: build(registry) for name, build in _BUILDERS.items()}
