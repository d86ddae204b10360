"""Why a GPU kind cannot be used, in words a user can act on, or the devices when it can.

``probe`` walks the ways it fails, in the order they happen: the driver library cannot be loaded,
the driver is older than the plugin needs, no device is visible (with the ``*_VISIBLE_DEVICES``
variable named when it hides them all), a context cannot be created on a device. It never raises:
``engine devices`` shows the reason, and loading a graph raises ``DeviceUnavailableError`` with it.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs

from engine.backend.contract import Availability
from engine.backend.gpu.driver import Driver, DriverError, DriverMissing

__all__ = ["Probe", "probe", "cuda_version_text"]


def cuda_version_text(version: int) -> str:
    """``12080`` → ``"12.8"`` (CUDA's encoding: 1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


@attrs.frozen
class Probe:
    """What ``probe`` found: the ``Availability`` and, when usable, each device's architecture."""

    availability: Availability
    archs: tuple[tuple[int, int], ...] = ()


def probe(driver: Driver, *, kind: str, min_version: int, visible_env: str, env: Mapping[str, str],
          version_text: Callable[[int], str] = cuda_version_text, install_hint: str = "install the GPU driver",
          upgrade_hint: str = "upgrade the GPU driver") -> Probe:
    """See the module docstring. ``env`` is the process environment (passed in, for tests)."""
    try:
        driver.load()
    except DriverMissing as exc:
        return Probe(Availability(False, reason=f"{exc}; {install_hint}"))
    except DriverError as exc:
        return Probe(Availability(False, reason=f"the {driver.name} failed to initialise: {exc}"))
    try:
        version = driver.version()
    except DriverError as exc:
        return Probe(Availability(False, reason=f"cannot read the {driver.name} version: {exc}"))
    label = f"{driver.name} {version_text(version)}"
    if version < min_version:
        return Probe(Availability(False, reason=f"the {driver.name} is {version_text(version)}; this plugin needs "
                                                f"{version_text(min_version)} or newer: {upgrade_hint}",
                                  driver=label))
    try:
        count = driver.device_count()
    except DriverError as exc:
        return Probe(Availability(False, reason=f"cannot count {kind} devices: {exc}", driver=label))
    if count == 0:
        visible = env.get(visible_env)
        if visible is not None and not visible.strip():
            why = f"{visible_env} is set and empty, which hides every device from this process"
        elif visible is not None:
            why = f"no device is visible ({visible_env}={visible!r} names no usable device)"
        else:
            why = f"the {driver.name} reports no device"
        return Probe(Availability(False, reason=f"no {kind} device: {why}", driver=label))
    names, archs = [], []
    for index in range(count):
        try:
            names.append(driver.device_name(index))
            archs.append(driver.device_arch(index))
            driver.activate(index)
        except DriverError as exc:
            return Probe(Availability(False, count, tuple(names),
                                      reason=f"{kind}:{index}: cannot create a context: {exc}", driver=label))
    return Probe(Availability(True, count, tuple(names), driver=label), tuple(archs))
