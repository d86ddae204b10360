"""Separately compiled units (``// engine-cpu: unit begin``/``end``): a part of a C source that
is compiled once per cache, as an object, and linked into every kernel holding it. Real sources,
the real compiler, kernels loaded and run; the same source compiled whole by the compiler directly
gives the same results."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BinaryPayload, CandidateSpec
from engine.errors import KernelError

from engine_cpu import UNIT_BEGIN, UNIT_END, CompilerError, CpuBackend, UnitMarkerError, split_units

#: A routine library: declarations before the unit, definitions in it (one of them cloned for AVX2,
#: one static and used only inside the unit), guarded so that pasting it twice still compiles whole.
LIBRARY = rf"""
#include <stdint.h>
#define LIB_API __attribute__((visibility("hidden")))
LIB_API void scale_into(float *y, const float *x, int64_t n, float k);
LIB_API float total(const float *x, int64_t n);
{UNIT_BEGIN}
#ifndef LIB_ROUTINES
#define LIB_ROUTINES
static float add(float a, float b) {{ return a + b; }}
__attribute__((target_clones("arch=x86-64-v3", "default")))
LIB_API void scale_into(float *y, const float *x, int64_t n, float k) {{
    for (int64_t i = 0; i < n; i++) y[i] = k * x[i];
}}
LIB_API float total(const float *x, int64_t n) {{
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s = add(s, x[i]);
    return s;
}}
#endif
{UNIT_END}
"""


def kernel_source(factor: float, *, library: str = LIBRARY) -> str:
    """A kernel of its own (a literal baked in, as generated kernels do) over ``library``."""
    return library + rf"""
int32_t scaled(void *const *t, const int64_t *s, void *ws) {{
    (void)ws;
    scale_into((float *)t[1], (const float *)t[0], s[0], {factor}f);
    ((float *)t[1])[0] += total((const float *)t[0], s[0]) * 0.0f;
    return 0;
}}
"""


def run(backend: CpuBackend, payload: BinaryPayload, x: np.ndarray) -> np.ndarray:
    kernel = backend.load_kernel(CandidateSpec("scaled", 0, "scaled", (payload,), None, 1, 1, ("n",), False))
    y = np.zeros_like(x)
    kernel.launch([x.ctypes.data, y.ctypes.data], [x.size], None, None)
    return y


def test_a_unit_is_compiled_once_and_linked_into_every_kernel_holding_it(tmp_path: Path) -> None:
    backend = CpuBackend(cache_dir=tmp_path)
    x = np.arange(10, dtype=np.float32)
    (two,) = backend.compile(kernel_source(2.0), "c")
    assert backend.compiler.invocations == 2  # the unit, then the kernel's own part linked with it
    (three,) = backend.compile(kernel_source(3.0), "c")
    assert backend.compiler.invocations == 3  # the unit's object came from the cache
    np.testing.assert_array_equal(run(backend, two, x), 2 * x)
    np.testing.assert_array_equal(run(backend, three, x), 3 * x)
    assert len(list((tmp_path / "cpu" / "units").glob("*.o"))) == 1
    # Another process's backend on the same cache: the unit's object is read from disk.
    again = CpuBackend(cache_dir=tmp_path)
    (four,) = again.compile(kernel_source(4.0), "c")
    assert again.compiler.invocations == 1
    np.testing.assert_array_equal(run(again, four, x), 4 * x)


def test_the_kernel_exports_its_entries_not_the_units_routines(tmp_path: Path) -> None:
    (payload,) = CpuBackend(cache_dir=tmp_path).compile(kernel_source(2.0), "c")
    path = tmp_path / "k.so"
    path.write_bytes(bytes(payload.data))
    library = ctypes.CDLL(str(path))
    assert library.scaled
    for hidden in ("scale_into", "total"):
        with pytest.raises(AttributeError):
            getattr(library, hidden)


def test_the_source_compiled_whole_means_the_same(tmp_path: Path) -> None:
    # A bundle's c-source read by another tool (or an older plugin) is one C file: the markers are
    # comments, and a library pasted twice is guarded.
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    source = kernel_source(5.0, library=LIBRARY + LIBRARY)
    (tmp_path / "whole.c").write_text(source)
    subprocess.run([cc, "-O3", "-shared", "-fPIC", "-std=c11", "whole.c", "-o", "whole.so"], cwd=tmp_path,
                   check=True)
    whole = ctypes.CDLL(str(tmp_path / "whole.so"))
    x = np.arange(6, dtype=np.float32)
    y = np.zeros_like(x)
    n = (ctypes.c_int64 * 1)(x.size)
    tensors = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
    assert whole.scaled(tensors, n, None) == 0
    backend = CpuBackend(cache_dir=tmp_path / "cache")
    (split,) = backend.compile(source, "c")  # the repeated unit is compiled and linked once
    assert backend.compiler.invocations == 2
    np.testing.assert_array_equal(run(backend, split, x), y)
    np.testing.assert_array_equal(y, 5 * x)


def test_split_keeps_the_sources_line_numbers() -> None:
    source = "int a;\n" + UNIT_BEGIN + "\nint f(void) { return 1; }\n" + UNIT_END + "\nint g(void);\n"
    split = split_units(source)
    assert split.own.splitlines() == ["int a;", "", "", "", "int g(void);"]
    assert split.units == ("int a;\n\nint f(void) { return 1; }\n",)
    assert split_units("int a;\n").units == ()


@pytest.mark.parametrize("source, line, expected", [
    (f"{UNIT_BEGIN}\nint f;\n", 1, "has no"),
    (f"int f;\n{UNIT_END}\n", 2, "without"),
    (f"{UNIT_BEGIN}\n{UNIT_BEGIN}\n{UNIT_END}\n", 2, "inside the unit begun at line 1"),
])
def test_markers_that_do_not_pair_up_are_refused_with_their_line(tmp_path: Path, source: str, line: int,
                                                                 expected: str) -> None:
    with pytest.raises(UnitMarkerError, match=expected) as info:
        split_units(source)
    assert info.value.line == line and f"line {line}" in str(info.value)
    assert isinstance(info.value, KernelError)
    with pytest.raises(UnitMarkerError):  # the same through the compiler, before it runs
        CpuBackend(cache_dir=tmp_path).compile(source, "c")


def test_an_error_in_a_unit_names_the_unit(tmp_path: Path) -> None:
    source = f"{UNIT_BEGIN}\nint f(void) {{ return missing_name; }}\n{UNIT_END}\nint g(void) {{ return 0; }}\n"
    with pytest.raises(CompilerError, match="C compilation of a unit failed.*missing_name") as info:
        CpuBackend(cache_dir=tmp_path).compile(source, "c")
    assert "unit.c:2" in info.value.log  # the source's own line number
