"""Tuning is never silent (issue 24, item 5): a key that is tuned at run time is logged when its
tuning starts and ends, a long one is announced at WARNING before it starts with the ways to avoid
it, the graph's tuning listener follows it kernel by kernel, and the command line shows it on
stderr (a bar on a terminal, one line off a terminal when it is long) and never on stdout.

Real bundles (the example MLP, a chain of 14 two-candidate kernels), real kernels, real processes;
the long-tuning threshold is reached through its public setting (``ENGINE_TUNING_WARN_S``,
``Settings.tuning_warn_s``, ``TuningOptions.warn_s``), not by patching.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pty
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.runtime.tuning import TuningEvent, TuningOptions, estimate_tuning_s
from engine.settings import DEFAULT_TUNING_WARN_S, Settings
from support import TWICE_C, chain_bundle

TUNING = "engine.runtime.tuning"

@pytest.fixture
def fresh_registry(tmp_path):
    from support import make_registry

    return make_registry(tmp_path / "cache")


@pytest.fixture(scope="module")
def chain14(tmp_path_factory, registry) -> Path:
    return chain_bundle(registry, tmp_path_factory.mktemp("chain") / "chain14.cgb", 14)


def _tuning_records(caplog, level: int = logging.DEBUG) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == TUNING and r.levelno >= level]


# ---- the library -------------------------------------------------------------------------------
def test_a_new_key_logs_start_and_end_at_info_and_a_tuned_key_logs_nothing(caplog, mlp_bundle, fresh_registry):
    caplog.set_level(logging.DEBUG, logger="engine")
    graph = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    x = np.ones((3, 64), np.float32)
    graph.run_async([x])
    info = [r for r in _tuning_records(caplog, logging.INFO) if r.levelno == logging.INFO]
    assert len(info) == 2, [r.getMessage() for r in info]
    start, end = (r.getMessage() for r in info)
    # The start: the key, and how many candidates of how many kernels (the MLP's two matmuls).
    assert start.startswith(f"tuning {graph.identity[:16]} at {{'batch': 3}}: timing 4 candidates of 2 kernels")
    assert "estimated" in start
    # The end: the elapsed time, then the choice.
    assert end.startswith(f"tuned {graph.identity[:16]} at {{'batch': 3}} in ") and " s: chose candidates " in end
    # Both around the timing itself (the DEBUG lines of each timed instruction).
    messages = [r.getMessage() for r in _tuning_records(caplog)]
    timed = [i for i, m in enumerate(messages) if "candidate medians" in m]
    assert len(timed) == 2 and messages.index(start) < timed[0] and timed[-1] < messages.index(end)
    # The mlp's estimate is far below the default threshold: no warning.
    assert not _tuning_records(caplog, logging.WARNING)

    caplog.clear()
    for _ in range(3):  # the key has a row now: nothing is logged, at any level
        graph.run_async([x])
    assert _tuning_records(caplog) == []
    assert graph.run_stats().slow_runs == 1


def test_logging_basic_config_shows_the_tuning_lines(tmp_path, mlp_bundle):
    """What an application gets with ``logging.basicConfig(level=logging.INFO)``: the engine logger
    propagates to the root handler; the second run at the key adds nothing."""
    script = textwrap.dedent(r"""
        import logging, sys
        import numpy as np
        import engine
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        graph = engine.load_compiled_graph(sys.argv[1])
        x = np.ones((5, 64), np.float32)
        graph.run_async([x])
        print("second run", file=sys.stderr, flush=True)
        graph.run_async([x])
    """)
    env = {**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    for name in ("ENGINE_DISPATCH_POLICY", "ENGINE_DISPATCH_CACHE", "ENGINE_TUNING_WARN_S", "ENGINE_DEVICES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script, str(mlp_bundle)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    first, second = done.stderr.split("second run\n")
    lines = [line for line in first.splitlines() if line.startswith(TUNING)]
    assert len(lines) == 2, first
    assert lines[0].startswith(f"{TUNING} INFO tuning ") and "timing 4 candidates of 2 kernels" in lines[0]
    assert lines[1].startswith(f"{TUNING} INFO tuned ") and " in " in lines[1]
    assert TUNING not in second and done.stdout == ""


def test_a_long_tuning_is_announced_before_it_starts(caplog, mlp_bundle, tmp_path):
    caplog.set_level(logging.DEBUG, logger="engine")
    # The public setting (ENGINE_TUNING_WARN_S): every tuning counts as long.
    registry = Registry(Settings(cache_dir=tmp_path / "cache", tuning_warn_s=0.0))
    registry.load_entry_points()
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    assert graph.tuning.warn_s == 0.0
    events: list[TuningEvent] = []
    graph.tuning_listener = events.append
    graph.run_async([np.ones((6, 64), np.float32)])

    (warning,) = _tuning_records(caplog, logging.WARNING)
    text = warning.getMessage()
    assert "{'batch': 6}" in text and "4 candidates of 2 kernels" in text
    assert "ENGINE_DISPATCH_POLICY=nearest" in text and "ENGINE_DISPATCH_POLICY=first" in text
    assert "engine tune BUNDLE --symbol batch=6 --save" in text and "graph.tune(batch=6)" in text
    assert "ENGINE_TUNING_WARN_S" in text
    records = _tuning_records(caplog)
    first_timing = next(i for i, r in enumerate(records) if "candidate medians" in r.getMessage())
    assert records.index(warning) < first_timing  # said BEFORE any candidate was timed

    # The listener heard the same: start (long), one event per kernel, end.
    assert [e.phase for e in events] == ["start", "kernel", "kernel", "end"]
    start = events[0]
    assert start.long and not start.ahead_of_time and start.symbols == {"batch": 6}
    assert (start.kernels, start.candidates) == (2, 4)
    assert start.estimate_s == pytest.approx(estimate_tuning_s([2, 2], graph.tuning))
    assert [e.done for e in events[1:]] == [1, 2, 2]
    assert events[-1].elapsed_s >= events[1].elapsed_s > 0

    # Ahead of time (graph.tune is the advice itself): INFO lines and events, no warning.
    caplog.clear()
    events.clear()
    graph.tune(batch=[7])
    assert _tuning_records(caplog, logging.WARNING) == []
    assert any(r.getMessage().startswith("tuning ") for r in _tuning_records(caplog, logging.INFO))
    assert events[0].ahead_of_time and not events[0].long and events[-1].phase == "end"

    # A tuned key: the listener is not called again.
    events.clear()
    graph.run_async([np.ones((6, 64), np.float32)])
    assert events == []


def test_the_threshold_and_the_estimate(mlp_bundle, fresh_registry, caplog):
    caplog.set_level(logging.WARNING, logger="engine")
    options = TuningOptions()
    assert options.warn_s == DEFAULT_TUNING_WARN_S
    # The documented rule: candidates x repeat samples x min_sample_ms.
    assert estimate_tuning_s([2, 3], options) == pytest.approx(5 * options.repeat * options.min_sample_ms / 1e3)
    assert estimate_tuning_s([2, 3], attrs.evolve(options, repeat=10, min_sample_ms=4.0)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="warn_s"):
        TuningOptions(warn_s=-1)

    # The environment variable, read once into the settings.
    assert Settings.from_env({}).tuning_warn_s == DEFAULT_TUNING_WARN_S
    assert Settings.from_env({"ENGINE_TUNING_WARN_S": "0.5"}).tuning_warn_s == 0.5
    assert math.isinf(Settings.from_env({"ENGINE_TUNING_WARN_S": "inf"}).tuning_warn_s)
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(engine.InputError, match="ENGINE_TUNING_WARN_S"):
            Settings.from_env({"ENGINE_TUNING_WARN_S": bad})

    # Per graph: a threshold just above this key's estimate says nothing, one at it warns.
    graph = engine.load_compiled_graph(mlp_bundle, registry=fresh_registry)
    estimate = estimate_tuning_s([2, 2], graph.tuning)
    graph.tuning = attrs.evolve(graph.tuning, warn_s=estimate * 1.01)
    graph.run_async([np.ones((9, 64), np.float32)])
    assert _tuning_records(caplog, logging.WARNING) == []
    graph.tuning = attrs.evolve(graph.tuning, warn_s=estimate)
    graph.run_async([np.ones((10, 64), np.float32)])
    assert len(_tuning_records(caplog, logging.WARNING)) == 1


def test_a_failing_tuning_run_ends_its_events(fresh_registry):
    b = GraphBuilder("fails", registry=fresh_registry)
    x = b.input("x", "float32", ["n"])
    k = b.kernel("broken", entries=["twice_forward", "always_fails"], source=TWICE_C)
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    graph = b.build()
    events: list[TuningEvent] = []
    graph.tuning_listener = events.append
    with pytest.raises(engine.KernelError, match="code 7"):
        graph.run_async([np.ones(16, np.float32)])
    assert [e.phase for e in events] == ["start", "failed"]  # a display can close its bar


# ---- the command line --------------------------------------------------------------------------
def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("ENGINE_DEVICES", "ENGINE_DISPATCH_POLICY", "ENGINE_PLUGINS_AUTOLOAD", "ENGINE_DISPATCH_CACHE",
                 "ENGINE_TUNING_WARN_S", "COLUMNS"):
        env.pop(name, None)
    env["ENGINE_CACHE_DIR"] = str(tmp_path / "cli-cache")
    env["TERM"] = "xterm"
    env.update(extra)
    return env


def _engine(cwd: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


#: Commands that tune a new key on the way, with --json.
TUNING_COMMANDS = {
    "run": ["run", "BUNDLE", "--random", "--symbol", "n=4096", "--json"],
    "bench": ["bench", "BUNDLE", "--symbol", "n=4096", "--warmup", "0", "--repeat", "2", "--json"],
    "profile": ["profile", "BUNDLE", "--random", "--symbol", "n=4096", "--repeat", "2", "--json"],
    "trace": ["trace", "BUNDLE", "--random", "--symbol", "n=4096", "-o", "trace.json", "--json"],
}


@pytest.mark.parametrize("command", sorted(TUNING_COMMANDS))
def test_json_stdout_stays_pure_while_tuning(command, chain14, tmp_path):
    argv = [str(chain14) if a == "BUNDLE" else a for a in TUNING_COMMANDS[command]]
    # Off a terminal, a tuning under the threshold prints nothing at all ...
    quiet = _engine(tmp_path, _env(tmp_path / "quiet"), *argv)
    assert quiet.returncode == 0, quiet.stderr
    json.loads(quiet.stdout)  # the whole of stdout is one JSON document
    assert quiet.stderr == ""
    # ... and a long one (every tuning, with ENGINE_TUNING_WARN_S=0) exactly one line, on stderr.
    loud = _engine(tmp_path, _env(tmp_path / "loud", ENGINE_TUNING_WARN_S="0"), *argv)
    assert loud.returncode == 0, loud.stderr
    doc = json.loads(loud.stdout)
    if command == "run":
        assert doc["tuned"] is True
    (line,) = loud.stderr.splitlines()
    assert line.startswith(f"engine {command}: tuning n=4096: 28 candidates of 14 kernels, about ")
    assert "ENGINE_DISPATCH_POLICY=nearest" in line and "'engine tune'" in line
    assert "\x1b" not in loud.stderr and "\r" not in loud.stderr  # no bar off a terminal


def test_engine_v_shows_the_log_instead_of_the_notice(mlp_bundle, tmp_path):
    proc = _engine(tmp_path, _env(tmp_path, ENGINE_TUNING_WARN_S="0"), "-v", "run", str(mlp_bundle), "--random",
                   "--symbol", "batch=11", "--json")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(TUNING)]
    assert [line.split(":")[1].strip() for line in lines] == ["INFO", "WARNING", "INFO"], proc.stderr
    assert "engine run: tuning" not in proc.stderr  # not said twice


def _on_a_terminal(cwd: Path, env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    """Run ``engine`` with stderr on a pseudo-terminal and stdout on a pipe: (code, stdout, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read() if proc.stdout is not None else b""
    if proc.stdout is not None:
        proc.stdout.close()
    code = proc.wait(timeout=300)
    return code, out.decode(), b"".join(chunks).decode()


def test_progress_on_a_terminal(chain14, tmp_path):
    env = _env(tmp_path, ENGINE_TUNING_WARN_S="0")
    code, out, err = _on_a_terminal(tmp_path, env, "run", str(chain14), "--random", "--symbol", "n=2048", "--json")
    assert code == 0, err
    json.loads(out)  # stdout is still pure JSON
    # The notice stays on screen; the bar over the 14 kernels is drawn, then erased.
    assert err.startswith("engine run: tuning n=2048: 28 candidates of 14 kernels")
    assert "\rtuning n=2048 (28 candidates) [" in err and "14/14" in err
    assert err.endswith("\r\x1b[K")

    # engine tune: its bar over the keys carries the kernel count of the key being tuned; never a
    # warning (tuning ahead of time is the advice itself).
    code, out, err = _on_a_terminal(tmp_path, env, "tune", str(chain14), "--symbol", "n=1..3", "--json")
    assert code == 0, err
    assert json.loads(out)["tuned"] == 3
    assert "\rtuning [" in err and ": tuning kernel " in err and "/14" in err
    assert "ENGINE_DISPATCH_POLICY" not in err and err.endswith("\r\x1b[K")
