"""Dispatch overhead: what engine adds around N chained tiny C kernels, against floors in the same run.

The graph is ``x[1] -> add_one -> add_one -> ... -> y[1]`` (N calls of one C kernel that reads one
float and writes it plus one; static shapes), built with ``GraphBuilder``. Each kernel does ~1 ns
of work, so what is measured is the machinery around it:

* ``engine``: ``graph.run_async([x])`` on the prepared fast path (the CPU plugin fuses the N
  launches into one native call);
* ``engine, no fusion``: the same graph on a registry whose CPU backend's ``fuse`` returns None
  and without the native run path (``native_run=False``: the core then calls the N prepared
  launches one by one from Python). The default row takes the native run path (issue 16), whose
  own figures and floors are in ``native_run.py``;
* floor ``py-ctypes``: a Python loop of N ctypes calls into the same kernel function (the same
  loaded ``.so``), with prebuilt argument arrays over N+1 distinct buffers (no call writes its input);
* floor ``C loop``: one ctypes call into a C function that calls the kernel N times through a
  function pointer, over the same kind of argument arrays (the irreducible native cost);
* peer ``onnxruntime``: N chained ``Add(x, 1)`` nodes on float32[1], CPU provider, one thread.

Derived figures:

* fixed per-run overhead = t_engine(1) - t_py-ctypes(1) (one kernel called from Python is the floor
  of a one-kernel run; target <= 10 us), also given in units of that one ctypes call, a figure that
  stays put when a busy machine inflates every microsecond;
* per-kernel overhead = (t(1000) - t(1)) / 999 for every row, and engine's ratio to the
  py-ctypes loop's per-call cost (target <= 1.3x) and to the C loop's.

Run: ``python benchmarks/dispatch_overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "dispatch_overhead"
SIZES = (1, 100, 1000)
FIXED_TARGET_US = 10.0
PER_KERNEL_TARGET = 1.3

KERNEL_SOURCE = r"""
#include <stdint.h>
/* y[0] = x[0] + 1 (tensors: input, output; no symbols, no workspace). */
int32_t add_one(void *const *t, const int64_t *sym, void *ws) {
    const float *x = (const float *)t[0];
    float *y = (float *)t[1];
    y[0] = x[0] + 1.0f;
    return 0;
}
"""

C_LOOP_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int32_t (*engine_kernel)(void *const *tensors, const int64_t *symbols, void *workspace);
/* Call the kernel at fn_addr n times, call i with tensor_arrays[i]; stop at the first failure. */
int64_t c_loop(const void *fn_addr, int64_t n, void *const *const *tensor_arrays, const int64_t *symbols) {
    engine_kernel fn;
    memcpy(&fn, &fn_addr, sizeof fn);
    for (int64_t i = 0; i < n; ++i) {
        if (fn(tensor_arrays[i], symbols, 0) != 0) return i + 1;
    }
    return 0;
}
"""


def build_chain(n: int, registry):
    from engine.build import GraphBuilder

    b = GraphBuilder(f"chain_{n}", registry=registry)
    v = b.input("x", "float32", [1])
    k = b.kernel("add_one", entries=["add_one"], source=KERNEL_SOURCE)
    for _ in range(n):
        (v,) = b.call(k, [v], [("float32", [1])])
    b.output(v, "y")
    return b.build()


def engine_case(graph, n: int):
    """The timed callable for one graph, after checking the fast path runs and is right."""
    import numpy as np

    x = np.zeros(1, np.float32)
    for _ in range(3):
        (y,) = graph.run_async([x])
    stats = graph.run_stats()
    if stats.fast_runs < 1 or stats.prepared_runs != 1:
        C.fail(f"N={n}: the fast path did not run ({stats})")
    if float(y.numpy()[0]) != float(n):
        C.fail(f"N={n}: engine computed {float(y.numpy()[0])}, expected {n}")
    return functools.partial(graph.run_async, [x])


