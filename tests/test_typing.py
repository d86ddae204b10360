"""The public API type-checks (issue 14): mypy with the project's configuration (``[tool.mypy]`` in
pyproject.toml) passes on the core, and a user's script sees the real types (``load_compiled_graph``
returns a ``CompiledGraph``) and gets an error for a wrong call.

mypy runs as a real process on the real sources; these tests are the type check of CI.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("mypy", reason="mypy is not installed (it is in the test extra: pip install -e '.[test]')")


def mypy(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_core_type_checks_with_the_project_configuration(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mypy-cache")
    proc = mypy(cwd=REPO, cache=cache)  # files, strictness and exclusions come from pyproject.toml
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().startswith("Success: no issues found"), proc.stdout


USER_SCRIPT = '''
import numpy as np

import engine
from engine.build.builder import GraphBuilder

graph = engine.load_compiled_graph("mlp.cgb", device="cpu")
reveal_type(graph)
outputs = graph.run_async([np.zeros((2, 64), np.float32)])
reveal_type(outputs)
tensor = engine.asarray(np.zeros(4, np.float32), dtype="float32")
reveal_type(tensor)
reveal_type(tensor.shape)
reveal_type(graph.profile([np.zeros((2, 64), np.float32)]))
reveal_type(GraphBuilder)
try:
    graph.save("copy.cgb", save_dispatch_table=True)
except engine.SaveError as exc:
    reveal_type(exc.path)
except engine.EngineError as exc:
    reveal_type(exc)
'''


def user_config(folder: Path) -> Path:
    """A user's strict mypy configuration. The script is run from the repository's root, so that
    `engine` resolves to these sources however it was installed (mypy cannot follow an editable
    install's import hook); engine's own modules are then analysed like an installed typed package:
    their types are used, their internals are not reported against the user's strict settings."""
    config = folder / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\n\n[mypy-engine.*]\nfollow_imports = silent\n\n"
                      "[mypy-engine]\nfollow_imports = silent\n")
    return config


def test_a_user_script_sees_the_public_types(tmp_path, tmp_path_factory):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    proc = mypy("--config-file", str(user_config(tmp_path)), str(script), cwd=REPO,
                cache=tmp_path_factory.mktemp("mypy-cache"))
    out = proc.stdout
    revealed = [t.replace("builtins.", "") for t in re.findall(r'Revealed type is "([^"]+)"', out)]
    assert revealed[0] == "engine.runtime.compiled_graph.CompiledGraph", out
    assert revealed[1].startswith("list["), out
    assert revealed[2] == "engine.tensor.Tensor", out
    assert revealed[3] == "tuple[int, ...]", out
    assert revealed[4] == "engine.runtime.profile.Profile", out
    assert revealed[5].endswith("-> engine.build.builder.GraphBuilder"), out
    assert revealed[6] == "str", out
    assert revealed[7] == "engine.errors.EngineError", out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert errors == [], out  # strict mode: the public API needs no casts or ignores from its users


def test_a_wrong_call_is_a_type_error(tmp_path, tmp_path_factory):
    script = tmp_path / "wrong.py"
    script.write_text(textwrap.dedent('''
        import engine

        graph = engine.load_compiled_graph(42)
        graph.save("x.cgb", save_dispatch_table="yes")
    '''))
    proc = mypy("--config-file", str(user_config(tmp_path)), str(script), cwd=REPO,
                cache=tmp_path_factory.mktemp("mypy-cache"))
    assert proc.returncode == 1, proc.stdout
    assert 'Argument 1 to "load_compiled_graph" has incompatible type "int"' in proc.stdout
    assert '"save" of "CompiledGraph" has incompatible type "str"' in proc.stdout


def test_every_distribution_ships_the_typed_marker():
    for package in (REPO / "engine", REPO / "plugins" / "cpu" / "engine_cpu",
                    REPO / "plugins" / "opencl" / "engine_opencl",
                    REPO / "examples" / "plugin-template" / "engine_template"):
        assert (package / "py.typed").is_file(), package
