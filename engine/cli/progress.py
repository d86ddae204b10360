"""A tiny progress bar for long work (tuning, verifying, benchmarks), drawn on stderr.

It draws only when stderr is a terminal (and ``TERM`` is not ``dumb``), so pipes, log files, CI
and ``--json`` consumers never see control characters; when it is done it erases its line, so the
command's real output is all that stays on screen. No dependency, no thread: the caller advances
it, and redraws are throttled to a few per second so that tight loops (benchmark samples) pay
nothing measurable.

``TuningDisplay`` is what ``run``, ``bench``, ``profile``, ``trace`` and ``tune`` show while a key
is tuned (it is the graph's ``tuning_listener``): a bar over the key's kernels on a terminal, or
the kernel count in the note of the command's own bar; and, on a terminal or not, one line when
the library says a key's tuning is expected to be long (docs/cli.md, "Tuning on the way").
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any

from engine.runtime.report import format_bytes

if TYPE_CHECKING:
    from engine.runtime.tuning import TuningEvent

__all__ = ["Progress", "TuningDisplay", "watch_tuning"]

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

    def say(self, text: str) -> None:
        """Write ``text`` as a line of its own on the bar's stream (terminal or not); a drawn bar is
        erased first and drawn again below it."""
        drawn = self._drawn
        if drawn:
            self._stream.write("\r\x1b[K")
        self._stream.write(text + "\n")
        self._stream.flush()
        if drawn:
            self._draw()


class TuningDisplay:
    """A graph's ``tuning_listener`` for a command: what the command line shows while a key is tuned.

    ``bar`` is the command's own bar (``bench``, ``tune``): the key and its kernel count go into its
    note. Without one, a bar of its own over the key's kernels, on a terminal only. When the
    library found a key's tuning long (``TuningEvent.long``: it logged its WARNING), one line on
    stderr, terminal or not, unless ``notices`` is false (``engine -v``, whose log shows the WARNING).
    """

    def __init__(self, command: str, *, bar: Progress | None = None, stream: IO[str] | None = None,
                 notices: bool = True):
        self.command = command
        self.outer = bar
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self._stream)
        self.notices = notices
        self._bar: Progress | None = None
        self._note = ""

    def __call__(self, event: "TuningEvent") -> None:
        key = ", ".join(f"{k}={v}" for k, v in event.symbols.items()) or "the static shapes"
        if event.phase == "start":
            if event.long and self.notices:
                kernels = f"{event.kernels} kernel{'' if event.kernels == 1 else 's'}"
                self._say(f"engine {self.command}: tuning {key}: {event.candidates} candidates of {kernels}, "
                          f"about {_seconds(event.estimate_s)}; ENGINE_DISPATCH_POLICY=nearest or "
                          f"'engine tune' ahead of time avoid tuning at run time")
            if self.outer is not None:
                self._note = self.outer.note
                self.outer.update(self.outer.done, f"{key}: tuning kernel 0/{event.kernels}")
            elif self.enabled:
                self._bar = Progress(event.kernels, f"tuning {key} ({event.candidates} candidates)",
                                     stream=self._stream, enabled=True)
                self._bar.update(0)
        elif event.phase == "kernel":
            if self.outer is not None:
                self.outer.update(self.outer.done, f"{key}: tuning kernel {event.done}/{event.kernels}")
            elif self._bar is not None:
                self._bar.update(event.done)
        else:  # "end" or "failed"
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self.outer is not None:
                self.outer.update(self.outer.done, self._note)

    def _say(self, text: str) -> None:
        if self.outer is not None:
            self.outer.say(text)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.0f} s"


def watch_tuning(graph: Any, args: Any, *, bar: Progress | None = None) -> TuningDisplay:
    """Make a ``TuningDisplay`` the graph's tuning listener for the command in ``args``."""
    display = TuningDisplay(getattr(args, "command", None) or "run", bar=bar,
                            notices=not getattr(args, "log_verbosity", 0))
    graph.tuning_listener = display
    return display


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