class Floors:
    """The two floors for one N, over N+1 distinct float buffers (call i reads buf[i], writes buf[i+1])."""

    def __init__(self, kernel_fn, c_loop_fn, fn_addr: int, n: int):
        import numpy as np

        self.n = n
        self.buf = np.zeros(n + 1, np.float32)
        base = self.buf.ctypes.data
        self.arrays = [(ctypes.c_void_p * 2)(base + 4 * i, base + 4 * (i + 1)) for i in range(n)]
        self.symbols = (ctypes.c_int64 * 1)(0)
        # What the Python floor loops over: one prebuilt call per kernel, as cheap as ctypes allows.
        self.calls = tuple(functools.partial(kernel_fn, a, self.symbols, None) for a in self.arrays)
        self.array_ptrs = (ctypes.c_void_p * n)(*(ctypes.addressof(a) for a in self.arrays))
        self.c_call = functools.partial(c_loop_fn, ctypes.c_void_p(fn_addr), ctypes.c_int64(n), self.array_ptrs,
                                        self.symbols)

    def py_loop(self) -> None:
        for call in self.calls:
            call()

    def check(self, which: str) -> None:
        self.buf[:] = -7.0
        self.buf[0] = 0.0
        if which == "py":
            self.py_loop()
        else:
            self.c_call()
        if float(self.buf[self.n]) != float(self.n) or float(self.buf[0]) != 0.0:
            C.fail(f"floor {which} N={self.n}: got {self.buf[self.n]}, expected {self.n}")


