"""How suite tests report: a failed check names its rule, a missing capability skips with its name.

``check(ok, rule_id, expected, seen)`` raises an ``AssertionError`` whose message starts with
``rule <id>:`` and says what was expected and what was seen, so one line of a CI log is enough to
act on. ``lacks(capability, why)`` skips with ``capability <name>: <why>``.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import pytest

from engine.testing.rules import CAPABILITIES, rule

__all__ = ["check", "fail", "lacks", "bytes_differ", "values_differ"]


def fail(rule_id: str, expected: str, seen: str) -> NoReturn:
    __tracebackhide__ = True  # report the suite test's line, not this helper's
    rule(rule_id)  # an unknown id is a bug in the suite, not in the backend
    raise AssertionError(f"rule {rule_id}: expected {expected}; saw {seen}")


def check(ok: object, rule_id: str, expected: str, seen: object) -> None:
    """Fail ``rule_id`` unless ``ok``; ``seen`` may be a zero-argument callable (built only on failure)."""
    __tracebackhide__ = True
    if not ok:
        fail(rule_id, expected, str(seen() if callable(seen) else seen))


def lacks(capability: str, why: str) -> NoReturn:
    """Skip the current test: the backend does not offer ``capability``."""
    __tracebackhide__ = True
    if capability not in CAPABILITIES:
        raise KeyError(f"unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}")
    pytest.skip(f"capability {capability}: {why}")


def bytes_differ(expected: np.ndarray | bytes, seen: np.ndarray | bytes, base: int = 0) -> str | None:
    """``None`` when the byte strings are equal, else where they first differ and how many differ.

    ``base`` is added to the reported offsets (the offset of ``expected[0]`` in its buffer).
    """
    a = np.frombuffer(bytes(expected), np.uint8)
    b = np.frombuffer(bytes(seen), np.uint8)
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    if a.shape != b.shape:
        return f"{b.size} bytes instead of {a.size}"
    bad = np.flatnonzero(a != b)
    first = int(bad[0])
    return (f"{bad.size} of {a.size} bytes differ, the first at byte {base + first} "
            f"(expected 0x{a[first]:02x}, got 0x{b[first]:02x})")


def values_differ(expected: np.ndarray, seen: np.ndarray, *, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """``None`` when ``seen`` matches ``expected`` (exactly, or within the tolerances), else a summary."""
    if expected.shape != seen.shape:
        return f"shape {seen.shape} instead of {expected.shape}"
    close = np.isclose(seen, expected, rtol=rtol, atol=atol, equal_nan=False) if (rtol or atol) \
        else (seen == expected)
    if bool(np.all(close)):
        return None
    bad = np.argwhere(~close)
    where = tuple(int(i) for i in bad[0])
    return (f"{len(bad)} of {expected.size} values differ, the first at index {where} "
            f"(expected {expected[where]!r}, got {seen[where]!r})")
