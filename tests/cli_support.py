"""What the command-line tests share: a clean environment, running ``engine`` as a subprocess, and
the one-line error every refusal must be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: Settings a developer's shell may hold that would change what the commands print.
USER_SETTINGS = ("ENGINE_DEVICES", "ENGINE_DISPATCH_POLICY", "ENGINE_PLUGINS_AUTOLOAD", "ENGINE_DISPATCH_CACHE",
                 "ENGINE_MAX_PLANNED_BYTES", "ENGINE_TUNING_WARN_S", "PYTHONPATH")

#: A one-node ONNX model (y = Relu(x), x and y float32 [1, 4], opset 13), serialised, so the tests need no onnx import.
RELU_ONNX = (b'\x08\x08:;\n\x0c\n\x01x\x12\x01y"\x04Relu\x12\x01gZ\x13\n\x01x\x12\x0e\n\x0c\x08\x01\x12'
             b'\x08\n\x02\x08\x01\n\x02\x08\x04b\x13\n\x01y\x12\x0e\n\x0c\x08\x01\x12\x08\n\x02\x08\x01'
             b'\n\x02\x08\x04B\x04\n\x00\x10\r')


def cli_env(cache_dir: Path) -> dict[str, str]:
    """This process's environment without ``USER_SETTINGS``, with its own cache directory."""
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    env["ENGINE_CACHE_DIR"] = str(cache_dir)
    return env


def engine_cli(work: Path, env: dict[str, str], *argv: str, **extra: str) -> subprocess.CompletedProcess:
    """``engine ARGV`` in a new process in ``work``; ``extra`` adds environment variables."""
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=work, env={**env, **extra},
                          capture_output=True, text=True, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The one stderr line of a refused command (no traceback, no internal error)."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"engine {command}: error: "), proc.stderr
    assert "internal error" not in lines[0] and "Traceback" not in proc.stderr
    return lines[0]
