"""The README's two set-up commands, as a new user runs them (issue 14).

- On a stock Debian/Ubuntu Python, which refuses ``pip install`` (PEP 668, "externally-managed-
  environment"): both commands create and use a project ``.venv``, and work.
- Inside an already active virtual environment made from the system Python: they install there and
  create no ``.venv`` (the demo installs and runs there; the test command's choice of Python is
  checked, its install and run from scratch being the first scenario's).
- On a Python that pip installs into (pyenv, conda): they use it as it is.
- The wheels carry ``py.typed`` and the LICENSE.

Each scenario runs the real scripts on a copy of this working tree in a temporary directory (so
nothing is installed into the interpreter running the tests). The test command is exercised through
its pytest pass-through on one small test file, not the whole suite recursively.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_SKIP_ANYWHERE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "*.so", ".hypothesis",
                                        ".pytest_cache", ".benchmarks")


def _skip(folder: str, names: list[str]) -> set[str]:
    """What a fresh clone would not have: build outputs, caches, environments (not engine/build/)."""
    skipped = set(_SKIP_ANYWHERE(folder, names))
    where = Path(folder).resolve()
    if where == REPO or where.parent.name in ("plugins", "examples"):
        skipped |= {n for n in names if n in ("build", "dist")}
    return skipped
# The test command's pass-through: one small, quick test file.
SUBSET = ["tests/test_expr.py", "-q", "-x", "-p", "no:cacheprovider"]


def _system_python() -> str | None:
    """A python3 whose pip refuses to install (a Debian/Ubuntu system Python), or None."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(candidate, os.X_OK):
            continue
        probe = subprocess.run([candidate, "-c", "import os, sys, sysconfig; "
                                "print(os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), "
                                "'EXTERNALLY-MANAGED')) and sys.prefix == sys.base_prefix)"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


SYSTEM_PYTHON = _system_python()
needs_system_python = pytest.mark.skipif(
    SYSTEM_PYTHON is None, reason="no externally managed system python3 here (Debian/Ubuntu: apt-get install "
                                  "python3 python3-venv)")


def copy_tree(dest: Path) -> Path:
    shutil.copytree(REPO, dest, ignore=_skip, symlinks=True)
    return dest


def user_env(tmp: Path, python_dir: str, **extra: str) -> dict[str, str]:
    """A shell's environment with ``python_dir`` first on PATH and no virtual environment active."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "ENGINE_VENV", "ENGINE_VENV_DIR", "PYTHON")
           and not k.startswith("ENGINE_")}
    env["PATH"] = os.pathsep.join([python_dir, "/usr/bin", "/bin"])
    env["ENGINE_CACHE_DIR"] = str(tmp / "engine-cache")
    env["TMPDIR"] = str(tmp)
    env.update(extra)
    return env


def sh(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@needs_system_python
def test_on_an_externally_managed_python_both_commands_use_a_project_venv(tmp_path):
    assert SYSTEM_PYTHON is not None
    bin_dir = str(Path(SYSTEM_PYTHON).parent)
    env = user_env(tmp_path, bin_dir)
    tree = copy_tree(tmp_path / "engine")
    # What a new user met before: pip itself refuses this interpreter.
    refused = sh([SYSTEM_PYTHON, "-m", "pip", "install", "--dry-run", "-e", "."], tree, env)
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused.stderr

    demo = sh(["./scripts/demo"], tree, env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "creating the project's virtual environment" in demo.stderr and "demo passed" in demo.stdout
    venv_python = tree / ".venv" / "bin" / "python"
    assert venv_python.exists()
    check = sh([str(venv_python), "-c", "import engine, engine_cpu, sys; print(engine.__file__)"], tree, env)
    assert check.returncode == 0 and check.stdout.startswith(str(tree)), check.stderr

    test = sh(["./scripts/test", *SUBSET], tree, env)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-3000:]
    assert f"using {venv_python}" in test.stderr and " passed" in test.stdout
    assert "creating" not in test.stderr  # the .venv of the first command is reused


@pytest.mark.slow
def test_inside_an_active_virtual_environment_they_install_there(tmp_path):
    base = SYSTEM_PYTHON or sys.executable
    venv = tmp_path / "venv"
    made = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    if made.returncode != 0:
        pytest.skip(f"{base} cannot create a virtual environment: {made.stderr.strip()[-200:]}")
    env = user_env(tmp_path, str(venv / "bin"), VIRTUAL_ENV=str(venv))
    tree = copy_tree(tmp_path / "engine")
    demo = sh(["./scripts/demo"], tree, env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "demo passed" in demo.stdout
    assert not (tree / ".venv").exists()
    check = sh([str(venv / "bin" / "python"), "-c", "import engine; print(engine.__file__)"], tree, env)
    assert check.returncode == 0 and check.stdout.startswith(str(tree)), check.stderr
    # The test command picks its Python as the demo does (scripts/_python.sh) and installs into it:
    # the active environment here. Its own install and run from scratch are the scenario above's.
    chosen, _ = _chosen_python(tree, env)
    assert shutil.which(chosen, path=env["PATH"]) == str(venv / "bin" / chosen)
    assert not (tree / ".venv").exists()


def _chosen_python(tree: Path, env: dict[str, str]) -> tuple[str, str]:
    proc = sh(["bash", "-c", "source scripts/_python.sh && engine_python && echo \"$PY\""], tree, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


def test_a_python_pip_installs_into_is_used_as_it_is(tmp_path):
    """pyenv, conda, python.org: the scripts install into that python3 itself, as before (the choice
    only; installing here would replace the running interpreter's engine)."""
    me = Path(sys.executable)
    if os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) and \
            sys.prefix == sys.base_prefix:
        pytest.skip("the interpreter running the tests is itself externally managed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(me)
    env = user_env(tmp_path, str(bin_dir))
    tree = copy_tree(tmp_path / "engine")
    chosen, _ = _chosen_python(tree, env)
    assert chosen == "python3" and not (tree / ".venv").exists()
    # ENGINE_VENV=1 asks for the project venv all the same (made here from this interpreter).
    chosen, said = _chosen_python(tree, {**env, "ENGINE_VENV": "1"})
    assert chosen == str(tree / ".venv" / "bin" / "python") and "creating" in said
    bad = sh(["bash", "-c", "source scripts/_python.sh && engine_python"], tree, {**env, "ENGINE_VENV": "maybe"})
    assert bad.returncode != 0 and "ENGINE_VENV=maybe" in bad.stderr


def test_the_ci_entry_point_runs_the_readme_command():
    readme = (REPO / "README.md").read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == ["ENGINE_TEST_TORCH=1 ./scripts/test"]
    assert "ENGINE_TEST_TORCH=1 ./scripts/test" in readme and "./scripts/demo" in readme


def _wheel(source: Path, out: Path) -> zipfile.ZipFile:
    import setuptools

    isolation = [] if int(setuptools.__version__.split(".")[0]) >= 77 else ["--use-pep517"]
    args = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(source)]
    if not isolation:
        args.insert(4, "--no-build-isolation")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    return zipfile.ZipFile(wheel)


@pytest.mark.slow
@pytest.mark.parametrize("source, package", [(".", "engine"), ("plugins/cpu", "engine_cpu"),
                                             ("plugins/opencl", "engine_opencl")])
def test_wheels_ship_py_typed_and_the_license(tmp_path, source, package):
    tree = copy_tree(tmp_path / "engine")
    with _wheel(tree / source, tmp_path / "wheels") as wheel:
        names = wheel.namelist()
        assert f"{package}/py.typed" in names
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert wheel.read(license_name) == (REPO / "LICENSE").read_bytes()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode()
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
