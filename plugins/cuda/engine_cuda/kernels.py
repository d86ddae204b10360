"""Which CUDA binaries load on which device, and the code object each one becomes.

The rule (bundle format §13): a ``cubin`` for the device's architecture, else ``ptx``, else the
source. Precisely:

* ``cubin`` for ``sm_XY`` runs on devices of the same major architecture with a minor of at least
  ``Y`` (an ``sm_80`` cubin runs on sm_86, not on sm_90); ``sm_XYa`` only on ``sm_XY`` itself;
* ``ptx`` for ``compute_XY`` is compiled by the driver for any device of at least ``X.Y``
  (``compute_XYa``: only ``X.Y``), provided the driver knows the PTX ISA version it was written in:
  PTX from NVRTC 12.8 (ISA 8.7) needs a 12.8 driver, and an older one is refused with that reason;
* ``cuda-source`` is compiled at load with NVRTC (``compiler.CudaCompiler``, cached by content,
  architecture and NVRTC version) into a cubin for the device, or PTX when this NVRTC does not know
  the device's architecture yet.
"""

from __future__ import annotations

import re

from engine.backend.base import BinaryRefused
from engine.backend.contract import BinaryPayload

__all__ = ["cubin_refusal", "ptx_refusal", "ptx_isa", "ptx_driver_needed", "parse_target"]

_TARGET = re.compile(r"(sm|compute)_(\d{2,3})([af]?)")
_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)


def parse_target(target: str, prefix: str) -> tuple[int, int, str] | None:
    """``"sm_90a"`` → ``(9, 0, "a")``; ``None`` when ``target`` is not ``<prefix>_<NN>[a|f]``."""
    m = _TARGET.fullmatch(target)
    if m is None or m.group(1) != prefix:
        return None
    number = int(m.group(2))
    return number // 10, number % 10, m.group(3)


def _sm(arch: tuple[int, int]) -> str:
    return f"sm_{arch[0]}{arch[1]}"


def cubin_refusal(target: str, arch: tuple[int, int]) -> str | None:
    """Why a cubin for ``target`` cannot run on a device of compute capability ``arch``, or None."""
    parsed = parse_target(target, "sm")
    if parsed is None:
        return f"cubin target {target!r} is not of the form sm_<NN>"
    major, minor, suffix = parsed
    if suffix == "a" and (major, minor) != arch:
        return f"cubin for {target} runs only on {target[:-1]}, device is {_sm(arch)}"
    if major != arch[0] or minor > arch[1]:
        return f"cubin for {target}, device is {_sm(arch)}"
    return None


def ptx_refusal(target: str, arch: tuple[int, int]) -> str | None:
    """Why PTX for ``target`` cannot be compiled for a device of ``arch`` (driver version aside)."""
    parsed = parse_target(target, "compute")
    if parsed is None:
        return f"ptx target {target!r} is not of the form compute_<NN>"
    major, minor, suffix = parsed
    if suffix == "a" and (major, minor) != arch:
        return f"PTX for {target} runs only on sm_{major}{minor}, device is {_sm(arch)}"
    if (major, minor) > arch:
        return f"PTX for {target} needs at least sm_{major}{minor}, device is {_sm(arch)}"
    return None


def ptx_isa(ptx: bytes) -> tuple[int, int] | None:
    """The PTX ISA version of a PTX text (its ``.version`` directive), or None if it has none."""
    m = _VERSION.search(ptx[:4096])
    return (int(m.group(1)), int(m.group(2))) if m else None


def ptx_driver_needed(isa: tuple[int, int]) -> int:
    """The oldest CUDA driver (1000 * major + 10 * minor) that JIT-compiles PTX of ISA ``isa``.

    ISA 8.0-8.5 came with CUDA 12.0-12.5, 8.6 with 12.7, 8.7 with 12.8, 8.8 with 12.9, 9.x with
    13.x; ISA 7.x with CUDA 11.x (7.0 = 11.0 … 7.8 = 11.8).
    """
    major, minor = isa
    if major >= 9:
        return 13000 + 10 * minor + 1000 * (major - 9)
    if major == 8:
        return 12000 + 10 * (minor if minor <= 5 else minor + 1)
    if major == 7:
        return 11000 + 10 * minor
    return 10000


def ptx_image(binary: BinaryPayload, driver_version: int, version_text: str) -> bytes:
    """The NUL-terminated PTX to hand the driver; ``BinaryRefused`` when the driver is too old for it."""
    data = bytes(binary.data)
    isa = ptx_isa(data)
    if isa is not None:
        needed = ptx_driver_needed(isa)
        if needed > driver_version:
            raise BinaryRefused(f"PTX ISA {isa[0]}.{isa[1]} needs a CUDA {needed // 1000}.{needed % 1000 // 10} "
                                f"driver or newer, this driver is {version_text}")
    return data if data.endswith(b"\0") else data + b"\0"
