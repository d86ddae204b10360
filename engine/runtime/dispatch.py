"""The dispatch table: which candidate each task uses at each key (symbol values).

Rows come from the bundle (``dispatch_table.txt``), from the on-disk cache of rows tuned earlier
(``engine.runtime.dispatch_cache``; only for keys the bundle lacks), and from tuning in this
process. Lookups happen once per key per thread (the fast path caches the prepared run), so a lock
around updates is cheap. Policies (``tune``, ``first``, ``nearest``, ``error``) decide what a key
without a row gets; the graph applies them (``CompiledGraph._choice_for``).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Mapping, Sequence

from engine.bundle.dispatch_text import format_dispatch_table
from engine.errors import InputError
from engine.settings import DISPATCH_POLICIES

__all__ = ["DispatchTable"]

Key = tuple[int, ...]
Choice = tuple[int, ...]

#: Where a row came from (``DispatchTable.source``).
SOURCES = ("bundle", "cache", "tuned", "manual")


class DispatchTable(Mapping[Key, Choice]):
    """Tuned rows (persisted) plus per-policy choices (not persisted: they were not measured)."""

    def __init__(self, symbols: Sequence[str], candidates_per_task: Sequence[int],
                 rows: Mapping[Key, Choice] | None = None, policy: str = "tune",
                 on_change: Callable[[], None] | None = None):
        self.symbols = tuple(symbols)
        #: Called when ``record`` changes the choice a run at that key may already have been
        #: prepared with (a row replaced by another, or any new row under a policy other than
        #: ``tune``, whose runs use the policy's choice): the runtime then rebuilds its prepared runs.
        self._on_change = on_change
        self.candidates_per_task = tuple(candidates_per_task)
        self._rows: dict[Key, Choice] = dict(rows or {})
        self._sources: dict[Key, str] = dict.fromkeys(self._rows, "bundle")
        self._lock = threading.Lock()
        self.policy = policy

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, value: str) -> None:
        if value not in DISPATCH_POLICIES:
            raise ValueError(f"unknown dispatch policy {value!r}; expected one of {', '.join(DISPATCH_POLICIES)}")
        self._policy = value

    @property
    def needs_tuning(self) -> bool:
        """True when some task has more than one candidate (otherwise every key is trivially known)."""
        return any(c > 1 for c in self.candidates_per_task)

    def trivial_choice(self) -> Choice:
        return tuple(0 for _ in self.candidates_per_task)

    def __getitem__(self, key: Key) -> Choice:
        return self._rows[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(dict(self._rows))

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: Key, default=None):  # type: ignore[override]
        return self._rows.get(key, default)

    def record(self, key: Key, choice: Choice, *, source: str = "manual") -> None:
        """Set the row of ``key`` (``source``: ``"tuned"`` when measured, ``"manual"`` otherwise)."""
        key, choice = tuple(int(v) for v in key), tuple(int(c) for c in choice)
        if len(key) != len(self.symbols):
            raise ValueError(f"key {key} has {len(key)} values for the symbols {list(self.symbols)}")
        if len(choice) != len(self.candidates_per_task):
            raise ValueError(f"choice {choice} has {len(choice)} entries for {len(self.candidates_per_task)} tasks")
        for task, (c, count) in enumerate(zip(choice, self.candidates_per_task)):
            if not 0 <= c < max(count, 1):
                raise ValueError(f"choice {choice}: task {task} has {count} candidates, the row picks {c}")
        if source not in SOURCES:
            raise ValueError(f"unknown row source {source!r}; expected one of {', '.join(SOURCES)}")
        with self._lock:
            before = self._rows.get(key)
            self._rows[key] = choice
            self._sources[key] = source
        if self._on_change is not None and before != choice and (before is not None or self.policy != "tune"):
            self._on_change()

    def merge(self, rows: Mapping[Key, Choice], *, source: str = "cache") -> list[Key]:
        """Add the rows of keys this table lacks (its own rows win); returns the keys added."""
        added = []
        with self._lock:
            for key, choice in rows.items():
                if key not in self._rows:
                    self._rows[key] = tuple(choice)
                    self._sources[key] = source
                    added.append(key)
        return added

    def source(self, key: Key) -> str | None:
        """``"bundle"``, ``"cache"``, ``"tuned"`` or ``"manual"``; ``None`` for a key without a row."""
        return self._sources.get(key)

    def nearest(self, key: Key) -> Choice | None:
        """The choice of the tuned key closest to ``key`` (relative L1 distance; ties: smaller key)."""
        with self._lock:
            rows = list(self._rows.items())
        if not rows:
            return None

        def distance(other: Key) -> tuple[float, Key]:
            return (sum(abs(a - b) / max(a, b, 1) for a, b in zip(key, other)), other)

        return min(rows, key=lambda kv: distance(kv[0]))[1]

    def error_for(self, key: Key) -> InputError:
        named = ", ".join(f"{s}={v}" for s, v in zip(self.symbols, key)) or "(static)"
        return InputError(f"no dispatch-table entry for {named} and the dispatch policy is 'error'; tune this key "
                          f"ahead of time (graph.tune) or choose another policy")

    def to_text(self) -> str:
        with self._lock:
            return format_dispatch_table(self.symbols, self._rows)

    def rows(self) -> dict[Key, Choice]:
        with self._lock:
            return dict(self._rows)
