"""Random DAG graphs of real C kernels, with their numpy reference: planner and runtime tests.

``random_dag`` draws a program from a seed (tensors whose shapes are expressions over one or two
symbols, ops with in-place outputs and garbage-filled scratch, optionally on several device kinds);
``build_dag`` turns it into a ``GraphBuilder`` of compiled C kernels; ``reference`` computes what
the graph must return with numpy. ``transformer_bundle`` is a large transformer-shaped bundle of
no-op kernels, for planning only. Shared by tests/ and benchmarks/planner.py.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np

__all__ = ["C_TYPES", "TensorSpec", "OpSpec", "DagSpec", "random_dag", "kernel_source", "NOOP_SOURCE", "build_dag",
           "eval_dim", "shape_at", "random_inputs", "reference", "transformer_bundle"]


# -- random DAG graphs of real C kernels ----------------------------------------------------------
# Each op combines 1-3 inputs elementwise into 1-2 outputs (uint8 or uint32, wrapping arithmetic, so
# results are exact): out_j[i] = k_j + sum_a c_ja * in_a[i % len(in_a)]. Some ops write their output
# in place over their first input; many have a scratch workspace which the kernel first fills with
# garbage bytes and then uses to stage its first output. Shapes and scratch sizes are expressions
# over one or two symbols (ceil_div, min, max, //; some can be zero). With several device kinds, ops
# run on a random kind and builtin copies move their inputs there.

C_TYPES = {"uint8": "uint8_t", "uint32": "uint32_t"}
_SHAPES_N = (["{c}"], ["n", "{c}"], ["ceil_div(n, 3)", "{c}"], ["n + 5"], ["max(n - 4, 0)", "{c}"],
             ["min(n, 7)", "{c}"], ["n // 2", "3"])
_SHAPES_M = (["n", "m"], ["m", "{c}"], ["n * m"], ["max(m - n, 0)", "2"])
_SCRATCH = ("{c}", "n * 64", "ceil_div(n * {m}, 3) * 4 + 1", "max(n - 10, 0) * 128", "{c} * 4 + n")


class TensorSpec:
    __slots__ = ("dtype", "shape", "device")

    def __init__(self, dtype: str, shape: Sequence[str], device: str):
        self.dtype, self.shape, self.device = dtype, tuple(shape), device


class OpSpec:
    __slots__ = ("device", "inputs", "outputs", "in_place", "scratch", "coefs", "seed", "copy")

    def __init__(self, device: str, inputs: Sequence[int], outputs: Sequence[int], *, in_place: bool = False,
                 scratch: str = "0", coefs: Sequence[tuple[int, ...]] = (), seed: int = 0, copy: bool = False):
        self.device, self.inputs, self.outputs = device, tuple(inputs), tuple(outputs)
        self.in_place, self.scratch, self.coefs, self.seed, self.copy = in_place, scratch, tuple(coefs), seed, copy


class DagSpec:
    """A random program: tensors (inputs, then weights, then op outputs in order, as the builder numbers
    them), ops and graph outputs."""

    def __init__(self, symbols: tuple[str, ...]):
        self.symbols = symbols
        self.tensors: list[TensorSpec] = []
        self.n_inputs = 0
        self.weights: list[np.ndarray] = []
        self.ops: list[OpSpec] = []
        self.outputs: list[int] = []

    def add(self, dtype: str, shape: Sequence[str], device: str) -> int:
        self.tensors.append(TensorSpec(dtype, shape, device))
        return len(self.tensors) - 1


def random_dag(seed: int, n_ops: int | None = None, kinds: Sequence[str] = ("cpu",)) -> DagSpec:
    rng = random.Random(seed)
    symbols = ("n", "m") if rng.random() < 0.5 else ("n",)
    spec = DagSpec(symbols)
    n_ops = n_ops if n_ops is not None else rng.randint(3, 24)
    spec.add(rng.choice(list(C_TYPES)), ["n", str(rng.randint(1, 5))], "cpu")
    if "m" in symbols:
        spec.add(rng.choice(list(C_TYPES)), rng.choice([["m"], ["m", "3"]]), "cpu")
    if rng.random() < 0.5:
        spec.add(rng.choice(list(C_TYPES)), [str(rng.randint(1, 40))], "cpu")
    spec.n_inputs = len(spec.tensors)
    for _ in range(rng.randint(0, 2)):
        dtype = rng.choice(list(C_TYPES))
        c = rng.randint(1, 50)
        spec.weights.append(np.array([rng.randrange(256) for _ in range(c)], dtype))
        spec.add(dtype, [str(c)], "cpu")
    pool = list(range(len(spec.tensors)))
    copies: dict[tuple[int, str], int] = {}

    def shape() -> list[str]:
        menu = _SHAPES_N + (_SHAPES_M if "m" in symbols else ())
        return [d.format(c=rng.randint(1, 40)) for d in rng.choice(menu)]

    def on(t: int, device: str) -> int:
        if spec.tensors[t].device == device:
            return t
        if (t, device) not in copies:
            src = spec.tensors[t]
            out = spec.add(src.dtype, src.shape, device)
            spec.ops.append(OpSpec(device, [t], [out], copy=True))
            copies[(t, device)] = out
            pool.append(out)
        return copies[(t, device)]

    def scratch() -> str:
        return rng.choice(_SCRATCH).format(c=rng.randint(1, 3000), m="m" if "m" in symbols else "2")

    for _ in range(n_ops):
        device = rng.choice(list(kinds))
        k = rng.randint(1, 3)
        ins = [on(pool[-1 - min(int(rng.expovariate(0.35)), len(pool) - 1)], device) for _ in range(k)]
        first = ins[0]
        can_write = first >= spec.n_inputs + len(spec.weights) or (first < spec.n_inputs and rng.random() < 0.3)
        in_place = can_write and rng.random() < 0.3
        if in_place:
            outs = [spec.add(spec.tensors[first].dtype, spec.tensors[first].shape, device)]
            pool.remove(first)
            for key in [key for key, v in copies.items() if v == first]:
                del copies[key]
        else:
            outs = [spec.add(rng.choice(list(C_TYPES)), shape(), device) for _ in range(rng.randint(1, 2))]
        coefs = [tuple(rng.randint(1, 9) for _ in range(3)) + (rng.randrange(256),) for _ in outs]
        spec.ops.append(OpSpec(device, ins, outs, in_place=in_place, coefs=coefs, seed=rng.randrange(1 << 31),
                               scratch=scratch() if rng.random() < 0.6 else "0"))
        pool.extend(outs)
    fixed = spec.n_inputs + len(spec.weights)
    made = [t for t in pool if t >= fixed]
    spec.outputs = made[-rng.randint(1, min(3, len(made))):] if made else []
    extra = [t for t in pool if t < spec.n_inputs]
    if extra and rng.random() < 0.15:  # an input returned unchanged (copied into a fresh output)
        spec.outputs.append(rng.choice(extra))
    if not spec.outputs:
        spec.outputs = [pool[-1]]
    return spec


def _c_expr(expr: str) -> str:
    return (expr.replace("ceil_div(", "CEIL_DIV(").replace("min(", "MIN(").replace("max(", "MAX(")
            .replace("//", "/"))


def _elements_c(shape: Sequence[str]) -> str:
    return " * ".join(f"(int64_t)({_c_expr(d)})" for d in shape) or "1"


def kernel_source(spec: DagSpec) -> str:
    """One C file with an entry ``op<k>`` per (non-copy) op."""
    lines = ["#include <stdint.h>",
             "#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))",
             "#define MIN(a, b) ((a) < (b) ? (a) : (b))",
             "#define MAX(a, b) ((a) > (b) ? (a) : (b))"]
    for k, op in enumerate(spec.ops):
        if op.copy:
            continue
        body = [f"int32_t op{k}(void *const *t, const int64_t *s, void *ws) {{"]
        body += [f"    const int64_t {name} = s[{i}];" for i, name in enumerate(spec.symbols)]
        body.append("    (void)s;")
        for a, tin in enumerate(op.inputs):
            ts = spec.tensors[tin]
            body.append(f"    const {C_TYPES[ts.dtype]} *in{a} = (const {C_TYPES[ts.dtype]} *)t[{a}];")
            body.append(f"    const int64_t c_in{a} = {_elements_c(ts.shape)};")
        for j, tout in enumerate(op.outputs):
            ts = spec.tensors[tout]
            body.append(f"    {C_TYPES[ts.dtype]} *out{j} = ({C_TYPES[ts.dtype]} *)t[{len(op.inputs) + j}];")
            body.append(f"    const int64_t c_out{j} = {_elements_c(ts.shape)};")
        body.append("    const int64_t nmax = MAX(c_out0, c_out1);" if len(op.outputs) > 1 else
                    "    const int64_t nmax = c_out0;")
        body.append(f"    const int64_t wsz = (int64_t)({_c_expr(op.scratch)});")
        body.append("    unsigned char *garbage = (unsigned char *)ws;")
        body.append(f"    uint32_t x = {op.seed}u;")
        body.append("    for (int64_t i = 0; i < wsz; i++) {")
        body.append("        x = x * 1103515245u + 12345u;")
        body.append("        garbage[i] = (unsigned char)(x >> 23);")
        body.append("    }")
        body.append("    uint32_t *stage = (uint32_t *)ws;")
        body.append("    const int64_t nstage = MIN(wsz / 4, c_out0);")
        body.append("    for (int64_t i = 0; i < nmax; i++) {")
        for a in range(len(op.inputs)):
            body.append(f"        const uint32_t v{a} = c_in{a} ? (uint32_t)in{a}[i % c_in{a}] : 0u;")
        for j, tout in enumerate(op.outputs):
            cj = op.coefs[j]
            terms = " + ".join(f"{cj[a]}u * v{a}" for a in range(len(op.inputs)))
            ctype = C_TYPES[spec.tensors[tout].dtype]
            body.append(f"        if (i < c_out{j}) {{")
            body.append(f"            const uint32_t r = {cj[3]}u + {terms};")
            if j == 0:
                body.append(f"            if (i < nstage) stage[i] = r; else out0[i] = ({ctype})r;")
            else:
                body.append(f"            out{j}[i] = ({ctype})r;")
            body.append("        }")
        body.append("    }")
        ctype0 = C_TYPES[spec.tensors[op.outputs[0]].dtype]
        body.append(f"    for (int64_t i = 0; i < nstage; i++) out0[i] = ({ctype0})stage[i];")
        body.append("    return 0;")
        body.append("}")
        lines.extend(body)
    return "\n".join(lines) + "\n"


NOOP_SOURCE = "#include <stdint.h>\nint32_t noop(void *const *t, const int64_t *s, void *ws) { return 0; }\n"


def build_dag(spec: DagSpec, registry: Any, *, noop: bool = False) -> Any:
    """The spec as a ``GraphBuilder`` (one C source, compiled once, one kernel per op). With ``noop``
    every op runs a kernel that does nothing (for planning benchmarks: no compile of a big source)."""
    from engine.build import GraphBuilder

    b = GraphBuilder("random_dag", registry=registry)
    values = []
    for i in range(spec.n_inputs):
        ts = spec.tensors[i]
        values.append(b.input(f"x{i}", ts.dtype, [int(d) if d.isdigit() else d for d in ts.shape],
                              device=ts.device))
    for j, w in enumerate(spec.weights):
        values.append(b.weight(f"w{j}", w))
    source = NOOP_SOURCE if noop else kernel_source(spec)
    noops: dict[str, Any] = {}
    for k, op in enumerate(spec.ops):
        if op.copy:
            values.append(b.copy(values[op.inputs[0]], op.device))
            continue
        if noop:
            if op.device not in noops:
                noops[op.device] = b.kernel("noop", device=op.device, entries=["noop"], source=source)
            kdef = noops[op.device]
        else:
            kdef = b.kernel(f"op{k}", device=op.device, entries=[f"op{k}"], source=source,
                            options={"flags": ["-O1"]})
        outs = b.call(kdef, [values[t] for t in op.inputs],
                      [(spec.tensors[t].dtype, list(spec.tensors[t].shape)) for t in op.outputs],
                      symbols=list(spec.symbols), workspace=op.scratch, share_map={0: 0} if op.in_place else None)
        values.extend(outs)
    for k, t in enumerate(spec.outputs):
        b.output(values[t], f"y{k}")
    return b


def eval_dim(expr: str, env: dict[str, int]) -> int:
    """Python's value of a generated shape expression (test code: our own strings only)."""
    names = {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, **env}
    return int(eval(expr, {"__builtins__": {}}, names))  # noqa: S307 - generated above, never outside input


