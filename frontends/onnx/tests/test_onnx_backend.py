"""ONNX's own backend node tests (``onnx.backend.test``) against the importer and the CPU plugin.

Every node test whose name starts with a supported op's test prefix (``OP_PREFIXES``) is collected.
A test fails on a wrong result, a crash or a conversion error; it is *skipped*, with the importer's
reason, only when the importer refuses the model with ``UnsupportedModelError`` (an attribute,
dtype or op outside the supported set, listed node by node in the skip message) or
``UnsupportedOpsetError`` (an opset newer than the installed onnx knows). docs/onnx.md
gives the pass and skip counts by op.

**Parameters as initializers.** ONNX's node tests feed every input of the node as a graph input,
including the ones that fix output shapes (Pad's pads, Resize's scales, TopK's k, the axes of a
reduction, Reshape's shape…). Exported models carry those as initializers, and the importer
requires them at import, so the as-given test is skipped with that reason. For each such node test,
``test_with_parameters_as_initializers[NAME]`` runs the same model with those inputs (the positions
in ``PARAMETER_INPUTS``) turned into initializers holding the test's own values, and compares with
the test's expected outputs at its tolerances: the kernels are checked even where the as-given
form cannot be imported. docs/onnx.md counts both forms separately.

``python frontends/onnx/tests/test_onnx_backend.py --report`` runs this module and prints the two
tables of docs/onnx.md (pass/skip counts by test prefix, skip reasons) in Markdown.

Kernels are cached by content under the CPU plugin's cache directory, so a rerun compiles nothing.
"""

from __future__ import annotations

import re
import sys
import unittest
from collections import Counter, defaultdict

import pytest

onnx = pytest.importorskip("onnx")
engine_onnx_backend = pytest.importorskip("engine_onnx.backend")

import numpy as np  # noqa: E402
import onnx.backend.test  # noqa: E402
from onnx.backend.test.loader import load_node_model_tests  # noqa: E402
from onnx.backend.test.runner import Runner  # noqa: E402

from engine_onnx.errors import UnsupportedModelError, UnsupportedOpsetError  # noqa: E402

#: Test-name prefixes (after ``test_``) of the ops the importer supports.
OP_PREFIXES = (
    "abs", "acos", "add", "and", "argmax", "argmin", "asin", "atan", "averagepool", "basic_conv", "batchnorm",
    "bitwise_and", "bitwise_or", "bitwise_xor", "cast", "castlike", "ceil", "clip", "concat", "constant",
    "constant_pad", "constantofshape", "conv_with", "convtranspose", "cos", "cosh", "div", "dropout",
    "edge_pad", "elu", "equal", "erf", "exp", "expand", "flatten", "floor", "gather_0", "gather_1", "gather_2d",
    "gather_negative", "gelu", "gemm", "globalaveragepool", "globalmaxpool", "greater", "hardsigmoid",
    "hardswish", "identity", "instancenorm", "layer_normalization", "leakyrelu", "less", "log", "logsoftmax",
    "lrn", "matmul", "max", "maxpool", "mean", "min", "mod", "mul", "neg", "not", "or", "pow", "prelu", "range",
    "reciprocal", "reduce_l1", "reduce_l2", "reduce_max", "reduce_mean", "reduce_min", "reduce_prod",
    "reduce_sum", "reduce_sum_square", "reflect_pad", "relu", "reshape", "resize", "round", "selu", "shape",
    "sigmoid", "sign", "sin", "sinh", "size", "slice", "softmax", "softplus", "softsign", "split", "sqrt",
    "squeeze", "sub", "sum", "tan", "tanh", "tile", "top_k", "transpose", "unsqueeze", "upsample", "where",
    "wrap_pad", "xor",
)

#: Names the prefixes above match but that test other ops.
EXCLUDE = (
    r"^test_(matmulinteger|convinteger|reduce_log_sum|max_?unpool|maxroipool|logsoftmax_large|"
    r"mean_variance|cast_.*FLOAT8|cast_.*FLOAT4|cast_.*INT4|cast_.*UINT4|cast_.*INT2|cast_.*UINT2|"
    r"castlike_.*FLOAT8|castlike_.*FLOAT4|castlike_.*INT4|castlike_.*UINT4|castlike_.*INT2|castlike_.*UINT2)",
)


class SkippingBackend(engine_onnx_backend.EngineOnnxBackend):
    """The engine backend; a model the importer refuses is a skip carrying the importer's reasons."""

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        try:
            return super().prepare(model, device, **kwargs)
        except (UnsupportedModelError, UnsupportedOpsetError) as exc:
            raise unittest.SkipTest(f"unsupported: {exc}") from None


#: Per op type, the input positions that exported models give as initializers (shape-determining
#: parameters and weights); the constant-parameter variant binds the graph inputs found there.
PARAMETER_INPUTS = {
    "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,), "TopK": (1,), "Tile": (1,), "Range": (0, 1, 2),
    "Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Slice": (1, 2, 3, 4), "Split": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Clip": (1, 2), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "ReduceSumSquare": (1,), "ReduceL1": (1,), "ReduceL2": (1,),
    "Conv": (1, 2), "BatchNormalization": (1, 2, 3, 4), "InstanceNormalization": (1, 2),
}


def _name_pattern(prefix: str) -> str:
    """Test names of one prefix: ``test_<prefix>``, then ``_…`` or a rank (``test_and2d``), no device."""
    return rf"^test_{prefix}(_.*|\d+d(_.*)?)?$"


def selected(name: str) -> bool:
    """Whether node test ``name`` (without ``_cpu``) is in the selection above."""
    return (any(re.match(_name_pattern(p), name) for p in OP_PREFIXES)
            and not any(re.match(pattern, name) for pattern in EXCLUDE))


