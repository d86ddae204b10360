"""The shared GPU layer: the device contract for CUDA-like drivers, written once.

What CUDA, HIP and any third-party driver with CUDA-like calls have in common lives here, driver-
neutral: the ``Driver`` Protocol a vendor adapter implements (``driver``), kernel argument blocks
in the ABI's layout (``abi``), per-(thread, device) streams honouring the caller's stream
(``streams``), events and event timing (``events``), pooled stream-ordered memory (``memory``),
prepared launches with a debug mode (``launch``), capture as a driver graph (``capture``),
availability reasons (``availability``), and ``GpuBackend``, the ``BackendBase`` that ties them
together (``backend``). A vendor plugin is then a thin adapter: ``engine-cuda`` is one. Importing
this package imports no vendor module and touches no driver. Guide: docs/plugins.md §18.
"""

from engine.backend.gpu.abi import SLOT_BYTES, ArgumentBlock, argument_layout, pack_arguments
from engine.backend.gpu.availability import Probe, cuda_version_text, probe
from engine.backend.gpu.backend import GpuBackend, stream_handle
from engine.backend.gpu.capture import GraphReplay, capture
from engine.backend.gpu.driver import DeviceFault, Driver, DriverError, DriverMissing, LaunchDims3
from engine.backend.gpu.events import GpuEvent
from engine.backend.gpu.launch import GpuKernel, Module, PreparedGpuLaunch
from engine.backend.gpu.memory import PoolAllocator
from engine.backend.gpu.streams import StreamLanes, StreamSource

__all__ = [
    "SLOT_BYTES", "ArgumentBlock", "argument_layout", "pack_arguments",
    "Probe", "cuda_version_text", "probe",
    "GpuBackend", "stream_handle",
    "GraphReplay", "capture",
    "DeviceFault", "Driver", "DriverError", "DriverMissing", "LaunchDims3",
    "GpuEvent",
    "GpuKernel", "Module", "PreparedGpuLaunch",
    "PoolAllocator",
    "StreamLanes", "StreamSource",
]
