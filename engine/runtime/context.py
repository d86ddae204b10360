"""The objects a run is bound against: the graph's devices, and one lane's streams and workspaces.

``DeviceSet`` is fixed when a graph loads: one backend and device per kind. A *lane* is what one
thread owns on one set of streams (DESIGN §6): the streams its work is queued on and the
workspaces its scratch lives in. ``RunContext`` puts one key's plan together with the two, and is
the single argument the binding (``prepared``), interpreting (``interpreter``) and tuning code
take instead of long argument lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import attrs

from engine.backend import BackendBase
from engine.device import Device
from engine.runtime.workspace import Workspace

if TYPE_CHECKING:
    from engine.bundle.contents import BundleContents
    from engine.plugins import Registry
    from engine.runtime.plan import KeyPlan

__all__ = ["DeviceSet", "RunContext"]


@attrs.frozen
class DeviceSet:
    """The graph's devices: for each kind its backend and the device it runs on."""

    backends: Mapping[str, BackendBase]
    devices: Mapping[str, Device]
    registry: "Registry"
    #: The kinds whose current stream can change within a thread (``Backend.has_streams``).
    stream_kinds: tuple[str, ...] = attrs.field(init=False)
    #: Device index per kind.
    index: Mapping[str, int] = attrs.field(init=False)

    @stream_kinds.default
    def _stream_kinds(self) -> tuple[str, ...]:
        return tuple(k for k, b in self.backends.items() if b.has_streams)

    @index.default
    def _index(self) -> Mapping[str, int]:
        return {k: d.index for k, d in self.devices.items()}

    def current_streams(self) -> dict[str, object]:
        """The calling thread's current stream of every kind."""
        return {k: b.current_stream(self.index[k]) for k, b in self.backends.items()}

    def synchronize(self) -> None:
        """Wait for every device of the graph (loading, weights, closing a capture)."""
        for kind, backend in self.backends.items():
            backend.synchronize(self.index[kind])


@attrs.frozen
class RunContext:
    """One key's plan bound to one lane: where every tensor is and which stream work goes on."""

    contents: "BundleContents"
    plan: "KeyPlan"
    devices: DeviceSet
    streams: Mapping[str, object]
    workspaces: Mapping[str, Workspace]

    def backend(self, kind: str) -> BackendBase:
        return self.devices.backends[kind]
