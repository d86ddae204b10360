"""The cache directory's size policy: what is in it, clearing, pruning, and a cap kept by its writers.

Everything the engine keeps under ``Settings.cache_dir`` is a cache: kernels compiled from source
(``cpu/build``), shared objects extracted where a platform cannot load from memory (``cpu/so``),
OpenCL program binaries (``opencl``), tuned dispatch rows (``dispatch``) and, when asked for,
tuning traces (``traces``). Any entry may disappear at any time and is rebuilt on the next miss;
readers verify what they read (``engine.backend.cachefiles``), so removing files is always safe.

**Entries.** A cache *entry* is a file and its side files (``<name>.sha256`` and the tag
``.auth/<name>``); they are counted and removed together. Lock files (``*.lock``) and temporaries
of killed writers (``.*.tmp*``) are not entries: ``prune`` removes those older than an hour. The
cache's secret (``.auth/secret``) and this module's own files are never removed.

**Recency.** Readers touch an entry's mtime on a disk hit (at most once a minute per entry), so an
entry's mtime is its last use: ``prune --older-than`` and the cap evict by it, least recently used
first. mtime rather than atime because most file systems mount with ``relatime``/``noatime``.

**The cap** (``ENGINE_CACHE_MAX_BYTES``, ``Settings.cache_max_bytes``, default 1 GiB, 0: none) is
kept by the writers themselves: each writer reports the bytes it wrote (``note_write``), and once a
process has written a tenth of the cap since its last check it scans the cache and, when it holds
more than 80% of the cap, evicts the least recently used entries down to 80%. Between two checks a
writer adds at most a tenth of the cap (plus its last file), so one writer keeps the cache under
the cap; several writing at once may each add their tenth. Checking by bytes written (not by time)
keeps it cheap, deterministic and proportional to growth. One process prunes at a time (a
non-blocking ``flock`` on ``.prune.lock``; a busy lock means someone else is pruning).

**Concurrent processes.** Removal is ``unlink``: a process that has an entry open or mapped keeps
its bytes (POSIX), kernels are loaded from memory (``engine.backend.native``), and a reader that
finds a file gone treats it as a miss. So eviction never breaks a process using an entry; at worst
a process rebuilds something that another evicted.

**Finding the cache root.** A writer that knows the cache directory passes it; others (trace
files) are attributed to the nearest ancestor holding ``CACHEDIR.TAG``, which the policy writes
into every cache root it sees written (the Cache Directory Tagging Specification, so that backup
tools also skip the cache).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path

import attrs

from engine.log import get_logger
from engine.safefiles import file_lock
from engine.settings import cache_max_bytes_from_env

__all__ = ["KindInfo", "CacheInfo", "PruneResult", "CachePolicy", "cache_info", "clear_cache", "prune_cache",
           "configure", "policy_for", "note_write", "touch", "is_read_only_error", "cache_writable",
           "read_only_cache", "report_read_only",
           "MARKER", "STALE_AFTER_S"]

log = get_logger("engine.cache")

#: The Cache Directory Tagging Specification's file (https://bford.info/cachedir/).
MARKER = "CACHEDIR.TAG"
_MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by engine (engine cache info).\n")
_PRUNE_LOCK = ".prune.lock"
#: What the top level of an engine cache holds (a directory per kind of entry); see ``_check_is_cache``.
_KNOWN_TOP_LEVEL = frozenset({"cpu", "cuda", "hip", "opencl", "template", "dispatch", "traces", _PRUNE_LOCK})
_SECRET = "secret"
#: Lock files and temporaries older than this are removed by ``prune`` (no writer holds them that long).
STALE_AFTER_S = 3600.0
#: A disk hit re-touches an entry at most this often.
_TOUCH_EVERY_S = 60.0
#: Writers check the cap after writing this fraction of it, and evict down to ``_LOW_WATER`` of it.
_CHECK_FRACTION = 10
_LOW_WATER = 0.8
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


# ---- what is in a cache -----------------------------------------------------------------------
@attrs.frozen
class KindInfo:
    """The entries of one kind (``cpu/build``, ``dispatch``, ``traces``, ...)."""

    kind: str
    entries: int
    bytes: int


@attrs.frozen
class CacheInfo:
    """``engine cache info``: where the cache is, how big, by kind, and its cap."""

    root: Path
    exists: bool
    writable: bool
    entries: int
    bytes: int
    #: The cap in bytes (0: none).
    max_bytes: int
    kinds: tuple[KindInfo, ...]


@attrs.frozen
class PruneResult:
    """What ``clear_cache``/``prune_cache`` removed and what is left."""

    removed_entries: int
    removed_bytes: int
    remaining_entries: int
    remaining_bytes: int


@attrs.define
class _Entry:
    kind: str
    files: list[Path]
    bytes: int = 0
    mtime: float = 0.0


def _kind(rel_dir: tuple[str, ...]) -> str:
    if not rel_dir:
        return "."
    if rel_dir[0] in ("traces", "dispatch") or len(rel_dir) == 1:
        return rel_dir[0]
    return f"{rel_dir[0]}/{rel_dir[1]}"


def _scan(root: Path) -> tuple[list[_Entry], list[tuple[Path, float]]]:
    """Every entry under ``root``, and the lock files and temporaries with their mtimes."""
    entries: dict[tuple[str, str], _Entry] = {}
    loose: list[tuple[Path, float]] = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        here = Path(directory)
        rel = here.relative_to(root).parts
        auth = bool(rel) and rel[-1] == ".auth"
        owner_rel = rel[:-1] if auth else rel
        for name in sorted(files):
            path = here / name
            try:
                st = os.lstat(path)
            except OSError:  # removed meanwhile
                continue
            if not rel and name in (MARKER, _PRUNE_LOCK):
                continue
            if auth and name == _SECRET:
                continue
            if name.endswith(".lock") or (name.startswith(".") and ".tmp" in name):
                loose.append((path, st.st_mtime))
                continue
            base = name[:-len(".sha256")] if name.endswith(".sha256") and not auth else name
            key = ("/".join(owner_rel), base)
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = _Entry(_kind(owner_rel), [])
            entry.files.append(path)
            entry.bytes += st.st_size
            entry.mtime = max(entry.mtime, st.st_mtime)
    return list(entries.values()), loose


def cache_writable(root: Path) -> bool:
    """Whether the cache directory ``root`` can be written (or created): its nearest existing
    ancestor is a writable directory on a file system mounted read-write."""
    probe = Path(root)
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK) and not _read_only_mount(probe)


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def cache_info(root: Path, max_bytes: int | None = None) -> CacheInfo:
    """What ``root`` holds (nothing when it does not exist), by kind; ``max_bytes``: the cap to show
    (default: the configured one)."""
    root = Path(root)
    cap = policy_for(root).max_bytes if max_bytes is None else max_bytes
    if not root.is_dir():
        return CacheInfo(root, False, cache_writable(root), 0, 0, cap, ())
    entries, _ = _scan(root)
    kinds: dict[str, list[int]] = {}
    for e in entries:
        count = kinds.setdefault(e.kind, [0, 0])
        count[0] += 1
        count[1] += e.bytes
    rows = tuple(KindInfo(k, n, b) for k, (n, b) in sorted(kinds.items()))
    return CacheInfo(root, True, cache_writable(root), len(entries), sum(e.bytes for e in entries), cap, rows)


def _remove(entry: _Entry) -> int:
    """Unlink an entry's files, data first (a reader then sees a miss, never a side file alone
    vouching for other bytes); the bytes freed."""
    freed = 0
    for path in sorted(entry.files, key=lambda p: (p.name.endswith(".sha256"), p.parent.name == ".auth")):
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
            freed += size
        except FileNotFoundError:
            continue
    return freed


def _prune_lock(root: Path, *, wait: bool) -> contextlib.AbstractContextManager[bool]:
    """Hold ``root/.prune.lock``; yields False (holding nothing) when ``wait`` is False and it is busy."""
    return file_lock(root / _PRUNE_LOCK, wait=wait)


def prune_cache(root: Path, *, older_than_s: float | None = None, max_bytes: int | None = None,
                wait: bool = True, now: float | None = None) -> PruneResult | None:
    """Remove entries unused for ``older_than_s`` seconds, then the least recently used ones until the
    cache holds at most ``max_bytes`` (0 or None: no limit).

    Stale lock files and temporaries go too. ``None`` when ``wait`` is False and another process is
    pruning. ``OSError`` when ``root`` cannot be written; ``InputError`` (nothing removed) when it
    does not look like an engine cache.
    """
    root = Path(root)
    if not root.is_dir():
        return PruneResult(0, 0, 0, 0)
    _check_is_cache(root)
    now = time.time() if now is None else now
    with _prune_lock(root, wait=wait) as held:
        if not held:
            return None
        entries, loose = _scan(root)
        for path, mtime in loose:
            if now - mtime > STALE_AFTER_S:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        entries.sort(key=lambda e: e.mtime)
        total = sum(e.bytes for e in entries)
        removed = freed = 0
        keep: list[_Entry] = []
        for e in entries:
            if older_than_s is not None and now - e.mtime > older_than_s:
                freed += _remove(e)
                removed += 1
            else:
                keep.append(e)
        left = total - freed
        if max_bytes and left > max_bytes:
            for e in keep:
                if left <= max_bytes:
                    break
                gone = _remove(e)
                freed += gone
                left -= e.bytes
                removed += 1
        remaining = len(entries) - removed
    if removed:
        log.debug("cache %s: removed %d entries (%d bytes); %d entries (%d bytes) left", root, removed, freed,
                 remaining, max(left, 0))
    return PruneResult(removed, freed, remaining, max(left, 0))


def _check_is_cache(root: Path) -> None:
    """Refuse to remove files from a directory that is not an engine cache (``ENGINE_CACHE_DIR=~`` by
    mistake): it must hold ``CACHEDIR.TAG``, or only what an engine cache holds (then it is tagged)."""
    if (root / MARKER).is_file():
        return
    names = set(os.listdir(root))
    if names <= _KNOWN_TOP_LEVEL:
        _ensure_marker(root)
        return
    from engine.errors import InputError

    strange = ", ".join(sorted(names - _KNOWN_TOP_LEVEL)[:3])
    raise InputError(f"{root} does not look like an engine cache directory (no {MARKER}; it holds {strange}): "
                     "nothing removed; check ENGINE_CACHE_DIR")


def clear_cache(root: Path) -> PruneResult:
    """Remove every entry (and stale locks and temporaries); the cache's secret stays."""
    result = prune_cache(root, older_than_s=float("-inf"))
    assert result is not None  # waited for the lock
    return result


