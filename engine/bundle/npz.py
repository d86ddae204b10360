"""The reference runtime's ``weights.npz``, read without trusting it (docs/bundle-format.md §9.4).

``numpy.load`` is the wrong tool for a file from someone else: it returns a plain array when the
"npz" is really an ``.npy``, allocates whatever shape a header declares before reading a byte of
data, and inflates deflated members to whatever size they reach. Here the npz is opened with
``zipfile`` directly and every member is judged from the zip directory and its ``.npy`` header
first -- name, compression, dtype, shape, the declared size against the member's size and the
limits, the tensor it must fill -- and only then inflated, into one buffer of exactly the declared
size (zipfile never yields more than the directory's size, and checks the CRC at the end).
"""

from __future__ import annotations

import math
import tokenize
import zipfile
import zlib
from collections.abc import Sequence
from typing import IO, BinaryIO

import attrs
import numpy as np

from engine.errors import BundleError, OutOfMemoryError

__all__ = ["NPZ_MEMBER", "MAX_NPZ_BYTES", "MAX_NPZ_INFLATED_BYTES", "MAX_NPZ_RATIO", "NPZ_RATIO_FLOOR",
           "MAX_NPY_HEADER_BYTES", "ExpectedArray", "read_npz"]

NPZ_MEMBER = "weights.npz"
#: Largest ``weights.npz`` member of a bundle (its stored size).
MAX_NPZ_BYTES = 2**40
#: Largest total of the arrays' decompressed sizes: the arrays are copied into memory, not mapped.
MAX_NPZ_INFLATED_BYTES = 2**40
#: Largest decompressed/compressed ratio of one array once it inflates past ``NPZ_RATIO_FLOOR``:
#: real weights barely compress, so a small member that inflates a hundredfold is a bomb.
MAX_NPZ_RATIO = 100
NPZ_RATIO_FLOOR = 2**20
#: Largest ``.npy`` header (numpy's own default bound for untrusted files).
MAX_NPY_HEADER_BYTES = 10_000
MAX_NPY_RANK = 32  # the format's tensor rank limit (§14)

_FLAGS_ENCRYPTION = 0x0001 | 0x0040 | 0x2000
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
_CHUNK = 8 * 1024 * 1024
# What a broken member raises from zipfile/zlib while being opened, inflated or CRC-checked.
_INFLATE_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError)
# What numpy's header readers raise for a malformed header (after the bytes were read fine): the
# header is a Python literal, evaluated by ast (and re-tokenized for Python 2 era files), and its
# descr goes to numpy.dtype.
_HEADER_ERRORS = (ValueError, SyntaxError, TypeError, tokenize.TokenError, RecursionError, OverflowError,
                  MemoryError)


@attrs.frozen
class ExpectedArray:
    """What ``arr_<i>`` must hold: the dtype and shape of graph tensor ``tensor``."""

    dtype: np.dtype
    shape: tuple[int, ...]
    tensor: int


@attrs.frozen
class _Header:
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    size: int  # bytes of the header, magic included: the data follow

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def read_npz(file: BinaryIO, expected: Sequence[ExpectedArray | None]) -> tuple[np.ndarray, ...]:
    """Arrays ``arr_0 ... arr_<n-1>`` of ``file`` (an .npz), ``n = len(expected)``, as C-contiguous copies.

    ``expected[i]`` (when known) is checked against the header before the data are inflated.
    Every failure is a :class:`BundleError` naming ``weights.npz`` and, where there is one, the
    array (``weights.npz @ arr_3: ...``).
    """
    zf = _open_zip(file)
    with zf:
        infos = _members(zf, len(expected))
        _check_sizes(infos)
        return tuple(_read_array(zf, info, f"arr_{i}", expected[i]) for i, info in enumerate(infos))


def _open_zip(file: BinaryIO) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(file)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, OSError, ValueError,
            OverflowError) as exc:
        file.seek(0)
        if file.read(6) == b"\x93NUMPY":
            raise BundleError("is a single .npy array, not an .npz archive of arrays arr_0, arr_1, ...",
                              member=NPZ_MEMBER) from None
        raise BundleError(f"is not an .npz (zip) archive: {_clip(exc)}", member=NPZ_MEMBER) from None


