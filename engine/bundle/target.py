"""Whether a save may replace what is at its target: a bundle yes, anything else only when asked.

A save replaces its target atomically, and replacing means deleting what was there. That is right
for an older bundle (re-saving, re-converting) and wrong for anything else: ``-o models/`` naming a
directory of the user's files, ``-o model.onnx`` naming the model being converted, a typo that
names a document. So a target that exists must open as a bundle (a zip or directory whose manifest
lists exactly what is there), be an empty directory (nothing to lose), or the caller must pass an
explicit overwrite; otherwise the save is refused with ``SaveTargetError`` before anything is written.

The check opens the target with the same reader that loads bundles, passed in by the saver
(``engine.bundle.save``, as ``probe``), so "is a bundle" means one thing everywhere and this module
depends on no reader.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from engine.errors import BundleError, SaveTargetError

__all__ = ["check_replaceable", "same_file"]

#: Opens ``path`` as a bundle and closes it again; raises ``BundleError`` (or ``OSError``) when it is none.
BundleProbe = Callable[[Path], None]


def _what_is_there(target: Path, probe: BundleProbe) -> str | None:
    """Why ``target`` is not replaceable without an overwrite, in words; None when it is."""
    if not os.path.lexists(target):
        return None
    if target.is_dir():
        try:
            entries = sorted(os.listdir(target))
        except OSError as exc:
            return f"a directory that cannot be listed ({exc.strerror or exc})"
        if not entries:
            return None
    try:
        probe(target)
    except (BundleError, OSError) as exc:
        if target.is_dir():
            shown = ", ".join(repr(e) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
            count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
            return f"a directory that is not a bundle ({count}: {shown}; {_first_line(exc)})"
        kind = "a file" if target.is_file() else "something"
        return f"{kind} that is not a bundle ({_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.removeprefix("not a bundle: ")
    return text if len(text) <= 160 else text[:157] + "..."


def check_replaceable(target: Path, *, overwrite: bool, probe: BundleProbe) -> None:
    """Refuse (``SaveTargetError``) to save over an existing ``target`` that is not a bundle, unless
    ``overwrite``; an absent target, an empty directory and a bundle pass."""
    if overwrite:
        return
    reason = _what_is_there(target, probe)
    if reason is not None:
        path = os.fspath(target)
        raise SaveTargetError(f"refusing to save the bundle to {path!r}: it is {reason}; nothing was written "
                              "(choose another path, or pass overwrite=True to replace it)",
                              path=path, reason=reason)


def same_file(a: "str | os.PathLike[str]", b: "str | os.PathLike[str]") -> bool:
    """Whether ``a`` and ``b`` name the same existing file or directory (links and spellings aside)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