# ---- the cap, kept by writers -----------------------------------------------------------------
class CachePolicy:
    """The cap of one cache root and the bytes this process wrote there since it last checked."""

    def __init__(self, root: Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._pending = 0
        self._marked = False
        self._lock = threading.Lock()

    def note_write(self, nbytes: int) -> None:
        """Count ``nbytes`` written under the root; check the cap when a tenth of it was written."""
        if not self._marked:
            self._marked = True
            _ensure_marker(self.root)
        cap = self.max_bytes
        if cap <= 0:
            return
        with self._lock:
            self._pending += max(int(nbytes), 1)
            if self._pending < max(cap // _CHECK_FRACTION, 1):
                return
            self._pending = 0
        self.enforce()

    def enforce(self) -> PruneResult | None:
        """Evict least recently used entries down to 80% of the cap if the cache holds more (skipped
        when another process is pruning); never raises."""
        if self.max_bytes <= 0:
            return None
        try:
            result = prune_cache(self.root, max_bytes=max(int(self.max_bytes * _LOW_WATER), 1), wait=False)
        except OSError as exc:
            log.debug("cache %s: cannot check the size cap: %s", self.root, exc)
            return None
        if result is not None and result.removed_entries:
            log.info("cache %s over its cap of %d bytes: evicted %d least recently used entries (%d bytes)",
                     self.root, self.max_bytes, result.removed_entries, result.removed_bytes)
        return result


_policies: dict[Path, CachePolicy] = {}
_configured: dict[Path, int] = {}
_roots: dict[Path, Path] = {}
_reported: set[Path] = set()
_registry_lock = threading.Lock()


def _key(root: Path) -> Path:
    return Path(os.path.abspath(root))


def configure(root: Path, *, max_bytes: int) -> None:
    """Set the cap of the cache at ``root`` for this process (``Registry`` does, from its ``Settings``)."""
    key = _key(root)
    with _registry_lock:
        _configured[key] = max_bytes
        policy = _policies.get(key)
        if policy is not None:
            policy.max_bytes = max_bytes


def policy_for(root: Path) -> CachePolicy:
    """The policy of the cache at ``root``: its configured cap, else ``ENGINE_CACHE_MAX_BYTES``."""
    key = _key(root)
    with _registry_lock:
        policy = _policies.get(key)
        if policy is None:
            cap = _configured.get(key)
            if cap is None:
                try:
                    cap = cache_max_bytes_from_env()
                except ValueError as exc:  # reported where Settings are read; here keep the default
                    log.warning("%s; using the default cap", exc)
                    from engine.settings import DEFAULT_CACHE_MAX_BYTES
                    cap = DEFAULT_CACHE_MAX_BYTES
            policy = _policies[key] = CachePolicy(key, cap)
        return policy


def _ensure_marker(root: Path) -> None:
    path = root / MARKER
    if not path.exists():
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(_MARKER_TEXT)


def _find_root(directory: Path) -> Path | None:
    """The nearest ancestor of ``directory`` (itself included, 4 levels) holding ``CACHEDIR.TAG``."""
    key = _key(directory)
    with _registry_lock:
        known = _roots.get(key)
    if known is not None:
        return known
    for candidate in (key, *list(key.parents)[:4]):
        if (candidate / MARKER).is_file():
            with _registry_lock:
                _roots[key] = candidate
            return candidate
    return None


def note_write(path: Path, nbytes: int, *, root: Path | None = None) -> None:
    """A writer published ``nbytes`` at ``path`` in the cache at ``root`` (default: found by its
    ``CACHEDIR.TAG``; nothing happens outside a cache). May evict other entries; never raises."""
    if root is None:
        root = _find_root(Path(path).parent)
        if root is None:
            return
    policy_for(root).note_write(nbytes)


def touch(path: Path) -> None:
    """Mark a cache entry as used now (its mtime; at most once a minute); best effort."""
    try:
        if time.time() - os.stat(path).st_mtime > _TOUCH_EVERY_S:
            os.utime(path)
    except OSError:
        pass


# ---- read-only caches -------------------------------------------------------------------------
def is_read_only_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a cache path is read-only (read-only file system, no permission): a
    deployment choice, worth one log line rather than a warning."""
    return isinstance(exc, OSError) and exc.errno in _READ_ONLY_ERRNOS


def read_only_cache(exc: BaseException, root: Path) -> bool:
    """Whether ``exc``, raised writing into the cache at ``root``, means the cache cannot be written at
    all (a read-only deployment: read-only file system or home, no permission, a file where the
    cache or one of its parents should be), so callers carry on without it. A full disk, or a
    damaged entry inside a writable cache, is not: it is a fault to fix, and callers report it."""
    return isinstance(exc, OSError) and (is_read_only_error(exc) or not cache_writable(root))


def report_read_only(root: Path, exc: BaseException) -> None:
    """Say once per process and cache root that the cache cannot be written, and what happens instead."""
    key = _key(root)
    with _registry_lock:
        if key in _reported:
            return
        _reported.add(key)
    log.warning("cache %s is read-only (%s): what it holds is used, shared objects load from memory, and what is "
                "built meanwhile is kept in memory only", root, getattr(exc, "strerror", None) or exc)
