"""engine-opencl: OpenCL devices for engine, through pyopencl (``docs/opencl.md``).

Importing the package never touches the OpenCL driver: pyopencl is imported inside the methods
that need it, so a machine without OpenCL still lists the kind (unavailable, with the reason).
"""

from engine_opencl.backend import OpenCLBackend

__all__ = ["OpenCLBackend"]
