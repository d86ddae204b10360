"""The device-plugin contract (version 2): what a backend supplies and what the core calls.

``engine.backend.contract`` holds the types (pointers, launch geometry, specs, the protocols),
``engine.backend.base`` the classes plugins subclass with the shared policy,
``engine.backend.events`` the default event and ``engine.backend.cachefiles`` crash-safe cache
files. ``docs/plugins.md`` is the guide; ``engine.testing`` the conformance suite.
"""

from engine.backend.base import BackendBase, BinaryRefused, CandidateUnavailable, KernelBase, kernel_failure
from engine.backend.contract import (API_CHANGES, API_VERSION, Availability, Backend, BinaryPayload, CandidateSpec,
                                     DevicePtr, Event, FusedLaunch, HasNativeLaunch, Kernel, LaunchConfig, LaunchDims,
                                     NativeLaunch, PreparedLaunch, ReferenceKernel, Replayable, Stream)
from engine.backend.events import HostEvent
from engine.pointer import BufferPtr

__all__ = [
    "API_VERSION",
    "API_CHANGES",
    "DevicePtr",
    "BufferPtr",
    "Stream",
    "Availability",
    "BinaryPayload",
    "LaunchConfig",
    "LaunchDims",
    "CandidateSpec",
    "ReferenceKernel",
    "Kernel",
    "KernelBase",
    "PreparedLaunch",
    "FusedLaunch",
    "NativeLaunch",
    "HasNativeLaunch",
    "Replayable",
    "Event",
    "HostEvent",
    "Backend",
    "BackendBase",
    "BinaryRefused",
    "CandidateUnavailable",
    "kernel_failure",
]
