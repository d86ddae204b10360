"""Logging under the ``engine`` logger (issue 14): one record per thing a service operator needs to
see, and nothing at all unless the application (or ``engine -v``) asks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

import engine
from engine.backend.cachefiles import BuildCache
from engine.cache import note_write
from engine.plugins import Registry
from engine.settings import Settings

from engine_cpu import CpuBackend


class BrokenPlugin:
    """A real plugin object whose hook fails, as a plugin with a bug would."""

    @engine.hookimpl
    def engine_backends(self, settings):
        raise RuntimeError("the accelerator's driver library is missing")


def _records(caplog, logger: str, level: int = logging.DEBUG) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= level]


def _registry(cache: Path, **settings) -> Registry:
    registry = Registry(Settings(cache_dir=cache, **settings))
    registry.load_entry_points()
    return registry


def test_plugin_discovery_and_failures(caplog, tmp_path):
    caplog.set_level(logging.DEBUG, logger="engine")
    registry = _registry(tmp_path)
    (found,) = [r for r in _records(caplog, "engine.plugins") if r.levelno == logging.DEBUG]
    assert "'engine.devices' entry points" in found.getMessage() and "cpu" in found.getMessage()
    loaded = [r.getMessage() for r in _records(caplog, "engine.plugins", logging.INFO)]
    assert any("device kind 'cpu' provided by plugin 'cpu' (engine-cpu" in m for m in loaded), loaded
    caplog.clear()
    registry.register_plugin(BrokenPlugin(), name="accel")
    (failed,) = _records(caplog, "engine.plugins", logging.WARNING)
    assert failed.levelno == logging.WARNING
    assert "plugin 'accel'" in failed.getMessage() and "driver library is missing" in failed.getMessage()
    assert failed.exc_info is not None  # the traceback goes to the log's handlers, not to stderr


def test_tuning_decisions_and_workspace_growth(caplog, tmp_path, mlp_bundle):
    caplog.set_level(logging.DEBUG, logger="engine")
    graph = engine.load_compiled_graph(mlp_bundle, registry=_registry(tmp_path))
    graph.tuning = attrs.evolve(graph.tuning, warmup=1, repeat=1, min_sample_ms=0.0)
    graph.run_async([np.ones((3, 64), np.float32)])
    # INFO: the tuning's start (test_tuning_notices.py), then the decision, with the elapsed time.
    started, decision = _records(caplog, "engine.runtime.tuning", logging.INFO)
    assert started.getMessage().startswith("tuning ") and decision.getMessage().startswith("tuned ")
    row = graph.dispatch_table[(3,)]
    message = decision.getMessage()
    assert "{'batch': 3}" in message and f"chose candidates {list(row)}" in message
    assert "task 0: medians [" in message and "task 2: medians [" in message  # both matmuls' timings
    steps = [r.getMessage() for r in _records(caplog, "engine.runtime.tuning") if r.levelno == logging.DEBUG]
    assert len(steps) == 2 and all("candidate medians" in m and "chose candidate" in m for m in steps)
    (grown,) = _records(caplog, "engine.runtime.workspace", logging.INFO)
    assert "the cpu workspace at batch=3 on cpu:0: allocated" in grown.getMessage()
    caplog.clear()
    graph.run_async([np.ones((2, 64), np.float32)])  # smaller: the workspace does not grow
    assert _records(caplog, "engine.runtime.workspace") == []
    graph.run_async([np.ones((40, 64), np.float32)])
    assert len(_records(caplog, "engine.runtime.workspace", logging.INFO)) == 1


SOURCE = r"""
#include <stdint.h>
int32_t neg(void *const *t, const int64_t *sym, void *ws) { return 0; }
"""


def test_cache_hits_misses_and_evictions(caplog, tmp_path):
    caplog.set_level(logging.DEBUG, logger="engine")
    CpuBackend(cache_dir=tmp_path).compile(SOURCE, "c")
    messages = [r.getMessage() for r in _records(caplog, "engine.cache")]
    assert any(": miss " in m for m in messages) and any(": stored " in m for m in messages), messages
    caplog.clear()
    CpuBackend(cache_dir=tmp_path).compile(SOURCE, "c")  # a fresh backend: found on disk
    messages = [r.getMessage() for r in _records(caplog, "engine.cache")]
    assert any(": hit " in m for m in messages) and not any(": miss " in m for m in messages), messages

    caplog.clear()
    cache = tmp_path / "capped"
    _registry(cache, cache_max_bytes=20_000)  # configures the cap of this cache directory
    for i in range(4):  # 8 kB each through a real writer: two entries are over 80% of the cap
        BuildCache(cache / "blobs", ".bin", cache_root=cache).put(f"key{i}", bytes([i]) * 8000)
    evicted = _records(caplog, "engine.cache", logging.INFO)
    assert len(evicted) == 3  # at the second, third and fourth write, the oldest entry went
    assert all("over its cap of 20000 bytes: evicted 1 least recently used entries" in r.getMessage()
               for r in evicted)
    assert sorted(p.name for p in (cache / "blobs").glob("*.bin")) == ["key3.bin"]


def test_a_read_only_cache_is_said_once(caplog, tmp_path):
    caplog.set_level(logging.DEBUG, logger="engine")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory's parent should be")
    backend = CpuBackend(cache_dir=blocker / "cache")
    for variant in ("1", "2"):
        (payload,) = backend.compile(SOURCE.replace("return 0", f"return {variant} - {variant}"), "c")
        assert bytes(payload.data)[:4] == b"\x7fELF"  # compiled in a private temporary directory
    (said,) = [r for r in _records(caplog, "engine.cache", logging.WARNING)]
    assert "is read-only" in said.getMessage() and str(blocker / "cache") in said.getMessage()


QUIET = textwrap.dedent(r"""
    import logging, sys
    from pathlib import Path
    import numpy as np
    import engine
    from engine.plugins import Registry
    from engine.settings import Settings

    class Broken:
        @engine.hookimpl
        def engine_backends(self, settings):
            raise RuntimeError("broken on purpose")

    cache = Path(sys.argv[1]) / "file-in-the-way" / "cache"  # read-only: said at WARNING level
    registry = Registry(Settings(cache_dir=cache, cache_max_bytes=1))
    registry.load_entry_points()
    registry.register_plugin(Broken(), name="broken")  # a plugin failure: WARNING with a traceback
    graph = engine.load_compiled_graph(sys.argv[2], registry=registry)
    graph.run_async([np.ones((3, 64), np.float32)])  # tuning, workspace, cache records
    assert isinstance(logging.getLogger("engine").handlers[0], logging.NullHandler)
    assert logging.getLogger().handlers == []  # the root logger is the application's
""")


def test_nothing_is_printed_by_default(tmp_path, mlp_bundle):
    (tmp_path / "file-in-the-way").write_text("x")
    done = subprocess.run([sys.executable, "-c", QUIET, str(tmp_path), str(mlp_bundle)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


@pytest.mark.parametrize("flag, shown", [((), None), (("-v",), logging.INFO), (("-vv",), logging.DEBUG)])
def test_cli_verbose_shows_the_log_on_stderr(tmp_path, flag, shown):
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", *flag, "devices", "--json"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    if shown is None:
        assert lines == []
        return
    assert "engine.plugins: INFO: device kind 'cpu' provided by plugin 'cpu'" in done.stderr
    assert any(line.startswith("engine.plugins: DEBUG: discovering plugins") for line in lines) == (
        shown == logging.DEBUG)
    assert all(line.startswith("engine.") for line in lines), lines
