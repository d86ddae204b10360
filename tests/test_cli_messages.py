"""Messages that name the right culprit (issue 14): each observed case, run as a real ``engine``
process (``python -m engine``) on a real bundle, checked for its exit code, its one line on stderr
and, where the old message blamed something else, for not blaming it any more.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.cli.render import format_bytes, group_rows

from cli_support import cli_env, engine_cli, one_error_line

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def work(tmp_path_factory, mlp_bundle) -> Path:
    root = tmp_path_factory.mktemp("messages")
    shutil.copy(mlp_bundle, root / "mlp.cgb")
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return cli_env(tmp_path_factory.mktemp("messages-cache"))


engine = engine_cli


# -- sizes the machine cannot hold -----------------------------------------------------------------
def test_a_huge_batch_says_the_bytes_needed_and_available(work, env):
    proc = engine(work, env, "run", "mlp.cgb", "--random", "--symbol", "batch=1000000000000")
    assert proc.returncode == 1
    line = one_error_line(proc, "run")
    needed = 1_000_000_000_000 * 64 * 4
    assert "--symbol batch=1000000000000" in line and "input 'x'" in line
    assert f"would need {needed} bytes" in line and "more than this machine's memory" in line
    assert "MemoryError" not in line


@pytest.mark.parametrize("command", ["run", "bench", "tune"])
def test_a_value_beyond_int64_bytes_blames_the_command_line(work, env, command):
    argv = ["run", "mlp.cgb", "--random"] if command == "run" else [command, "mlp.cgb"]
    proc = engine(work, env, *argv, "--symbol", "batch=999999999999999999")
    assert proc.returncode == 1
    line = one_error_line(proc, command)
    assert "--symbol batch=999999999999999999" in line and "would need" in line
    assert "meta.json" not in line and "ValueError" not in line and "array is too big" not in line


# -- options and environment -----------------------------------------------------------------------
def test_a_negative_seed_is_bad_usage(work, env):
    proc = engine(work, env, "run", "mlp.cgb", "--random", "--symbol", "batch=2", "--seed", "-1")
    assert proc.returncode == 2
    line = one_error_line(proc, "run")
    assert "--seed" in line and "non-negative integer" in line


@pytest.mark.parametrize("argv", [["run", "mlp.cgb", "--random", "--symbol", "batch=2"], ["devices"]])
def test_a_bad_dispatch_policy_names_the_variable(work, env, argv):
    proc = engine(work, env, *argv, ENGINE_DISPATCH_POLICY="bogus")
    assert proc.returncode == 1
    line = one_error_line(proc, argv[0])
    assert "ENGINE_DISPATCH_POLICY='bogus': expected one of tune, first, nearest, error" in line


def test_a_bad_dispatch_policy_is_an_engine_error_in_the_library():
    import engine as eng
    from engine.settings import Settings

    with pytest.raises(eng.InputError, match="ENGINE_DISPATCH_POLICY='bogus'"):
        Settings.from_env({"ENGINE_DISPATCH_POLICY": "bogus"})
    with pytest.raises(ValueError):  # still a ValueError for code written against the old behaviour
        Settings(dispatch_policy="bogus")


def test_a_device_kind_nobody_provides_is_named_as_such(work, env):
    proc = engine(work, env, "run", "mlp.cgb", "--random", "--symbol", "batch=2", "--device", "tpu")
    assert proc.returncode == 2
    line = one_error_line(proc, "run")
    assert "no plugin provides device kind 'tpu'" in line and "only runs on" not in line


def test_devices_with_discovery_off_does_not_ask_to_install_what_is_installed(work, env):
    proc = engine(work, env, "devices", ENGINE_PLUGINS_AUTOLOAD="0")
    assert proc.returncode == 1
    assert "ENGINE_PLUGINS_AUTOLOAD=0" in proc.stdout and "engine-cpu" in proc.stdout
    assert "install 'engine-cpu'" not in proc.stdout


# -- outputs that were silently wrong --------------------------------------------------------------
def test_tune_refuses_save_together_with_output(work, env, tmp_path):
    before = (work / "mlp.cgb").read_bytes()
    target = tmp_path / "x.cgb"
    proc = engine(work, env, "tune", "mlp.cgb", "--symbol", "batch=1", "--save", "-o", str(target))
    assert proc.returncode == 2
    line = one_error_line(proc, "tune")
    assert "--save" in line and "-o" in line
    assert not target.exists() and (work / "mlp.cgb").read_bytes() == before


@pytest.mark.parametrize("name", ["out.txt", "out"])
def test_run_refuses_an_output_that_is_not_npz_or_npy(work, env, tmp_path, name):
    target = tmp_path / name
    proc = engine(work, env, "run", "mlp.cgb", "--random", "--symbol", "batch=2", "-o", str(target))
    assert proc.returncode == 2
    line = one_error_line(proc, "run")
    assert ".npz" in line and ".npy" in line and not target.exists()
    good = tmp_path / "out.npz"
    assert engine(work, env, "run", "mlp.cgb", "--random", "--symbol", "batch=2", "-o", str(good)).returncode == 0
    assert set(np.load(good).files) == {"probs"}


def test_tune_rows_list_their_keys_and_never_read_as_a_range(work, env):
    proc = engine(work, env, "tune", "mlp.cgb", "--symbol", "batch=1,8")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("batch=")]
    assert rows and not any(" .. " in r or ".." in r.split()[0] for r in rows)
    labels = [re.split(r"\s{2,}", r)[0] for r in rows]
    listed = sorted(int(v) for label in labels for v in label.removeprefix("batch=").split(", "))
    assert listed == [1, 8]


def test_grouped_key_labels_say_exactly_which_keys():
    same = ("mm_ikj", "new")
    assert group_rows([({"batch": 1}, same), ({"batch": 8}, same)]) == [("batch=1, 8", 2, same)]
    assert group_rows([({"batch": b}, same) for b in (1, 2, 3, 5)]) == [("batch=1..3, 5", 4, same)]
    other = ("mm_ijk", "new")
    assert [label for label, _, _ in group_rows([({"batch": 1}, same), ({"batch": 2}, other)])] == [
        "batch=1", "batch=2"]
    two = [({"seq": s, "batch": b}, same) for s in (128, 512) for b in (1, 2, 3)]
    assert [label for label, _, _ in group_rows(two)] == ["seq=128, batch=1..3", "seq=512, batch=1..3"]


# -- the demo ---------------------------------------------------------------------------------------
def _demo_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("engine-demo-"))


def test_demo_cleans_up_and_tells_the_truth_about_tuning(tmp_path, env):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cache = tmp_path / "cache"
    demo_env = {**env, "TMPDIR": str(tmp), "ENGINE_CACHE_DIR": str(cache)}
    first = subprocess.run([sys.executable, "-m", "engine", "demo"], env=demo_env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    assert _demo_dirs(tmp) == []
    assert "timed both matmul candidates" in first.stdout and "runs so far: 3 tuned" in first.stdout
    second = subprocess.run([sys.executable, "-m", "engine", "demo"], env=demo_env, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert _demo_dirs(tmp) == []
    assert "runs so far: 0 tuned" in second.stdout
    assert "timed both" not in second.stdout and "dispatch cache already held a choice" in second.stdout
    failed = subprocess.run([sys.executable, "-m", "engine", "demo", "--device", "tpu"], env=demo_env,
                            capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0 and _demo_dirs(tmp) == []


def test_demo_and_inspect_give_the_same_size(tmp_path, env):
    keep = tmp_path / "keep"
    demo = subprocess.run([sys.executable, "-m", "engine", "demo", "--keep", str(keep)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr
    path = keep / "mlp.cgb"
    expected = format_bytes(path.stat().st_size)
    assert f"{path} ({expected})" in demo.stdout
    inspect = subprocess.run([sys.executable, "-m", "engine", "inspect", str(path)], env=env, capture_output=True,
                             text=True, timeout=300)
    assert inspect.returncode == 0, inspect.stderr
    assert f"(zip, {expected} on disk," in inspect.stdout.splitlines()[0]


# -- one renderer for profiles ---------------------------------------------------------------------
def _profile_cells(text: str) -> tuple[list[str], list[list[str]]]:
    """The table's header and, per row, the cells that are not timings (timings differ run to run)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#"))
    header = re.split(r"\s{2,}", lines[head].strip())
    rows = []
    for line in lines[head + 2:]:
        if line.startswith("total:"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows.append(cells[:6])
    return header, rows


def test_print_profile_and_engine_profile_render_the_same_table(work, env, registry):
    import engine as eng

    proc = engine(work, env, "profile", "mlp.cgb", "--random", "--symbol", "batch=8", "--repeat", "2")
    assert proc.returncode == 0, proc.stderr
    with eng.load_compiled_graph(work / "mlp.cgb", registry=registry) as graph:
        graph.run_async([np.ones((8, 64), np.float32)])  # the same dispatch choice as the CLI's run
        text = str(graph.profile([np.ones((8, 64), np.float32)], warmup=1, repeat=2))
    cli_header, cli_rows = _profile_cells(proc.stdout)
    lib_header, lib_rows = _profile_cells(text)
    assert cli_header == lib_header
    assert [r[:2] for r in cli_rows] == [r[:2] for r in lib_rows]
    assert [r[3:] for r in cli_rows] == [r[3:] for r in lib_rows]  # device and shapes
    assert proc.stdout.splitlines()[-1].startswith("total: ") and text.splitlines()[-1].startswith("total: ")


# -- the plugin template's README ------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_plugin_template_readme_shows_what_engine_devices_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the README shows a terminal wide enough for one line a row
    sys.path.insert(0, str(REPO / "examples" / "plugin-template"))
    try:
        import engine_template.plugin as template_plugin
    finally:
        sys.path.pop(0)
    from engine.cli.main import main
    from support import make_registry

    registry = make_registry(tmp_path)
    registry.register_plugin(template_plugin, name="template", distribution="engine-plugin-template",
                             version="0.1.0")
    assert main(["devices"], registry=registry) == 0
    printed = [_cells(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    readme = (REPO / "examples" / "plugin-template" / "README.md").read_text()
    block = readme.split("$ engine devices", 1)[1].split("```", 1)[0].splitlines()[1:]
    shown = [_cells(line) for line in block if line.strip()]
    assert shown[0] == printed[0]  # the header
    rows = {r[0]: r for r in printed[2:]}
    for row in shown[2:]:
        real = rows[row[0]]
        assert row[:6] == real[:6], (row, real)  # kind, available, count, slot, api, plugin
        if row[0] == "template":
            assert row == real
