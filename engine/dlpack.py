"""DLPack 1.x through ctypes: the C structs, exporting capsules and importing them.

The protocol in one paragraph (https://dmlc.github.io/dlpack/latest/python_spec.html): a producer's
``__dlpack__`` returns a PyCapsule named ``"dltensor"`` (legacy ``DLManagedTensor``) or
``"dltensor_versioned"`` (``DLManagedTensorVersioned``, DLPack >= 1.0, which adds a version and
flags such as read-only). A consumer takes the pointer, renames the capsule to ``"used_dltensor"``
(``"used_dltensor_versioned"``) and from then on owns the struct: it calls the struct's ``deleter``
exactly once when done. A capsule that dies unconsumed still carries its original name, and the
producer's capsule destructor then calls the deleter itself.

Exports let numpy's C exporter own the struct (see the note above ``export_capsule``), then write
the engine's dtype, device, version and flags into it; imports read the struct with the ctypes
declarations below and hand the deleter to a ``weakref.finalize``. This module knows nothing about
engine tensors: ``engine.tensor`` turns the fields into storage. Calls into the C API go through
private prototypes (``PYFUNCTYPE``) rather than by setting ``argtypes`` on ``ctypes.pythonapi``
attributes, which every other library in the process shares.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from typing import Sequence

import attrs
import numpy as np

from engine.dtypes import DType, from_dlpack_code
from engine.errors import InputError

__all__ = [
    "DLPACK_VERSION",
    "FLAG_READ_ONLY",
    "FLAG_IS_COPIED",
    "DLPackVersion",
    "DLDevice",
    "DLDataType",
    "DLTensor",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DeleterFunc",
    "ImportedDLTensor",
    "ManagedHolder",
    "export_capsule",
    "import_capsule",
]

#: The newest DLPack version this module reads and writes (1.1 brought the float8 type codes).
DLPACK_VERSION: tuple[int, int] = (1, 1)

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
# The names consumers give a capsule they took; C keeps a pointer to them, so they must live as
# long as the process: module-level c_char_p objects keep their bytes alive.
_USED_NAME = ctypes.c_char_p(b"used_dltensor")
_USED_NAME_VERSIONED = ctypes.c_char_p(b"used_dltensor_versioned")
_NAME_C = ctypes.c_char_p(_NAME)
_NAME_VERSIONED_C = ctypes.c_char_p(_NAME_VERSIONED)


# -- the C structs (dlpack.h, v1.1) ------------------------------------------------------------
class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


#: ``void (*deleter)(DLManagedTensor* self)``, with the argument typed as a plain address.
DeleterFunc = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DeleterFunc)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DeleterFunc),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# Flat mirrors of the same memory for reading and patching: one ctypes object per struct instead
# of one per nested field (importing is on the path of every run input that is a torch tensor).
class _TensorFields(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _VersionedHead(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
    ]


_VERSIONED_TENSOR_OFFSET = DLManagedTensorVersioned.dl_tensor.offset
_LEGACY_DELETER_OFFSET = DLManagedTensor.deleter.offset
if (ctypes.sizeof(_TensorFields) != ctypes.sizeof(DLTensor)
        or _TensorFields.shape.offset != DLTensor.shape.offset
        or _VersionedHead.flags.offset != DLManagedTensorVersioned.flags.offset):
    raise ImportError("engine.dlpack: the flat DLPack struct mirrors do not match this platform's layout")


# -- PyCapsule C API -----------------------------------------------------------------------------
_api = ctypes.pythonapi
_py = ctypes.PYFUNCTYPE
_capsule_is_valid = _py(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_capsule_get_pointer = _py(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))
_capsule_set_name = _py(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", _api))


# -- export --------------------------------------------------------------------------------------
# Why numpy allocates the exported struct, and not a ctypes callback: the deleter and the capsule
# destructor are called from C, often from a deallocation while an exception is in flight (a
# consumer that rejects a capsule raises, then drops it: ``np.from_dlpack`` of a bfloat16 tensor
# does exactly that). A ctypes callback cannot run in that state: CPython turns the callback's
# return into "SystemError: returned a result with an exception set", the in-flight exception is
# lost and the release never happens. numpy's exporter does the same job in C (its deleter takes
# the GIL and drops one reference), so the engine builds a numpy array over the tensor's bytes,
# whose base keeps ``owner`` alive, lets numpy export it, then rewrites the fields numpy cannot
# express (engine dtype, device, version, flags). The struct is released by numpy's deleter, which
# reads none of those fields. As a bonus nothing in this module keeps per-export state.
_CARRIERS: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


class _Exported:
    """Presents the tensor's bytes to numpy (``__array_interface__``) and holds the owner; the
    numpy array built on it, and so the exported struct, keep it alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, data: int, shape: tuple[int, ...], carrier: np.dtype, readonly: bool, owner: object):
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": carrier.str,
                                    "data": (data, readonly)}
        self.owner = owner


