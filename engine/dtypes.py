"""Data types, named as in the reference runtime (hidet).

A DType ties three worlds together: the bundle's dtype name, numpy's dtype (bfloat16 and float8
through ml_dtypes, which numpy lacks) and DLPack's (code, bits) pair. Everything else in the engine
speaks DType objects, never strings.
"""

from __future__ import annotations

import importlib
from typing import Any, Union

import attrs
import numpy as np

from engine.errors import InputError

__all__ = [
    "DType",
    "DTYPES",
    "dtype",
    "DTypeLike",
    "from_numpy_dtype",
    "from_dlpack_code",
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
]

# DLPack DLDataTypeCode values.
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_BOOL = 0, 1, 2, 4, 6
DL_FLOAT8_E4M3FN, DL_FLOAT8_E5M2 = 10, 12  # DLPack >= 1.1 codes for the float8 variants


@attrs.frozen(repr=False)
class DType:
    """A dtype. ``numpy`` is resolved on first use: bfloat16 and float8 come from ml_dtypes, whose
    import costs seconds on a small machine and which most graphs (and ``engine --help``) never need.
    """

    name: str
    nbytes: int
    dlpack_code: int
    dlpack_bits: int
    #: ``"numpy:float32"`` or ``"ml_dtypes:bfloat16"``: where the numpy dtype comes from.
    numpy_source: str = attrs.field(repr=False)
    _numpy: np.dtype | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def numpy(self) -> np.dtype:
        cached = self._numpy
        if cached is None:
            module, attr = self.numpy_source.split(":")
            cached = np.dtype(getattr(importlib.import_module(module), attr))
            object.__setattr__(self, "_numpy", cached)
        return cached

    def __repr__(self) -> str:
        return f"engine.{self.name}"

    def __str__(self) -> str:
        return self.name


def _make(name: str, source: str, nbytes: int, code: int) -> DType:
    return DType(name, nbytes, code, nbytes * 8, source)


bool_ = _make("bool", "numpy:bool_", 1, DL_BOOL)
int8 = _make("int8", "numpy:int8", 1, DL_INT)
int16 = _make("int16", "numpy:int16", 2, DL_INT)
int32 = _make("int32", "numpy:int32", 4, DL_INT)
int64 = _make("int64", "numpy:int64", 8, DL_INT)
uint8 = _make("uint8", "numpy:uint8", 1, DL_UINT)
uint16 = _make("uint16", "numpy:uint16", 2, DL_UINT)
uint32 = _make("uint32", "numpy:uint32", 4, DL_UINT)
uint64 = _make("uint64", "numpy:uint64", 8, DL_UINT)
float16 = _make("float16", "numpy:float16", 2, DL_FLOAT)
bfloat16 = _make("bfloat16", "ml_dtypes:bfloat16", 2, DL_BFLOAT)
float32 = _make("float32", "numpy:float32", 4, DL_FLOAT)
float64 = _make("float64", "numpy:float64", 8, DL_FLOAT)
float8_e4m3fn = _make("float8_e4m3fn", "ml_dtypes:float8_e4m3fn", 1, DL_FLOAT8_E4M3FN)
float8_e5m2 = _make("float8_e5m2", "ml_dtypes:float8_e5m2", 1, DL_FLOAT8_E5M2)

DTYPES: dict[str, DType] = {
    d.name: d
    for d in (bool_, int8, int16, int32, int64, uint8, uint16, uint32, uint64,
              float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2)
}
_BY_DLPACK: dict[tuple[int, int], DType] = {(d.dlpack_code, d.dlpack_bits): d for d in DTYPES.values()}
# numpy's own dtypes resolve without importing ml_dtypes; the ml_dtypes ones join on first need.
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in DTYPES.values() if d.numpy_source.startswith("numpy:")}


#: What ``engine.dtype()`` (and ``dtype=`` of ``empty``/``asarray``) accepts: an engine DType, a name
#: (``"float32"``), a numpy dtype or a scalar type (``np.float32``, ``ml_dtypes.bfloat16``).
DTypeLike = Union[DType, str, "np.dtype[Any]", type]


def dtype(value: DTypeLike) -> DType:
    """Resolve a DType from a DType, a name (``"float32"``) or anything numpy accepts as a dtype."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    try:
        return from_numpy_dtype(np.dtype(value))
    except TypeError:
        pass
    raise InputError(f"unknown dtype {value!r}; expected one of {', '.join(DTYPES)}")


def from_numpy_dtype(value: np.dtype) -> DType:
    value = np.dtype(value)
    found = _BY_NUMPY.get(value)
    if found is not None:
        return found
    if type(value).__module__.startswith("ml_dtypes") or getattr(value.type, "__module__", "").startswith("ml_dtypes"):
        for d in DTYPES.values():  # an ml_dtypes array exists, so ml_dtypes is already imported
            _BY_NUMPY.setdefault(d.numpy, d)
    try:
        return _BY_NUMPY[value]
    except KeyError:
        raise InputError(f"numpy dtype {value} has no engine equivalent; expected one of {', '.join(DTYPES)}") from None


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType:
    if lanes != 1:
        raise InputError(f"DLPack tensors with {lanes} lanes are not supported")
    try:
        return _BY_DLPACK[(code, bits)]
    except KeyError:
        raise InputError(f"DLPack dtype (code={code}, bits={bits}) has no engine equivalent") from None
