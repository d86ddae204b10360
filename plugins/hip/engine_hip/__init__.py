"""engine-hip: AMD GPUs for engine, through hip-python's HIP runtime bindings and hiprtc (docs/hip.md).

The ``engine.devices`` entry point is ``engine_hip.plugin``; importing this package touches no runtime.
"""

__version__ = "0.1.0"
