"""``--json`` on every command but ``demo`` (docs/cli.md, "Conventions"; issue 24): each command
``engine --help`` lists, run as a real process with ``--json``, prints exactly one JSON document on
stdout; an error prints none (one line on stderr, as without ``--json``).

``convert`` comes from engine-onnx (skipped where it is not installed) and prints its own document.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from cli_support import RELU_ONNX, cli_env, engine_cli

HAS_ENGINE_ONNX = importlib.util.find_spec("engine_onnx") is not None

#: One --json command line per command (several for cache), run in the work directory.
CASES = {
    "devices": ["devices", "--json"],
    "inspect": ["inspect", "mlp.cgb", "--json"],
    "verify": ["verify", "mlp.cgb", "--json"],
    "run": ["run", "mlp.cgb", "--random", "--symbol", "batch=2", "--json"],
    "bench": ["bench", "mlp.cgb", "--symbol", "batch=2", "--warmup", "0", "--repeat", "2", "--json"],
    "tune": ["tune", "mlp.cgb", "--symbol", "batch=1..3", "--json"],
    "profile": ["profile", "mlp.cgb", "--random", "--symbol", "batch=2", "--repeat", "2", "--json"],
    "trace": ["trace", "mlp.cgb", "--random", "--symbol", "batch=2", "-o", "trace.json", "--json"],
    "cache info": ["cache", "info", "--json"],
    "cache prune": ["cache", "prune", "--json"],
    "convert": ["convert", "relu.onnx", "-o", "relu.cgb", "--json"],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory, mlp_bundle) -> Path:
    root = tmp_path_factory.mktemp("json")
    shutil.copy(mlp_bundle, root / "mlp.cgb")
    (root / "relu.onnx").write_bytes(RELU_ONNX)
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return cli_env(tmp_path_factory.mktemp("json-cache"))


engine = engine_cli


def test_the_cases_cover_every_command(work, env):
    """Every command ``engine --help`` lists has a case, except ``demo`` (the documented exception)."""
    proc = engine(work, env, "--help")
    assert proc.returncode == 0
    section = proc.stdout.split("COMMAND\n", 1)[1].split("\noptions:", 1)[0]
    listed = set(re.findall(r"^    (\w+) ", section, flags=re.M))
    assert {"devices", "inspect", "run", "tune", "cache"} <= listed
    covered = {name.split()[0] for name in CASES}
    assert listed - covered == {"demo"} and covered <= listed


@pytest.mark.parametrize("case", list(CASES))
def test_json_gives_one_json_document_on_stdout(case, work, env):
    if case == "convert" and not HAS_ENGINE_ONNX:
        pytest.skip("engine-onnx is not installed (engine convert is its command)")
    proc = engine(work, env, *CASES[case])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout: nothing before or after the document
    assert isinstance(doc, dict) and doc
    if case == "convert":
        assert doc["model"] == "relu.onnx" and doc["output"] == "relu.cgb" and doc["device"] == "cpu"
        assert doc["form"] == "zip" and doc["seconds"] > 0 and doc["pins"] == []
        assert (work / "relu.cgb").is_file()


@pytest.mark.parametrize("argv", [["inspect", "missing.cgb", "--json"],
                                  ["run", "mlp.cgb", "--random", "--json"],
                                  ["cache", "info", "--older-than", "1d", "--json"]],
                         ids=["missing file", "missing symbol", "bad option for info"])
def test_an_error_under_json_is_one_line_on_stderr_and_nothing_on_stdout(argv, work, env):
    proc = engine(work, env, *argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"engine {argv[0]}: error: ")


def test_convert_without_json_prints_its_text(work, env):
    if not HAS_ENGINE_ONNX:
        pytest.skip("engine-onnx is not installed (engine convert is its command)")
    proc = engine(work, env, "convert", "relu.onnx", "-o", "relu-text.cgb")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote relu-text.cgb in ")
