"""engine-cuda: NVIDIA GPUs for engine, through cuda-python's driver bindings (docs/cuda.md).

The ``engine.devices`` entry point is ``engine_cuda.plugin``; importing this package touches no driver.
"""

__version__ = "0.1.0"