def bound_parameters(model: onnx.ModelProto) -> list[int]:
    """Positions (among the graph inputs) of the inputs a node reads as a parameter."""
    wanted = {n.input[i] for n in model.graph.node for i in PARAMETER_INPUTS.get(n.op_type, ()) if
              i < len(n.input) and n.input[i]}
    return [k for k, vi in enumerate(model.graph.input) if vi.name in wanted]


#: Parameter variants that fail because of a known bug outside the op modules these tests cover;
#: strict, so each turns into a failure (XPASS) once fixed, and its line must then go.
#: Node tests known to fail, with why (each is a strict xfail: fixing it makes the suite say so).
KNOWN_FAILURES: dict[str, str] = {}


def with_parameters_bound(model: onnx.ModelProto, inputs: list) -> tuple[onnx.ModelProto, list]:
    """``model`` with its parameter inputs (``bound_parameters``) as initializers holding their
    values in ``inputs``, and the inputs left to feed."""
    bound = bound_parameters(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not bound:
        return out, list(inputs)
    kept = [vi for k, vi in enumerate(out.graph.input) if k not in bound]
    for k in bound:
        out.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(inputs[k]), model.graph.input[k].name))
    del out.graph.input[:]
    out.graph.input.extend(kept)
    return out, [x for k, x in enumerate(inputs) if k not in bound]


def _parameter_cases() -> list:
    return [pytest.param(case, id=case.name, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[case.name])]
                         if case.name in KNOWN_FAILURES else [])
            for case in sorted(load_node_model_tests(), key=lambda c: c.name)
            if selected(case.name) and case.model is not None and bound_parameters(case.model)]


@pytest.mark.parametrize("case", _parameter_cases())
def test_with_parameters_as_initializers(case):
    """The node test with its parameter inputs as initializers (their values from the test's data)."""
    for inputs, expected in case.data_sets:
        model, feed = with_parameters_bound(case.model, inputs)
        outputs = SkippingBackend.prepare(model).run(feed)
        Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol)


backend_test = onnx.backend.test.BackendTest(SkippingBackend, __name__)
for prefix in OP_PREFIXES:
    backend_test.include(_name_pattern(prefix).removesuffix("$") + "_cpu$")
for pattern in EXCLUDE:
    backend_test.exclude(pattern)

# Only the node tests: the model-zoo tests download models, the simple and PyTorch-converted ones
# are collected by their own names (none of them starts with an op prefix above).
globals().update({name: case for name, case in backend_test.test_cases.items() if "Node" in name})


# -- the docs tables ------------------------------------------------------------------------------
class _Outcomes:
    """A pytest plugin recording (test name, outcome, skip reason) of every test of this module."""

    def __init__(self):
        self.rows: list[tuple[str, bool, str, str]] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            reason, outcome = "", report.outcome
            if hasattr(report, "wasxfail"):
                outcome, reason = "xfailed", report.wasxfail
            elif report.skipped and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2].removeprefix("Skipped: ")
            m = re.search(r"\[(test_\w+?)\]$", report.nodeid)
            if m:
                name, variant = m.group(1), True
            elif report.nodeid.endswith("_cpu"):
                name, variant = report.nodeid.rsplit("::", 1)[-1].removesuffix("_cpu"), False
            else:
                return  # another device's copy of a node test, never selected
            self.rows.append((name, variant, outcome, reason))


def _prefix_of(name: str) -> str:
    best = max((p for p in OP_PREFIXES if re.match(_name_pattern(p), name)), key=len, default="?")
    return best


def _reason_of(text: str) -> str:
    """The importer's reason without the test name and the model name."""
    m = re.search(r"node\(s\): .*? \(([^()]*)\): (.*?)(?:; [^;]* \([^()]*\): |; expected only|$)", text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    m = re.search(r"default-domain opset (\d+)", text)
    return f"opset {m.group(1)} (newer than the installed onnx)" if m else text.split(": ", 1)[-1][:120]


def report(argv: list[str]) -> int:
    """Run this module, print the pass/skip table by test prefix and the skip reasons (Markdown)."""
    rec = _Outcomes()
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", *argv], plugins=[rec])
    counts: dict[str, Counter] = defaultdict(Counter)
    reasons: Counter = Counter()
    for name, variant, outcome, reason in rec.rows:
        if not selected(name):
            continue
        counts[_prefix_of(name)][("init-" if variant else "") + outcome] += 1
        if outcome == "skipped":
            reasons[("as initializers: " if variant else "") + _reason_of(reason)] += 1
    print("\n| test prefix | passed | skipped | failed | with parameters as initializers: passed / skipped |")
    print("|---|---|---|---|---|")
    total: Counter = Counter()
    for prefix in sorted(counts):
        c = counts[prefix]
        total.update(c)
        init = f"{c['init-passed']} / {c['init-skipped']}" if c["init-passed"] + c["init-skipped"] + \
            c["init-failed"] else ""
        for what in ("failed", "xfailed"):
            if c[f"init-{what}"]:
                init += f" ({c[f'init-{what}']} {what})"
        print(f"| {prefix} | {c['passed']} | {c['skipped']} | {c['failed']} | {init} |")
    print(f"| **total** | {total['passed']} | {total['skipped']} | {total['failed']} | "
          f"{total['init-passed']} / {total['init-skipped']} |")
    print("\n| skipped because | tests |\n|---|---|")
    for reason, n in reasons.most_common():
        print(f"| {reason.replace('|', '/')} | {n} |")
    return int(code)


if __name__ == "__main__":
    if "--report" in sys.argv:
        sys.exit(report([a for a in sys.argv[1:] if a != "--report"]))
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
