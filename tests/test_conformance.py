"""The conformance suite (engine.testing) catches real mistakes and passes correct backends.

Each case runs the whole suite in a subprocess with pytester, against a backend from
``conformance_backends`` (``--engine-backend``) or the installed CPU plugin (``--engine-kind``),
and reads the per-rule JSON report the suite writes.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance_backends import BROKEN
from engine.testing import REFERENCE_KERNELS, pytest_args, suite_dir
from engine.testing.rules import RULES, capabilities_markdown, rules_markdown

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).parent
DOCS = TESTS_DIR.parent / "docs" / "conformance.md"


@pytest.fixture
def run_suite(pytester, monkeypatch, session_cache):
    """``run_suite(kind=... | backend=...)`` -> (pytester result, parsed --engine-report JSON)."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(session_cache))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))

    def run(**target: str):
        report = pytester.path / "conformance.json"
        result = pytester.runpytest_subprocess(*pytest_args(**target, extra=[f"--engine-report={report}", "-rs"]))
        return result, json.loads(report.read_text())

    return run


def statuses(report: dict) -> dict[str, str]:
    return {rule_id: entry["status"] for rule_id, entry in report["rules"].items()}


@pytest.mark.slow
def test_correct_backend_passes_every_rule(run_suite):
    result, report = run_suite(backend="conformance_backends:conf_backend")
    assert result.ret == 0, result.stdout.str()
    assert statuses(report) == {r.id: "passed" for r in RULES}
    assert report["running"] is None


@pytest.mark.slow
@pytest.mark.parametrize("factory", sorted(BROKEN))
def test_broken_backend_fails_its_rule(run_suite, factory):
    rule_id = BROKEN[factory]
    result, report = run_suite(backend=f"conformance_backends:{factory}")
    assert result.ret == 1, result.stdout.str()
    assert statuses(report)[rule_id] == "failed", report["rules"][rule_id]
    message = report["rules"][rule_id]["messages"][0]
    assert f"rule {rule_id}: expected " in message and "; saw " in message
    result.stdout.fnmatch_lines([f"FAILED {rule_id}: *rule {rule_id}: expected*"])


@pytest.mark.slow
def test_unavailable_backend_skips_with_the_reason(run_suite):
    result, report = run_suite(backend="conformance_backends:unavailable")
    assert result.ret == 0, result.stdout.str()
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    assert skipped and all(t["message"].startswith("capability device: kind 'conf' is not available here: "
                                                   "no conf device on this machine") for t in skipped)
    assert all(t["outcome"] in ("passed", "skipped") for t in report["tests"])
    assert statuses(report)["availability.report"] == "passed"


def _conforms(result, report) -> None:
    """Every test passed or was skipped for a capability the backend does not advertise."""
    assert result.ret == 0, result.stdout.str()
    outcomes = {t["test"]: t for t in report["tests"]}
    assert all(t["outcome"] in ("passed", "skipped") for t in outcomes.values())
    for t in outcomes.values():
        if t["outcome"] == "skipped":
            assert t["message"].startswith("capability "), t
    assert statuses(report)["graph.demo_model"] == "passed"


@pytest.mark.slow
def test_installed_cpu_plugin_conforms(run_suite):
    _conforms(*run_suite(kind="cpu"))


@pytest.mark.slow
def test_installed_opencl_plugin_conforms_on_pocl(run_suite):
    pytest.importorskip("engine_opencl", reason="engine-opencl is not installed (pip install './plugins/opencl[pocl]')")
    result, report = run_suite(kind="opencl")
    _conforms(result, report)
    # The OpenCL device really ran kernels: its kernel, thread and DLPack rules passed, not skipped.
    got = statuses(report)
    assert all(got[r] == "passed" for r in ("launch.symbols", "launch.workspace", "launch.prepared_set_tensor",
                                             "isolation.threads", "dlpack.roundtrip")), got


@pytest.mark.slow
def test_the_plugin_template_conforms(run_suite, monkeypatch):
    template = TESTS_DIR.parent / "examples" / "plugin-template"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(template), os.environ["PYTHONPATH"]]))
    _conforms(*run_suite(backend="conformance_backends:template_backend"))


def test_every_rule_is_checked_by_a_suite_test():
    declared: set[str] = set()
    for path in Path(suite_dir()).glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "conformance":
                declared.update(arg.value for arg in node.args if isinstance(arg, ast.Constant))
    assert declared == {r.id for r in RULES}


def test_docs_show_the_rule_and_capability_tables():
    text = DOCS.read_text(encoding="utf-8")
    assert rules_markdown() in text, "regenerate the table with python -m engine.testing --rules"
    assert capabilities_markdown() in text
    assert all(f"| `{name}` |" in text for name in REFERENCE_KERNELS)


@pytest.mark.slow
def test_command_line(session_cache):
    env = {**os.environ, "ENGINE_CACHE_DIR": str(session_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}

    def main(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine.testing", *args], capture_output=True, text=True,
                              env=env, timeout=600)

    rules = main("--rules")
    assert rules.returncode == 0 and rules_markdown() in rules.stdout
    usage = main()
    assert usage.returncode == 2 and "python -m engine.testing KIND" in usage.stdout
    run = main("--backend", "conformance_backends:conf_backend", "-q", "-k", "test_declared")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine conformance: rules" in run.stdout and "failed" not in run.stdout
    bad = main("--backend", "conformance_backends:no_such_factory", "-q")
    assert bad.returncode == 4 and "has no callable 'no_such_factory'" in bad.stderr
