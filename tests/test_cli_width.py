"""``engine devices`` and ``engine tune`` fit the terminal (issue 24): no line wider than
``COLUMNS`` (80 off a terminal), long causes wrapped rather than cut, and the ``tune`` table
transposed when a bundle has many kernels, with the same choices as ``--json``.

Real processes on real bundles: the HIP and CUDA plugins installed here are unavailable, with long
reasons; the tune bundle chains 14 two-candidate kernels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import chain_bundle


def _env(cache: Path, columns: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("ENGINE_DEVICES", "ENGINE_DISPATCH_POLICY", "ENGINE_PLUGINS_AUTOLOAD", "ENGINE_DISPATCH_CACHE",
                 "ENGINE_TUNING_WARN_S", "COLUMNS", "LINES"):
        env.pop(name, None)
    env["ENGINE_CACHE_DIR"] = str(cache)
    if columns is not None:
        env["COLUMNS"] = columns
    return env


def _engine(cwd: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("columns", ["80", None], ids=["COLUMNS=80", "not-a-tty"])
def test_devices_fits_80_columns_and_keeps_every_cause(tmp_path, columns):
    env = _env(tmp_path / "cache", columns)
    text = _engine(tmp_path, env, "devices")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(f"{len(x):3d} {x}" for x in lines)
    doc = json.loads(_engine(tmp_path, env, "devices", "--json").stdout)
    # Every row is there, and every cause in full (wrapped at spaces, not cut).
    for row in doc["devices"]:
        assert any(line.startswith(row["kind"] + " ") for line in lines), row["kind"]
        if row["reason"]:
            assert _words(row["reason"]) in _words(text.stdout), row["reason"]
    long_reasons = [r["reason"] for r in doc["devices"] if r["reason"] and len(r["reason"]) > 80]
    if not long_reasons:
        pytest.skip("no device here has a cause longer than a line (the HIP/CUDA plugins give them)")


def test_devices_uses_a_wide_terminal(tmp_path):
    env = _env(tmp_path / "cache", "400")
    text = _engine(tmp_path, env, "devices")
    assert text.returncode == 0, text.stderr
    header = text.stdout.splitlines()[0]
    assert header.split() == ["kind", "available", "count", "slot", "api", "plugin", "devices", "/", "cause"]
    assert max(len(line) for line in text.stdout.splitlines()) <= 400


@pytest.fixture(scope="module")
def chain14(tmp_path_factory, registry) -> Path:
    return chain_bundle(registry, tmp_path_factory.mktemp("wide") / "chain14.cgb", 14)


def _blocks(text: str) -> dict[str, dict[str, str]]:
    """The transposed tune table: {key label: {row name: cell}} over every block."""
    out: dict[str, dict[str, str]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("kernel  "):
            i += 1
            continue
        labels = re.split(r"\s{2,}", lines[i].strip())[1:]
        i += 2  # the header and its rule
        while i < len(lines) and lines[i].strip():
            cells = re.split(r"\s{2,}", lines[i].strip())
            if len(cells) != len(labels) + 1:
                break
            for label, cell in zip(labels, cells[1:]):
                out.setdefault(label, {})[cells[0]] = cell
            i += 1
    return out


def _values(label: str) -> list[int]:
    """``n=1, 2`` -> [1, 2]; ``n=5..7`` -> [5, 6, 7] (the labels group_rows writes)."""
    out: list[int] = []
    for part in label.partition("=")[2].split(", "):
        lo, _, hi = part.partition("..")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_tune_with_many_kernels_fits_80_columns(tmp_path, chain14):
    env = _env(tmp_path / "cache", "80")
    tuned = _engine(tmp_path, env, "tune", str(chain14), "--symbol", "n=1..12")
    assert tuned.returncode == 0, tuned.stderr
    lines = tuned.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(f"{len(x):3d} {x}" for x in lines)
    assert "tuned rows are also kept in the dispatch cache:" in tuned.stdout

    # The same choices as --json (every key is in the table now: all kept), table transposed.
    again = _engine(tmp_path, env, "tune", str(chain14), "--symbol", "n=1..12")
    doc = json.loads(_engine(tmp_path, env, "tune", str(chain14), "--symbol", "n=1..12", "--json").stdout)
    assert doc["kept"] == 12 and len(doc["multi_candidate_tasks"]) == 14
    columns = _blocks(again.stdout)
    assert columns, again.stdout
    seen = 0
    for label, cells in columns.items():
        assert cells["row"] == "kept"
        values = _values(label)
        keys = [k for k in doc["keys"] if k["symbols"]["n"] in values]
        assert len(keys) == int(cells["count"]), label
        seen += int(cells["count"])
        for key in keys:
            assert {t: cells[t] for t in doc["multi_candidate_tasks"]} == key["entries"], label
    assert seen == 12
    assert max(len(line) for line in again.stdout.splitlines()) <= 80


def test_tune_on_a_wide_terminal_keeps_a_column_per_kernel(tmp_path, chain14):
    env = _env(tmp_path / "cache", "400")
    tuned = _engine(tmp_path, env, "tune", str(chain14), "--symbol", "n=1..2")
    assert tuned.returncode == 0, tuned.stderr
    header = next(line for line in tuned.stdout.splitlines() if line.startswith("keys "))
    assert header.split() == ["keys", "count", *(f"double_{i}" for i in range(14)), "row"]
