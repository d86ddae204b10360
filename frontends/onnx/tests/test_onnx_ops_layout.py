"""The op package's structure holds (issue 25): no import circle among engine_onnx.ops's modules, no
import deferred into a function, the registry refuses a second handler for an op type, and
``Lowering`` provides everything ``LoweringContext`` promises the handlers."""

from __future__ import annotations

import importlib.util
import inspect
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

pytest.importorskip("onnx")

from engine_onnx.lowering import Lowering  # noqa: E402
from engine_onnx.ops import OPS, registry  # noqa: E402
from engine_onnx.ops.context import LoweringContext  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _imports_script():
    path = REPO / "scripts" / "onnx-ops-imports"
    loader = SourceFileLoader("onnx_ops_imports", str(path))
    spec = importlib.util.spec_from_loader("onnx_ops_imports", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_no_import_circle_and_no_deferred_import_in_the_ops_package():
    script = _imports_script()
    root = REPO / "frontends" / "onnx" / "engine_onnx" / "ops"
    files = {p.stem: p for p in root.glob("*.py")}
    graph, deferred = {}, {}
    for name, path in files.items():
        graph[name], deferred[name] = script.module_imports(path, set(files))
        graph[name] |= set(deferred[name])
    assert not {n: d for n, d in deferred.items() if d}
    assert [c for c in script.components(graph) if len(c) > 1] == []


def test_a_second_handler_for_an_op_type_is_refused():
    def other(ctx, node):
        pass

    with pytest.raises(registry.DuplicateHandlerError, match="'Relu' already has a handler"):
        registry.register("Relu")(other)
    assert OPS["Relu"] is not other
    registry.register("Relu")(OPS["Relu"])  # the same handler again is no conflict


def test_lowering_provides_every_member_of_the_context_protocol():
    members = [m for m in vars(LoweringContext) if not m.startswith("_")]
    annotated = list(LoweringContext.__annotations__)
    lowering_members = set(dir(Lowering))
    missing = [m for m in members if m not in lowering_members]
    assert missing == []
    for name in members:
        if inspect.isfunction(vars(LoweringContext)[name]):
            want = list(inspect.signature(vars(LoweringContext)[name]).parameters)
            have = list(inspect.signature(getattr(Lowering, name)).parameters)
            assert want == have, name
    # instance attributes: set in Lowering.__init__
    source = inspect.getsource(Lowering.__init__)
    assert [a for a in annotated if f"self.{a} " not in source and f"self.{a}:" not in source] == []
