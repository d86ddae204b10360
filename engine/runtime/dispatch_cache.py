"""Dispatch rows tuned at run time, persisted per bundle under the cache directory (issue 4).

``<cache_dir>/dispatch/<identity>.txt`` holds the rows in the bundle's ``dispatch_table.txt``
format. The identity excludes the bundle's own dispatch table, so re-saving a tuned bundle keeps
using the same cache file.

Several processes may tune the same bundle at once. Each write therefore

1. takes an exclusive lock on ``<identity>.txt.lock`` (``engine.safefiles.file_lock``),
   which serializes writers without blocking readers;
2. re-reads the current file under the lock and merges its rows with the new ones (the new rows
   win for a key both have), so no writer loses another's rows;
3. writes the merged table to a temporary file beside it and ``os.replace``s it over the
   old one, so readers (which never lock) see the old table or the new one, never a mix. A writer
   killed before the rename leaves its ``.<file>.tmp-<12 hex>``; only lock holders write those, so
   the next writer, holding the lock, removes them.

A file that cannot be parsed (truncated, garbled, another graph's header, an index out of range)
is reported once per graph with a ``DispatchCacheWarning`` naming the file and line, and ignored:
its keys are tuned again, and the next write replaces it with a valid table. A cache directory
that cannot be written is also reported once; tuning still works, it is just not kept. A
*read-only* one (read-only file system or home, no permission: a deployment choice, see
``engine.cache.read_only_cache``) is said once in the
``engine.cache`` log instead of a warning. Loading touches the file (its last use, which the
cache's size cap evicts by) and storing reports its size to ``engine.cache``.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Mapping, Sequence

from engine.bundle.dispatch_text import format_dispatch_table, parse_dispatch_table
from engine.cache import note_write, read_only_cache, report_read_only, touch
from engine.errors import BundleError
from engine.log import get_logger
from engine.safefiles import atomic_write, file_lock, remove_abandoned

__all__ = ["DispatchCache", "DispatchCacheWarning"]

Key = tuple[int, ...]
Choice = tuple[int, ...]

log = get_logger("engine.runtime.dispatch_cache")


class DispatchCacheWarning(RuntimeWarning):
    """A dispatch cache file was unreadable (ignored) or could not be written (tuning not kept)."""


class DispatchCache:
    """The cache file of one bundle identity, for one graph's symbols and candidate counts."""

    def __init__(self, cache_dir: str | os.PathLike, identity: str, symbols: Sequence[str],
                 candidates_per_task: Sequence[int], device_tag: str = ""):
        # The choice that is fastest depends on the device as much as on the bundle: rows tuned on one
        # GPU model (or CPU) must not be served on another, so the file name carries both.
        stem = f"{identity}.{device_tag}" if device_tag else identity
        self.cache_dir = Path(cache_dir)
        self.directory = self.cache_dir / "dispatch"
        self.path = self.directory / f"{stem}.txt"
        self.lock_path = self.directory / f"{stem}.txt.lock"
        self.symbols = tuple(symbols)
        self.candidates_per_task = tuple(candidates_per_task)
        #: Problems reported so far (each is warned about once per graph).
        self.problems: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<DispatchCache {self.path}>"

    # -- reading -------------------------------------------------------------------------------
    def _parse(self, text: str) -> dict[Key, Choice]:
        return parse_dispatch_table(text, symbols=self.symbols, candidates_per_task=self.candidates_per_task,
                                    member=str(self.path))

    def _read(self) -> tuple[dict[Key, Choice], str | None]:
        """The file's rows and, when it is unusable, why (rows are then empty)."""
        try:
            data = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # nothing cached yet (a bad directory shows at write)
            return {}, None
        except OSError as exc:
            return {}, f"dispatch cache {self.path} cannot be read ({exc}); ignored"
        try:
            return self._parse(data.decode("utf-8")), None
        except UnicodeDecodeError as exc:
            where = data.count(b"\n", 0, exc.start) + 1
            return {}, (f"dispatch cache {self.path}: line {where} is not UTF-8 text; ignored, its keys will be "
                        f"tuned again")
        except BundleError as exc:
            return {}, f"dispatch cache {exc}; ignored, its keys will be tuned again"

    def report(self, problem: str) -> None:
        """Warn (``DispatchCacheWarning``) about ``problem`` unless it was reported already."""
        with self._lock:
            if problem in self.problems:
                return
            self.problems.append(problem)
        warnings.warn(DispatchCacheWarning(problem), stacklevel=4)

    def load(self) -> dict[Key, Choice]:
        """The cached rows; an unusable file is reported once and read as empty."""
        rows, problem = self._read()
        if problem is not None:
            self.report(problem)
        elif rows:
            touch(self.path)
            log.debug("dispatch cache %s: %d rows loaded", self.path, len(rows))
        return rows

    # -- writing -------------------------------------------------------------------------------
    def store(self, rows: Mapping[Key, Choice]) -> dict[Key, Choice]:
        """Merge ``rows`` into the file (locked, atomic) and return every row the file now holds.

        The returned rows include those other processes stored, so a caller can adopt them. A
        file that cannot be written is reported once; ``rows`` alone are returned then.
        """
        if not rows:
            return self.rows()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._lock, file_lock(self.lock_path):
                self._remove_abandoned_temporaries()
                current, problem = self._read()
                if problem is not None:  # replaced below by a valid table
                    self._report_unlocked(problem)
                current.update(rows)
                # No fsync: readers only ever see a whole file (rename), and after a crash the
                # worst case is a lost or unreadable cache, which is reported and retuned. An
                # fsync per tuned key would cost more than tuning a small kernel (issue 4).
                text = format_dispatch_table(self.symbols, current)
                atomic_write(self.path, text, fsync=False)
        except OSError as exc:
            if read_only_cache(exc, self.cache_dir):
                report_read_only(self.cache_dir, exc)
            else:
                self.report(f"dispatch cache {self.path} cannot be written ({exc}); tuned rows are kept in memory only")
            return dict(rows)
        note_write(self.path, len(text), root=self.cache_dir)
        return current

    def _remove_abandoned_temporaries(self) -> None:
        """Delete temporaries of writers that died mid-write (call with the file lock held).

        Every writer of this file holds the lock while its temporary exists, so with the lock held
        any temporary of this file belongs to a writer that was killed. Best effort.
        """
        remove_abandoned(self.path)

    def _report_unlocked(self, problem: str) -> None:
        # Called with self._lock held: record and warn without re-taking it.
        if problem not in self.problems:
            self.problems.append(problem)
            warnings.warn(DispatchCacheWarning(problem), stacklevel=5)

    def rows(self) -> dict[Key, Choice]:
        """Read the file now (no warning): what every process has stored so far."""
        return self._read()[0]
