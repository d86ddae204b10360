"""Kernels for GPU-like device kinds, written once in a small C dialect and rendered per kind.

A GPU kernel body is plain C99 over a handful of macros (``KERNEL``, ``GLOBAL``, ``SHARED``,
``BARRIER()``, ``GLOBAL_ID``, ``GROUP_ID(axis)``, ``LOCAL_ID(axis)``, ``LOCAL_SIZE(axis)``) and the
``<stdint.h>`` type names; math functions are called by their C names on float or double operands
(``exp``, ``erf``, ``fmax``…), which both OpenCL C and CUDA C++ overload by type. ``render`` puts the
kind's prelude in front: the same body is then CUDA C++ for NVRTC (through the CUDA plugin's
``compile()``) and OpenCL C 1.2 (the OpenCL plugin, which PoCL runs on a CPU). That is why the
OpenCL kind is here at all: CI has no GPU, but it has a real OpenCL driver, so every GPU kernel this
frontend generates runs in CI against ONNX Runtime, and its CUDA rendering is compiled to cubins
and PTX there. A kernel's parameters follow the GPU ABI of docs/bundle-format.md §12.2 and §12.3:
tensors (inputs, then outputs), one ``int64_t s_<symbol>`` per symbol, the workspace last when
there is one.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from engine_onnx.dims import Dim, Mono, dim_expr
from engine_onnx.errors import NodeUnsupported

__all__ = ["GPU_KINDS", "GpuKernelSpec", "render", "gdim", "params", "launch_1d", "launch_groups", "BLOCK",
           "gpu_ctype"]

#: Device kinds this frontend generates GPU kernels for, and the builder language of each.
GPU_KINDS: Mapping[str, str] = {"cuda": "cuda", "opencl": "opencl"}

#: Threads per block of the one-thread-per-element kernels.
BLOCK = 256

_COMMON = r"""
#define ceil_div(a, b) (((a) + (b) - 1) / (b))
"""

_PRELUDES: Mapping[str, str] = {
    "cuda": r"""typedef long long int64_t; typedef int int32_t; typedef short int16_t; typedef signed char int8_t;
typedef unsigned long long uint64_t; typedef unsigned int uint32_t; typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
#define KERNEL extern "C" __global__ void
#define GLOBAL
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define GLOBAL_ID ((int64_t)blockIdx.x * blockDim.x + threadIdx.x)
#define GROUP_ID(a) ((int64_t)((a) == 0 ? blockIdx.x : (a) == 1 ? blockIdx.y : blockIdx.z))
#define LOCAL_ID(a) ((int64_t)((a) == 0 ? threadIdx.x : (a) == 1 ? threadIdx.y : threadIdx.z))
#define LOCAL_SIZE(a) ((int64_t)((a) == 0 ? blockDim.x : (a) == 1 ? blockDim.y : blockDim.z))
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
""",
    "opencl": r"""#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
typedef long int64_t; typedef int int32_t; typedef short int16_t; typedef char int8_t;
typedef ulong uint64_t; typedef uint uint32_t; typedef ushort uint16_t; typedef uchar uint8_t;
#define KERNEL __kernel void
#define GLOBAL __global
#define SHARED __local
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define GLOBAL_ID ((int64_t)get_global_id(0))
#define GROUP_ID(a) ((int64_t)get_group_id(a))
#define LOCAL_ID(a) ((int64_t)get_local_id(a))
#define LOCAL_SIZE(a) ((int64_t)get_local_size(a))
#define nearbyint rint
""",
}

_GPU_CTYPES = {
    "float32": "float", "float64": "double",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "bool": "uint8_t",
}


def gpu_ctype(dtype) -> str:
    """The dialect's C type of a numpy dtype; half precision is not generated for GPUs yet."""
    import numpy as np

    name = np.dtype(dtype).name
    try:
        return _GPU_CTYPES[name]
    except KeyError:
        raise NodeUnsupported(f"dtype {name} has no GPU kernels yet (float32/float64 and integer types only)") from None


def render(source: str, kind: str) -> str:
    """``source`` in the dialect, as the kind's own language."""
    try:
        prelude = _PRELUDES[kind]
    except KeyError:
        raise ValueError(f"no GPU dialect for device kind {kind!r} (known: {sorted(_PRELUDES)})") from None
    return prelude + _COMMON + source


def gdim(d: Dim) -> str:
    """``d`` as a dialect expression over the kernel's ``s_<symbol>`` parameters (``int64_t``)."""
    if not isinstance(d, Mono):
        return f"((int64_t){int(d)})"
    parts = [f"s_{s}" for s in d.syms] + ([f"((int64_t){d.coef})"] if d.coef != 1 else [])
    return "(" + " * ".join(parts) + ")"


def params(inputs: Sequence[str], outputs: Sequence[str], symbols: Sequence[str]) -> str:
    """A kernel's parameter list: ``inputs``/``outputs`` are C element types, read-only and written
    (named ``in0…`` and ``out0…``), then the symbols (no kernel here needs a workspace)."""
    parts = [f"GLOBAL const {t} *in{i}" for i, t in enumerate(inputs)]
    parts += [f"GLOBAL {t} *out{i}" for i, t in enumerate(outputs)]
    parts += [f"int64_t s_{s}" for s in symbols]
    return ", ".join(parts)


def launch_1d(total: Dim, block: int = BLOCK) -> dict:
    """One thread per element of ``total`` (the kernel guards the tail)."""
    grid: str | int = (f"ceil_div({dim_expr(total)}, {block})" if isinstance(total, Mono)
                       else -(-int(total) // block))
    return {"grid": [grid, 1, 1], "block": [block, 1, 1]}


def launch_groups(groups: Dim, block: int) -> dict:
    """One block of ``block`` threads per item of ``groups`` (a row, a plane…)."""
    return {"grid": [dim_expr(groups), 1, 1], "block": [block, 1, 1]}


@attrs.frozen
class GpuKernelSpec:
    """One GPU kernel task: its dialect source, candidate entries and their launch geometry.

    ``launches`` has one launch (``grid``/``block`` expressions over the kernel's symbols, as the
    bundle's ``launch``) per entry. ``workspace`` is in bytes, as for CPU kernels.
    """

    name: str
    source: str
    entries: tuple[str, ...]
    launches: tuple[Mapping, ...]
    symbols: tuple[str, ...] = ()
    workspace: int | str = 0

    def __attrs_post_init__(self) -> None:
        if len(self.launches) != len(self.entries):
            raise ValueError(f"kernel {self.name!r}: {len(self.launches)} launches for {len(self.entries)} entries")