def _members(zf: zipfile.ZipFile, count: int) -> list[zipfile.ZipInfo]:
    """``arr_0.npy ... arr_<count-1>.npy`` in order: each exactly once, nothing else, plainly compressed."""
    wanted = {f"arr_{i}.npy": i for i in range(count)}
    found: dict[int, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        name = info.orig_filename
        i = wanted.get(name)
        if i is None:
            raise BundleError(f"holds {_clip(repr(name))}; expected only arrays arr_0 ... arr_<n-1> for the graph's "
                              f"{count} weights", member=NPZ_MEMBER)
        if i in found:
            raise BundleError("appears more than once in the archive", member=NPZ_MEMBER, path=f"arr_{i}")
        if info.flag_bits & _FLAGS_ENCRYPTION:
            raise BundleError("is encrypted", member=NPZ_MEMBER, path=f"arr_{i}")
        if info.compress_type not in _METHODS:
            raise BundleError(f"uses compression method {info.compress_type}; arrays must be stored or deflated "
                              "(numpy.savez, numpy.savez_compressed)", member=NPZ_MEMBER, path=f"arr_{i}")
        found[i] = info
    missing = [i for i in range(count) if i not in found]
    if missing:
        raise BundleError(f"is missing (the graph has {count} weights)", member=NPZ_MEMBER, path=f"arr_{missing[0]}")
    return [found[i] for i in range(count)]


def _check_sizes(infos: list[zipfile.ZipInfo]) -> None:
    """Decompressed sizes, as the zip directory declares them, against the limits -- before inflating."""
    total = 0
    for i, info in enumerate(infos):
        path = f"arr_{i}"
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise BundleError(f"is stored but its sizes differ ({info.compress_size} stored, {info.file_size} "
                              "uncompressed)", member=NPZ_MEMBER, path=path)
        if info.file_size > NPZ_RATIO_FLOOR and info.file_size > MAX_NPZ_RATIO * info.compress_size:
            raise BundleError(f"inflates {info.compress_size} bytes to {info.file_size}, more than {MAX_NPZ_RATIO} "
                              f"times (a decompression bomb?); save such weights uncompressed (numpy.savez)",
                              member=NPZ_MEMBER, path=path)
        total += info.file_size
        if total > MAX_NPZ_INFLATED_BYTES:
            raise BundleError(f"arrays arr_0 ... arr_{i} inflate to {total} bytes, over the {MAX_NPZ_INFLATED_BYTES}-"
                              "byte limit", member=NPZ_MEMBER, path=path)


def _read_array(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str,
                expected: ExpectedArray | None) -> np.ndarray:
    try:
        f = zf.open(info)  # also compares the local header's name with the directory's
    except _INFLATE_ERRORS as exc:
        raise BundleError(f"cannot be opened: {_clip(exc)}", member=NPZ_MEMBER, path=path) from None
    with f:
        header = _read_header(f, path)
        _check_header(header, info, path, expected)
        data = _allocate(header.nbytes, path)
        _fill(f, data.data, path)  # data.data: memoryview(data), typed without the 3.12 buffer protocol
    array = data.view(header.dtype).reshape(header.shape, order="F" if header.fortran_order else "C")
    return np.ascontiguousarray(array)


def _read_header(f: IO[bytes], path: str) -> _Header:
    """The ``.npy`` header, read without touching the data (numpy's readers, bounded)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        version = np.lib.format.read_magic(f)
        reader = readers.get(version)
        if reader is not None:
            shape, fortran, dtype = reader(f, max_header_size=MAX_NPY_HEADER_BYTES)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:  # the read itself (a CRC, a short stream)
        raise BundleError(f"cannot be inflated: {_clip(exc)}", member=NPZ_MEMBER, path=path) from None
    except _HEADER_ERRORS as exc:
        raise BundleError(f"has no valid .npy header: {_clip(exc)}", member=NPZ_MEMBER, path=path) from None
    if reader is None:
        raise BundleError(f"is .npy format version {version[0]}.{version[1]}; arrays must be version 1.0 or 2.0",
                          member=NPZ_MEMBER, path=path)
    return _Header(dtype, tuple(shape), bool(fortran), f.tell())


def _check_header(header: _Header, info: zipfile.ZipInfo, path: str, expected: ExpectedArray | None) -> None:
    if header.dtype.hasobject:
        raise BundleError(f"holds Python objects ({header.dtype}); weights.npz may not hold pickles",
                          member=NPZ_MEMBER, path=path)
    if header.dtype.itemsize == 0:
        raise BundleError(f"has a dtype of zero size ({header.dtype})", member=NPZ_MEMBER, path=path)
    if len(header.shape) > MAX_NPY_RANK or any(type(d) is not int or d < 0 for d in header.shape):
        raise BundleError(f"declares shape {_clip(header.shape)}: at most {MAX_NPY_RANK} non-negative dimensions",
                          member=NPZ_MEMBER, path=path)
    if expected is not None and (header.dtype != expected.dtype or header.shape != expected.shape):
        raise BundleError(f"is {_clip(header.describe())}, but tensor {expected.tensor} is "
                          f"{expected.dtype}{list(expected.shape)}", member=NPZ_MEMBER, path=path)
    held = info.file_size - header.size
    if header.nbytes != held:
        declared = f"{header.nbytes} bytes" if header.nbytes <= 2**64 else "more than 2**64 bytes"
        raise BundleError(f"header declares {_clip(header.describe())} ({declared}) but the member holds "
                          f"{held} bytes of data", member=NPZ_MEMBER, path=path)


def _allocate(nbytes: int, path: str) -> np.ndarray:
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        raise OutOfMemoryError.from_error(exc, nbytes, "host", purpose=f"{NPZ_MEMBER} array {path}") from None


def _fill(f: IO[bytes], out: memoryview, path: str) -> None:
    """Inflate the data into ``out``; the member must hold exactly that many bytes (CRC checked)."""
    pos = 0
    try:
        while pos < len(out):
            n = f.readinto(out[pos:pos + _CHUNK])  # type: ignore[attr-defined]  # zipfile's ZipExtFile has it
            if not n:
                break
            pos += n
        extra = f.read(1)  # also makes zipfile compare the CRC if the last read did not
    except _INFLATE_ERRORS as exc:
        raise BundleError(f"cannot be inflated after {pos} of {len(out)} data bytes: {_clip(exc)}",
                          member=NPZ_MEMBER, path=path) from None
    if pos < len(out) or extra:
        raise BundleError(f"holds {pos} data bytes, not the {len(out)} its header declares",
                          member=NPZ_MEMBER, path=path)


def _clip(value: object, limit: int = 160) -> str:
    """A value or an exception's text for a one-line message, cut to about ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
