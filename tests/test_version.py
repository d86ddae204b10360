"""``engine --version`` and ``python -m engine`` (issue 14): the core, every plugin with its plugin API
(or why it failed), Python and the platform; the module form behaves as the script does.

Run as real processes; the broken plugin is a real installed distribution (a ``.dist-info`` with an
``engine.devices`` entry point on ``PYTHONPATH``) whose module fails to import.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.backend import API_VERSION
from engine.cli.main import main

API = f"{API_VERSION[0]}.{API_VERSION[1]}"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    out = dict(os.environ)
    out["ENGINE_CACHE_DIR"] = str(tmp_path_factory.mktemp("version-cache"))
    for name in ("ENGINE_DEVICES", "ENGINE_DISPATCH_POLICY", "ENGINE_PLUGINS_AUTOLOAD"):
        out.pop(name, None)
    return out


def run(*argv: str, env: dict[str, str], module: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "engine", *argv] if module else [*argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_version_lists_core_plugins_python_and_platform(env):
    proc = run("--version", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"engine {engine.__version__} (plugin API {API})"
    from importlib.metadata import version

    assert f"plugin engine-cpu {version('engine-cpu')}: kind 'cpu', plugin API {API}" in lines
    assert any(line.startswith(f"Python {platform.python_version()} ") for line in lines)
    assert lines[-1].startswith(f"platform {platform.platform()}")


def test_version_says_why_a_plugin_failed(env, tmp_path):
    site = tmp_path / "site"
    dist = site / "engine_broken-0.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-broken\nVersion: 0.3\n")
    (dist / "entry_points.txt").write_text("[engine.devices]\nbroken = engine_broken_plugin\n")
    (site / "engine_broken_plugin.py").write_text("raise ImportError('the vendor SDK is missing')\n")
    extra = {**env, "PYTHONPATH": os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = run("--version", env=extra)
    assert proc.returncode == 0, proc.stderr
    assert ("plugin engine-broken 0.3: kind 'broken' FAILED: import failed: ImportError: the vendor SDK is missing"
            in proc.stdout.splitlines())
    assert "kind 'cpu', plugin API" in proc.stdout  # the others are still listed


def test_version_with_discovery_off_says_so(env):
    proc = run("--version", env={**env, "ENGINE_PLUGINS_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "ENGINE_PLUGINS_AUTOLOAD=0 turns plugin discovery off" in proc.stdout and "engine-cpu" in proc.stdout


def test_version_still_answers_with_a_bad_setting(env):
    proc = run("--version", env={**env, "ENGINE_DISPATCH_POLICY": "bogus"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"engine {engine.__version__} ") and "ENGINE_DISPATCH_POLICY='bogus'" in proc.stdout


def test_version_lists_the_registry_main_was_given(registry, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"], registry=registry)
    assert exit_info.value.code == 0
    assert f"kind 'cpu', plugin API {API}" in capsys.readouterr().out


def test_python_m_engine_is_the_engine_command(env):
    script = shutil.which("engine")
    if script is None:
        pytest.skip("the 'engine' script is not on PATH (an install without its scripts directory on PATH)")
    for argv in (["--version"], ["devices", "--json"], []):
        by_module = run(*argv, env=env)
        by_script = run(script, *argv, env=env, module=False)
        assert by_module.returncode == by_script.returncode, (argv, by_module.stderr, by_script.stderr)
        if argv[:1] == ["devices"]:
            assert by_module.stdout == by_script.stdout
        elif argv:
            # Python's own line names the interpreter; everything else matches.
            assert [l for l in by_module.stdout.splitlines() if not l.startswith("Python ")] == [
                l for l in by_script.stdout.splitlines() if not l.startswith("Python ")]
    assert run(env=env).returncode == 2  # no command: the help and exit code 2, as `engine` alone


def test_python_m_engine_runs_a_command(env, mlp_bundle: Path):
    proc = run("run", str(mlp_bundle), "--random", "--symbol", "batch=2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert '"probs"' in proc.stdout
