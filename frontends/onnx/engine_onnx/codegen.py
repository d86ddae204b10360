"""Small C code generation helpers shared by the op modules: types, kernel specs, prologues.

Every kernel follows the CPU ABI of docs/bundle-format.md §12.1:
``int32_t entry(void *const *tensors, const int64_t *symbols, void *workspace)``. Shapes known at
import are literals in the source (so the compiler specialises loops); dynamic dimensions are read
from ``symbols`` into ``s_<name>`` locals by the prologue.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs
import numpy as np

from engine_cpu.libraries import link_directives

from engine_onnx.errors import NodeUnsupported

__all__ = ["KernelSpec", "ctype", "prologue", "HEADER", "source_with_entries", "kernel_sources", "cpu_options"]

HEADER = "#include <stdint.h>\n#include <string.h>\n#include <tgmath.h>\n#undef I\n"

_CTYPES = {
    "float32": "float", "float64": "double", "float16": "_Float16",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "bool": "uint8_t",
}


def ctype(dtype: np.dtype | str) -> str:
    """The C type of a numpy dtype (bool is one byte, 0 or 1)."""
    name = np.dtype(dtype).name
    try:
        return _CTYPES[name]
    except KeyError:
        raise NodeUnsupported(f"dtype {name} has no C kernels") from None


def cpu_options(source: str) -> dict:
    """The CPU compile options a source needs: OpenMP when it uses it, ``link`` for the libraries
    its ``// engine-cpu: link NAME`` lines name (``ops/gemm_blas.py``)."""
    options: dict = {"openmp": True} if "#pragma omp" in source else {}
    libraries = link_directives(source)
    if libraries:
        options["link"] = list(libraries)
    return options


@attrs.frozen
class KernelSpec:
    """One kernel task: C source, its candidate entries, the graph symbols it reads, its scratch.

    ``entry_sources`` (entry, source) are entries compiled from a source of their own, apart from
    ``source`` (which holds the others): a candidate that needs an optional library (a BLAS from a
    wheel) then does not make the portable candidates need it too.
    """

    name: str
    source: str
    entries: tuple[str, ...]
    symbols: tuple[str, ...] = ()
    workspace: int | str = 0
    entry_sources: tuple[tuple[str, str], ...] = ()

    @property
    def options(self) -> dict:
        return cpu_options(self.source)

    def sources(self) -> list[tuple[str, dict]]:
        """Every distinct source to compile, with its options."""
        return [(self.source, self.options)] + [(src, cpu_options(src)) for _, src in self.entry_sources]


def prologue(symbols: Sequence[str]) -> str:
    """Reads the kernel's symbols into ``s_<name>`` locals; silences unused-argument warnings."""
    lines = [f"    const int64_t s_{s} = sym[{i}]; (void)s_{s};" for i, s in enumerate(symbols)]
    return "\n".join(["    (void)sym; (void)ws;", *lines]) + "\n"


def source_with_entries(preamble: str, bodies: Sequence[tuple[str, str]], symbols: Sequence[str]) -> str:
    """A whole source: the header, ``preamble``, then one ABI function per (entry, body)."""
    parts = [HEADER, preamble]
    for entry, body in bodies:
        parts.append(f"int32_t {entry}(void *const *t, const int64_t *sym, void *ws) {{\n"
                     f"{prologue(symbols)}{body}    return 0;\n}}\n")
    return "\n".join(parts)


def kernel_sources(preamble: str, bodies: Sequence[tuple[str, str]], symbols: Sequence[str],
                   own_binary: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``source_with_entries`` for the bodies that need nothing optional, and one source per body
    that calls a routine of ``own_binary`` (routine name -> the preamble defining it; routines that
    need something optional where they load, such as a library from a wheel), that preamble first."""
    shared, own = [], []
    for entry, body in bodies:
        extra = [pre for routine, pre in own_binary.items() if f"{routine}(" in body]
        if extra:
            own.append((entry, source_with_entries("".join(extra) + preamble, [(entry, body)], symbols)))
        else:
            shared.append((entry, body))
    return source_with_entries(preamble, shared, symbols), tuple(own)
