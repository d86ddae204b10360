"""Data types, named as in the reference runtime (hidet).

A DType ties three worlds together: the bundle's dtype name, numpy's dtype (bfloat16 and float8
through ml_dtypes, which numpy lacks) and DLPack's (code, bits) pair. Everything else in the engine
speaks DType objects, never strings.
"""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

from engine.errors import InputError

__all__ = [
    "DType",
    "DTYPES",
    "dtype",
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
    name: str
    nbytes: int
    numpy: np.dtype = attrs.field(eq=False)
    dlpack_code: int
    dlpack_bits: int

    def __repr__(self) -> str:
        return f"engine.{self.name}"

    def __str__(self) -> str:
        return self.name


def _make(name: str, np_dtype: object, code: int) -> DType:
    npd = np.dtype(np_dtype)
    return DType(name, npd.itemsize, npd, code, npd.itemsize * 8)


bool_ = _make("bool", np.bool_, DL_BOOL)
int8 = _make("int8", np.int8, DL_INT)
int16 = _make("int16", np.int16, DL_INT)
int32 = _make("int32", np.int32, DL_INT)
int64 = _make("int64", np.int64, DL_INT)
uint8 = _make("uint8", np.uint8, DL_UINT)
uint16 = _make("uint16", np.uint16, DL_UINT)
uint32 = _make("uint32", np.uint32, DL_UINT)
uint64 = _make("uint64", np.uint64, DL_UINT)
float16 = _make("float16", np.float16, DL_FLOAT)
bfloat16 = _make("bfloat16", ml_dtypes.bfloat16, DL_BFLOAT)
float32 = _make("float32", np.float32, DL_FLOAT)
float64 = _make("float64", np.float64, DL_FLOAT)
float8_e4m3fn = _make("float8_e4m3fn", ml_dtypes.float8_e4m3fn, DL_FLOAT8_E4M3FN)
float8_e5m2 = _make("float8_e5m2", ml_dtypes.float8_e5m2, DL_FLOAT8_E5M2)

DTYPES: dict[str, DType] = {
    d.name: d
    for d in (bool_, int8, int16, int32, int64, uint8, uint16, uint32, uint64,
              float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2)
}
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in DTYPES.values()}
_BY_DLPACK: dict[tuple[int, int], DType] = {(d.dlpack_code, d.dlpack_bits): d for d in DTYPES.values()}


def dtype(value: DType | str | np.dtype | type) -> DType:
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
    try:
        return _BY_NUMPY[np.dtype(value)]
    except KeyError:
        raise InputError(f"numpy dtype {value} has no engine equivalent; expected one of {', '.join(DTYPES)}") from None


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType:
    if lanes != 1:
        raise InputError(f"DLPack tensors with {lanes} lanes are not supported")
    try:
        return _BY_DLPACK[(code, bits)]
    except KeyError:
        raise InputError(f"DLPack dtype (code={code}, bits={bits}) has no engine equivalent") from None