def export_capsule(
    data: int,
    shape: Sequence[int],
    dtype: DType,
    device_type: int,
    device_id: int,
    owner: object,
    *,
    byte_offset: int = 0,
    versioned: bool,
    readonly: bool = False,
    copied: bool = False,
    version: tuple[int, int] = DLPACK_VERSION,
) -> object:
    """A DLPack capsule for the C-contiguous tensor at ``data`` + ``byte_offset`` (any device: the
    memory is never read here; devices whose pointers are handles give the handle as ``data``).

    ``owner`` is kept alive until the consumer calls the deleter, or the capsule dies unconsumed.
    ``versioned`` picks ``DLManagedTensorVersioned`` (with ``version`` and the ``readonly`` and
    ``copied`` flags) over the legacy ``DLManagedTensor``, which cannot say read-only: a read-only
    legacy export is refused with ``BufferError``, as numpy does.
    """
    if readonly and not versioned:
        raise BufferError("a read-only tensor cannot be exported as a legacy (pre-1.0) DLPack capsule, "
                          "which has no read-only flag")
    carrier = _CARRIERS.get(dtype.nbytes)
    if carrier is None:
        raise BufferError(f"cannot export {dtype.name} ({dtype.nbytes} bytes per element) through DLPack")
    shape = tuple(shape)
    # numpy refuses to wrap a NULL pointer; an empty tensor's address is never dereferenced.
    address = data if data or math.prod(shape) else 1
    array = np.asarray(_Exported(address, shape, carrier, readonly, owner))
    if versioned:
        try:
            capsule = array.__dlpack__(max_version=(1, 0))
        except TypeError:
            # numpy < 2.1 exports legacy capsules only; the protocol lets a consumer that asked
            # for a versioned one receive those, as long as nothing needed saying read-only.
            if readonly:
                raise BufferError("this numpy cannot export versioned DLPack capsules (numpy >= 2.1 "
                                  "can), and a legacy one cannot say read-only") from None
            versioned = False
    if versioned:
        address = _capsule_get_pointer(capsule, _NAME_VERSIONED_C)
        head = _VersionedHead.from_address(address)
        head.major, head.minor = version
        head.flags = (FLAG_READ_ONLY if readonly else 0) | (FLAG_IS_COPIED if copied else 0)
        fields = _TensorFields.from_address(address + _VERSIONED_TENSOR_OFFSET)
    else:
        capsule = array.__dlpack__()
        fields = _TensorFields.from_address(_capsule_get_pointer(capsule, _NAME_C))
    fields.data = data
    fields.byte_offset = byte_offset
    fields.device_type = device_type
    fields.device_id = device_id
    fields.code = dtype.dlpack_code
    fields.bits = dtype.dlpack_bits
    fields.lanes = 1
    return capsule


# -- import --------------------------------------------------------------------------------------
def _call_deleter(address: int, deleter: int) -> None:
    DeleterFunc(deleter)(address)


