"""Small C code generation helpers shared by the op modules: types, kernel specs, prologues.

Every kernel follows the CPU ABI of docs/bundle-format.md §12.1:
``int32_t entry(void *const *tensors, const int64_t *symbols, void *workspace)``. Shapes known at
import are literals in the source (so the compiler specialises loops); dynamic dimensions are read
from ``symbols`` into ``s_<name>`` locals by the prologue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import attrs
import numpy as np

from engine_cpu import link_directives

from engine_onnx.errors import NodeUnsupported

if TYPE_CHECKING:
    from engine_onnx.dims import Dim

__all__ = ["KernelSpec", "ctype", "prologue", "HEADER", "source_with_entries", "kernel_sources", "cpu_options",
           "parallel_rows", "thread_share", "OMP_INCLUDE", "PARALLEL_WORK", "TRANSCENDENTAL_COST"]

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


#: Elements of plain arithmetic (a load, an add, a store) worth a second thread: below it the
#: OpenMP fork and join cost more than they save. A kernel's own threshold divides this by its cost
#: per element, where each call to a function (erf, exp, tanh…) counts ``TRANSCENDENTAL_COST``.
PARALLEL_WORK = 32768
TRANSCENDENTAL_COST = 8

#: What a source that calls ``omp_get_num_threads``/``omp_get_thread_num`` includes.
OMP_INCLUDE = "#ifdef _OPENMP\n#include <omp.h>\n#endif\n"


def thread_share(count: str, call: str, *, thread_locals: str = "", condition: str | None = None) -> str:
    """C statements that run ``call`` (with ``lo``, ``hi`` in scope) on an even share of
    ``[0, count)`` per OpenMP thread, in one parallel region (when ``condition`` holds, if given);
    ``thread_locals`` are declared once per thread (a stack buffer). Needs ``OMP_INCLUDE``."""
    parallel = "    #pragma omp parallel" + (f" if ({condition})" if condition else "") + "\n"
    return (f"    const int64_t count_ = {count};\n{parallel}    {{\n{thread_locals}"
            "        int64_t nt = 1, ti = 0;\n"
            "#ifdef _OPENMP\n        nt = omp_get_num_threads(); ti = omp_get_thread_num();\n#endif\n"
            "        const int64_t lo = count_ * ti / nt, hi = count_ * (ti + 1) / nt;\n"
            f"        {call};\n    }}\n")


def parallel_rows(entry: str, symbols: Sequence[str], decls: str, rows: str, row_body: str,
                  work: "Dim", threshold: int) -> tuple[str, str]:
    """(preamble, entry body) of a kernel that runs ``row_body`` for each row ``r`` in ``[0, rows)``.

    The rows run in a function compiled twice (``target_clones``: x86-64-v3, i.e. AVX2+FMA, and
    baseline x86-64), the right one picked when the library loads, so a bundle stays portable while
    its loops use the host's vectors. The OpenMP region is in the entry and calls that function:
    a parallel loop inside a cloned function would be outlined into a function compiled for the
    baseline only. When ``work`` (elements, a dimension expression) reaches ``threshold``, the
    rows are split evenly among the threads (no OpenMP at all when it is known at import to stay
    below); ``decls`` (the tensor pointers, read from ``t``) and the symbols' ``s_<name>`` locals
    are in scope in ``row_body``.
    """
    from engine_onnx.dims import dim_c

    parallel_if = None if isinstance(work, int) and work < threshold else f"{dim_c(work)} >= {threshold}"
    syms = "".join(f"    const int64_t s_{s} = sym[{i}]; (void)s_{s};\n" for i, s in enumerate(symbols))
    fn = (f"__attribute__((target_clones(\"arch=x86-64-v3\", \"default\")))\n"
          f"static void {entry}_rows(void *const *t, const int64_t *sym, int64_t lo, int64_t hi) {{\n"
          f"    (void)sym;\n{syms}{decls}"
          f"    for (int64_t r = lo; r < hi; r++) {{\n{row_body}    }}\n}}\n")
    if parallel_if is None:
        return fn, f"    {entry}_rows(t, sym, 0, {rows});\n"
    return OMP_INCLUDE + fn, thread_share(rows, f"{entry}_rows(t, sym, lo, hi)", condition=parallel_if)
