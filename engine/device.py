"""Device names: ``"cpu"``, ``"cuda:1"``, ``"hip:0"``, ``"<kind>:<index>"``.

A bundle records device *kinds* only; the index is chosen at load time. ``Device`` compares equal
to its string spelling so that ``tensor.device == "cpu"`` reads naturally.
"""

from __future__ import annotations

import re

import attrs

from engine.errors import InputError

__all__ = ["Device", "KIND_PATTERN"]

KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]*\Z")
_DEVICE_PATTERN = re.compile(r"([a-z][a-z0-9_]*)(?::(\d+))?\Z")


@attrs.frozen(eq=False, repr=False)
class Device:
    kind: str
    index: int = 0

    @classmethod
    def parse(cls, value: "Device | str") -> "Device":
        if isinstance(value, Device):
            return value
        if not isinstance(value, str):
            raise InputError(f"device must be a string like 'cpu' or 'cuda:0', got {type(value).__name__}")
        match = _DEVICE_PATTERN.match(value.strip().lower())
        if match is None:
            raise InputError(f"malformed device {value!r}; expected '<kind>' or '<kind>:<index>', e.g. 'cuda:1'")
        return cls(match.group(1), int(match.group(2) or 0))

    def __str__(self) -> str:
        return self.kind if (self.kind == "cpu" and self.index == 0) else f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Device.parse(other)
            except InputError:
                return False
        if not isinstance(other, Device):
            return NotImplemented
        return (self.kind, self.index) == (other.kind, other.index)

    def __hash__(self) -> int:
        return hash((self.kind, self.index))
