"""The ``engine`` logger: what a service operator needs to see, silent unless the application asks.

Every module logs under a child of ``engine`` (``engine.plugins``, ``engine.cache``,
``engine.runtime.tuning``, ``engine.cpu.program``, ...), so one ``logging.getLogger("engine")``
configures them all. A library must never configure the root logger nor print on its own: the
``engine`` logger carries a ``NullHandler`` (the logging HOWTO's advice for libraries), which also
keeps Python's last-resort handler from printing warnings to stderr when the application set up no
logging. ``engine -v`` / ``-vv`` (the CLI) attaches a stderr handler to ``engine`` at INFO / DEBUG.

Levels: INFO for what changes the process's state in a way an operator may want to know (a plugin
loaded or failed, a key's tuning starting and ending, cache evictions, a read-only cache, workspace
growth); WARNING for what asks for action (a plugin that failed, a read-only cache, a tuning at run
time estimated to be long: ``engine.runtime.tuning``); DEBUG for the per-entry detail (cache hits
and misses, each timed candidate).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["ROOT", "get_logger", "enable_stderr"]

#: The name of the logger every engine module logs under.
ROOT = "engine"

logging.getLogger(ROOT).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger for ``name`` (``"engine.cache"``; a plugin's ``"engine.cpu.program"``).

    Names outside ``engine`` are put under it so that one logger configures everything.
    """
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def enable_stderr(verbosity: int, stream: TextIO | None = None) -> logging.Handler | None:
    """Show ``engine`` records on ``stream`` (stderr): INFO for ``verbosity`` 1, DEBUG for 2 or more.

    For command-line tools; an application configures ``logging`` itself. Returns the handler
    (``None`` for ``verbosity`` 0, which changes nothing).
    """
    if verbosity <= 0:
        return None
    logger = logging.getLogger(ROOT)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    level = logging.INFO if verbosity == 1 else logging.DEBUG
    handler.setLevel(level)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return handler
