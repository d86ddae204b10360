"""engine-cpu: the CPU device plugin of ``engine``.

C kernels (``c-source``) are compiled with the system compiler and shared objects (``elf-so``)
are loaded with ctypes; see ``backend.CpuBackend`` for how the allocator, compiler and program
roles fit together, and DESIGN §4 for the kernel ABI. Kernels may link libraries shipped in
wheels (OpenBLAS from ``scipy-openblas32``) by name: ``libraries`` and docs/cpu.md.

The names in ``__all__`` are the plugin's public surface: other distributions (the ONNX importer's
code generator and its BLAS candidate) import them from here, never from the submodules, so the
modules can be rearranged without breaking them. ``link_directives`` reads a source's
``// engine-cpu: link NAME`` lines; ``LibraryRegistry`` locates a named library and raises
``LibraryUnavailableError`` when it is not installed. ``split_units`` cuts a source at its
``// engine-cpu: unit begin``/``end`` lines (parts compiled once and linked into every kernel
holding them: ``units``); ``UnitMarkerError`` is a pair of markers that does not match.
"""

from engine_cpu.backend import NUM_THREADS_ENV, CpuBackend
from engine_cpu.compiler import CCompiler, CompilerError
from engine_cpu.fused import CpuFusedLaunch
from engine_cpu.host import host_target
from engine_cpu.kernel import CpuKernel, CpuPreparedLaunch
from engine_cpu.libraries import (LibraryProvider, LibraryRegistry, LibraryUnavailableError, LinkedLibrary,
                                  UnknownLibraryError, WheelConventionProvider, link_directives)
from engine_cpu.opened import Library
from engine_cpu.program import ProgramLoader
from engine_cpu.units import UNIT_BEGIN, UNIT_END, SplitSource, UnitMarkerError, split_units

__all__ = [
    "CpuBackend",
    "CpuKernel",
    "CpuPreparedLaunch",
    "CpuFusedLaunch",
    "CCompiler",
    "CompilerError",
    "Library",
    "ProgramLoader",
    "host_target",
    "NUM_THREADS_ENV",
    "LibraryProvider",
    "LibraryRegistry",
    "LibraryUnavailableError",
    "LinkedLibrary",
    "UnknownLibraryError",
    "WheelConventionProvider",
    "link_directives",
    "UNIT_BEGIN",
    "UNIT_END",
    "SplitSource",
    "UnitMarkerError",
    "split_units",
]