def onnx_chain(n: int):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    nodes = []
    prev = "x"
    for i in range(n):
        out = "y" if i == n - 1 else f"t{i}"
        nodes.append(helper.make_node("Add", [prev, "one"], [out], name=f"add_{i}"))
        prev = out
    graph = helper.make_graph(
        nodes, f"chain_{n}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [1], np.ones(1, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the bench extra allows
    onnx.checker.check_model(model)
    return model.SerializeToString()


def ort_session(model: bytes):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def ort_case(n: int):
    import numpy as np

    sess = ort_session(onnx_chain(n))
    x = np.zeros(1, np.float32)
    (y,) = sess.run(["y"], {"x": x})
    if float(y[0]) != float(n):
        C.fail(f"onnxruntime N={n}: got {y[0]}, expected {n}")
    return functools.partial(sess.run, ["y"], {"x": x})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (seconds, not a minute)")
    ap.add_argument("--no-onnxruntime", action="store_true", help="skip the onnxruntime peer")
    args = ap.parse_args(argv)
    rounds, round_s = (20, 0.003) if args.quick else (100, 0.004)

    load_start = C.loadavg()
    cache = C.isolated_cache()
    from engine_cpu.backend import CpuBackend

    class NoFusionCpuBackend(CpuBackend):
        """The CPU plugin with fusion off: the core calls prepared launches one by one."""

        def fuse(self, launches):
            return None

    registry = C.make_registry(cache)
    nofuse_registry = C.make_registry(cache, NoFusionCpuBackend(cache_dir=cache), native_run=False)
    cpu = registry.backend("cpu")

    cases = {}
    graphs = {}
    for n in SIZES:
        graphs[n] = build_chain(n, registry)
        cases[f"engine/{n}"] = engine_case(graphs[n], n)
        cases[f"nofuse/{n}"] = engine_case(build_chain(n, nofuse_registry), n)

    # The floors call the very kernel the engine loaded: the same .so, opened again by path
    # (dlopen hands back the same mapping), as a plain CDLL function without argtypes.
    kernel = graphs[1].compiled_tasks[0].candidates[0]
    lib = ctypes.CDLL(str(kernel.library.path))
    kernel_fn = lib["add_one"]
    kernel_fn.restype = ctypes.c_int32
    fn_addr = ctypes.cast(kernel_fn, ctypes.c_void_p).value
    if fn_addr != kernel.function_addr:
        C.fail("the floor's kernel is not the engine's kernel")
    tmp = Path(tempfile.mkdtemp(dir=cache))
    (payload,) = cpu.compile(C_LOOP_SOURCE, "c")
    (tmp / "c_loop.so").write_bytes(bytes(payload.data))
    c_loop_fn = ctypes.CDLL(str(tmp / "c_loop.so"))["c_loop"]
    c_loop_fn.restype = ctypes.c_int64
    floors = {}
    for n in SIZES:
        f = floors[n] = Floors(kernel_fn, c_loop_fn, fn_addr, n)
        f.check("py")
        f.check("c")
        cases[f"py/{n}"] = f.py_loop
        cases[f"c/{n}"] = f.c_call

    have_ort = not args.no_onnxruntime
    if have_ort:
        try:
            for n in SIZES:
                cases[f"ort/{n}"] = ort_case(n)
        except ImportError as exc:
            print(f"onnxruntime peer skipped: {exc}", file=sys.stderr)
            have_ort = False
            for n in SIZES:
                cases.pop(f"ort/{n}", None)

    timings = C.interleaved(cases, rounds=rounds, round_s=round_s)
    t = {k: v.min for k, v in timings.items()}
    med = {k: v.median for k, v in timings.items()}

    def slope(prefix: str, stats=t) -> float:
        return (stats[f"{prefix}/1000"] - stats[f"{prefix}/1"]) / 999

    labels = {"engine": "engine (fast path, fused)", "nofuse": "engine, fusion off",
              "py": "floor: py-ctypes loop", "c": "floor: C loop", "ort": "onnxruntime"}
    prefixes = ["engine", "nofuse", "py", "c"] + (["ort"] if have_ort else [])
    per_call_py = slope("py")
    per_call_c = slope("c")
    rows, table = [], []
    for p in prefixes:
        per = slope(p)
        fixed = t[f"{p}/1"] - t["py/1"]
        row = {"case": p, "label": labels[p]}
        for n in SIZES:
            row[f"n{n}_us"] = round(t[f"{p}/{n}"] * 1e6, 3)
            row[f"n{n}_median_us"] = round(med[f"{p}/{n}"] * 1e6, 3)
        row["per_kernel_us"] = round(per * 1e6, 4)
        row["per_kernel_vs_py_ctypes"] = round(per / per_call_py, 3)
        row["per_kernel_vs_c_loop"] = round(per / per_call_c, 2)
        row["fixed_over_one_ctypes_call_us"] = round(fixed * 1e6, 3)
        rows.append(row)
        table.append([labels[p], *(C.us(t[f"{p}/{n}"]) for n in SIZES), C.us(per, 4),
                      C.ratio(per, per_call_py), C.ratio(per, per_call_c, 1),
                      "-" if p == "py" else C.us(fixed)])
    print(C.format_table(
        ["case (min of rounds)", "N=1 us", "N=100 us", "N=1000 us", "per-kernel us", "vs py-ctypes", "vs C loop",
         "fixed us"], table,
        title=f"Dispatch overhead: N chained add_one kernels, float32[1] ({rounds} interleaved rounds)"))
    print("per-kernel = (t(1000) - t(1)) / 999; fixed = t(1) - t(py-ctypes, N=1)")

    fixed = t["engine/1"] - t["py/1"]
    per_engine = slope("engine")
    per_nofuse = slope("nofuse")
    summary = [
        {"metric": "engine fixed per-run overhead", "value": round(fixed * 1e6, 2), "unit": "us",
         "target": f"<= {FIXED_TARGET_US:g} us", "ok": fixed * 1e6 <= FIXED_TARGET_US},
        {"metric": "engine fixed overhead / one py-ctypes call", "value": round(fixed / t["py/1"], 1), "unit": "x"},
        {"metric": "engine run, N=1", "value": round(t["engine/1"] * 1e6, 2), "unit": "us"},
        {"metric": "engine per-kernel (fused) / py-ctypes call", "value": round(per_engine / per_call_py, 3),
         "unit": "x", "target": f"<= {PER_KERNEL_TARGET}x", "ok": per_engine / per_call_py <= PER_KERNEL_TARGET},
        {"metric": "engine per-kernel (fused) / C-loop call", "value": round(per_engine / per_call_c, 2),
         "unit": "x"},
        {"metric": "engine per-kernel (no fusion) / py-ctypes call", "value": round(per_nofuse / per_call_py, 3),
         "unit": "x", "target": f"<= {PER_KERNEL_TARGET}x", "ok": per_nofuse / per_call_py <= PER_KERNEL_TARGET},
        {"metric": "py-ctypes call (floor)", "value": round(per_call_py * 1e6, 3), "unit": "us"},
        {"metric": "C-loop call (floor)", "value": round(per_call_c * 1e9, 2), "unit": "ns"},
    ]
    if have_ort:
        summary += [
            {"metric": "onnxruntime run, N=1", "value": round(t["ort/1"] * 1e6, 2), "unit": "us"},
            {"metric": "onnxruntime per-node", "value": round(slope("ort") * 1e6, 3), "unit": "us"},
            {"metric": "onnxruntime per-node / engine per-kernel (fused)",
             "value": round(slope("ort") / per_engine, 1), "unit": "x"},
        ]
    C.print_summary(summary)
    C.warn_if_busy(load_start)
    path = C.write_results(NAME, quick=args.quick, params={"sizes": list(SIZES), "rounds": rounds, "loadavg_start": load_start,
                                                           "round_s": round_s, "statistic": "min"},
                           rows=rows, summary=summary)
    print(f"results: {path.relative_to(C.REPO_ROOT)}")
    return {"summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