def shape_at(spec: DagSpec, t: int, env: dict[str, int]) -> tuple[int, ...]:
    return tuple(eval_dim(d, env) for d in spec.tensors[t].shape)


def random_inputs(spec: DagSpec, key: dict[str, int], rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 256, shape_at(spec, i, key)).astype(spec.tensors[i].dtype) for i in range(spec.n_inputs)]


def reference(spec: DagSpec, env: dict[str, int], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """numpy evaluation of the spec, every tensor in its own array (a no-reuse execution)."""
    vals: dict[int, np.ndarray] = {i: np.array(x) for i, x in enumerate(inputs)}
    for j, w in enumerate(spec.weights):
        vals[spec.n_inputs + j] = w
    for op in spec.ops:
        if op.copy:
            vals[op.outputs[0]] = vals[op.inputs[0]]
            continue
        xs = [vals[t].reshape(-1).astype(np.uint32) for t in op.inputs]
        for j, t in enumerate(op.outputs):
            shape = shape_at(spec, t, env)
            count = int(np.prod(shape, dtype=np.int64))
            idx = np.arange(count)
            acc = np.full(count, op.coefs[j][3], np.uint32)
            for a, x in enumerate(xs):
                if x.size:
                    acc += x[idx % x.size] * np.uint32(op.coefs[j][a])
            vals[t] = acc.astype(spec.tensors[t].dtype).reshape(shape)
    return [vals[t] for t in spec.outputs]


# -- 1,000-instruction bundles for planning time ---------------------------------------------------
def transformer_bundle(registry: Any, layers: int = 83, d: int = 768, heads: int = 12, ff: int = 3072) -> Any:
    """A transformer stack of ``layers`` x 12 instructions (996 for 83) with symbols batch and seq,
    shaped like ``transformer()`` (fp32, packing scratch for matrix products), kernels that do
    nothing: only its plan is wanted."""
    from engine.build import GraphBuilder

    b = GraphBuilder("transformer", registry=registry)
    sym = ["batch", "seq"]
    x = b.input("x", "float32", ["batch", "seq", d])
    w = b.weight("w", np.zeros((4, 4), np.float32))
    k = b.kernel("noop", entries=["noop"], source=NOOP_SOURCE)
    act = [("float32", ["batch", "seq", d])]
    scores = [("float32", ["batch", heads, "seq", "seq"])]
    pack = 1 << 20

    def call(ins, outs, **kw):
        return b.call(k, ins, outs, symbols=sym, **kw)[0]

    for _ in range(layers):
        h = call([x], act, workspace="batch * seq * 8")
        q = call([h, w], act, workspace=pack)
        kk = call([h, w], act, workspace=pack)
        v = call([h, w], act, workspace=pack)
        s = call([q, kk], scores, workspace=pack)
        p = call([s], scores, share_map={0: 0}, workspace=f"batch * seq * {heads * 4}")
        c = call([p, v], act, workspace=pack)
        o = call([c, w], act, workspace=pack)
        x1 = call([x, o], act)
        u = call([x1, w], [("float32", ["batch * seq", ff])], workspace=pack)
        g = call([u], [("float32", ["batch * seq", ff])], share_map={0: 0})
        x = call([x1, g, w], act, workspace=pack)
    b.output(x)
    return b
