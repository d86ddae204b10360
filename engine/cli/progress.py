"""A tiny progress bar for long work (tuning, verifying, benchmarks), drawn on stderr.

It draws only when stderr is a terminal (and ``TERM`` is not ``dumb``), so pipes, log files, CI
and ``--json`` consumers never see control characters; when it is done it erases its line, so the
command's real output is all that stays on screen. No dependency, no thread: the caller advances
it, and redraws are throttled to a few per second so that tight loops (benchmark samples) pay
nothing measurable.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO

from engine.runtime.report import format_bytes

__all__ = ["Progress"]

_MIN_INTERVAL_S = 0.1
_BAR_WIDTH = 24


class Progress:
    """``with Progress(total, "tuning") as bar: bar.advance(1, "batch=8")``; ``unit="B"`` counts bytes."""

    def __init__(self, total: int, label: str, *, stream: IO[str] | None = None, enabled: bool | None = None,
                 unit: str = ""):
        self.total = max(int(total), 0)
        self.label = label
        self.unit = unit
        self.done = 0
        self.note = ""
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self._stream) if enabled is None else enabled
        self._last = 0.0
        self._drawn = False
        self._start = time.monotonic()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, amount: int = 1, note: str | None = None) -> None:
        self.update(self.done + amount, note)

    def update(self, done: int, note: str | None = None) -> None:
        self.done = min(done, self.total) if self.total else done
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < _MIN_INTERVAL_S and self.done < self.total:
            return
        self._last = now
        self._draw()

    def line(self) -> str:
        """The bar as text (what is drawn), e.g. ``tuning [######......] 12/48 batch=12``."""
        if self.total:
            filled = int(_BAR_WIDTH * self.done / self.total)
            bar = "[" + "#" * filled + "." * (_BAR_WIDTH - filled) + "]"
            fmt = format_bytes if self.unit == "B" else str
            count = f"{fmt(self.done)}/{fmt(self.total)}"
            text = f"{self.label} {bar} {count}"
        else:
            text = f"{self.label} {self.done}"
        elapsed = time.monotonic() - self._start
        if elapsed >= 1.0:
            text += f" {elapsed:.0f}s"
        if self.note:
            text += f" {self.note}"
        return text

    def _draw(self) -> None:
        width = _columns() - 1
        text = self.line()[:width]
        self._stream.write("\r" + text + "\x1b[K")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the bar (only if one was drawn)."""
        if self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False


def _is_terminal(stream: IO[str]) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or exotic streams
        return False


def _columns() -> int:
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 80
    return max(columns, 20) if columns else 80  # 0 when the terminal does not say