class ManagedHolder:
    """Owns one imported DLPack struct: the producer's deleter runs exactly once, when this holder
    is garbage (``weakref.finalize``) or on ``release()``, whichever comes first.

    Whatever must outlive the memory (the producer object) goes in ``keepalive``. Storage built on
    the import must reference this holder, and so must any host view of the memory, so that a
    numpy view keeps the producer's buffer alive after the tensor itself is gone.
    """

    __slots__ = ("keepalive", "_finalizer", "__weakref__")

    def __init__(self, address: int, deleter: int | None, keepalive: object = None):
        self.keepalive = keepalive
        self._finalizer = weakref.finalize(self, _call_deleter, address, deleter) if deleter else None

    @property
    def alive(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        """Call the producer's deleter now; safe to call more than once."""
        if self._finalizer is not None:
            self._finalizer()
        self.keepalive = None


@attrs.frozen
class ImportedDLTensor:
    """The fields of a consumed DLPack capsule. ``data`` and ``byte_offset`` are kept apart (on
    handle-addressed devices ``data`` is a buffer handle, not an address); ``addr`` is their sum for
    flat address spaces. ``strides`` (in elements) is ``None`` when the producer declared the tensor
    compact."""

    data: int
    byte_offset: int
    nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dtype: DType
    device_type: int
    device_id: int
    readonly: bool
    holder: ManagedHolder = attrs.field(eq=False, repr=False)

    @property
    def addr(self) -> int:
        return self.data + self.byte_offset

    def release(self) -> None:
        self.holder.release()


def import_capsule(capsule: object, *, keepalive: object = None) -> ImportedDLTensor:
    """Consume a ``"dltensor"`` or ``"dltensor_versioned"`` capsule.

    On success the capsule is renamed (the producer's destructor no longer frees it) and the
    returned holder owns the struct. If the capsule is unusable (wrong kind of object, a DLPack
    major version other than 1, a dtype the engine lacks) an ``InputError`` is raised and the
    capsule is left untouched, so its destructor still frees it.
    """
    if type(capsule).__name__ != "PyCapsule":
        raise InputError(f"expected a DLPack capsule, got {type(capsule).__name__}")
    if _capsule_is_valid(capsule, _NAME_VERSIONED_C):
        versioned = True
        address = _capsule_get_pointer(capsule, _NAME_VERSIONED_C)
        head = _VersionedHead.from_address(address)
        if head.major != 1:
            raise InputError(f"DLPack capsule has version {head.major}.{head.minor}; this engine reads 1.x")
        readonly = bool(head.flags & FLAG_READ_ONLY)
        deleter = head.deleter
        tensor = _TensorFields.from_address(address + _VERSIONED_TENSOR_OFFSET)
    elif _capsule_is_valid(capsule, _NAME_C):
        versioned = False
        address = _capsule_get_pointer(capsule, _NAME_C)
        readonly = False
        deleter = ctypes.c_void_p.from_address(address + _LEGACY_DELETER_OFFSET).value
        tensor = _TensorFields.from_address(address)
    else:
        raise InputError("the capsule is not an unused DLPack tensor (already consumed, or not from __dlpack__)")

    dtype = from_dlpack_code(tensor.code, tensor.bits, tensor.lanes)
    ndim = tensor.ndim
    if ndim < 0:
        raise InputError(f"DLPack tensor has a negative ndim {ndim}")
    shape = tuple((ctypes.c_int64 * ndim).from_address(tensor.shape)) if ndim else ()
    if any(d < 0 for d in shape):
        raise InputError(f"DLPack tensor has a negative dimension in shape {shape}")
    strides = None
    if tensor.strides and ndim:
        strides = tuple((ctypes.c_int64 * ndim).from_address(tensor.strides))
    result = ImportedDLTensor(
        data=tensor.data or 0,
        byte_offset=tensor.byte_offset,
        nbytes=math.prod(shape) * dtype.nbytes,
        shape=shape,
        strides=strides,
        dtype=dtype,
        device_type=tensor.device_type,
        device_id=tensor.device_id,
        readonly=readonly,
        holder=ManagedHolder(address, deleter, keepalive),
    )
    # From here on the struct is ours: the holder's finalizer calls the deleter.
    _capsule_set_name(capsule, _USED_NAME_VERSIONED if versioned else _USED_NAME)
    return result
