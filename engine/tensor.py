"""Engine tensors: a dtype, a shape and a byte offset into a ``Storage``; contiguous, row-major.

Tensors are how inputs, weights and outputs cross the engine's boundary, so they speak numpy
(``numpy()``, ``__array__``) and DLPack (``__dlpack__``, ``from_dlpack``) without copying whenever
the memory is where the other side wants it. Copies between kinds go through the backends the
registry provides (``to()``); host memory is read in place.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from engine import dlpack as _dlpack
from engine import dtypes as _dtypes
from engine.device import Device
from engine.dtypes import DType
from engine.errors import InputError, OutOfMemoryError
from engine.hostptr import array_address
from engine.storage import ExternalStorage, Storage

if TYPE_CHECKING:
    from engine.backend import BackendBase
    from engine.backend.contract import DevicePtr
    from engine.plugins import Registry

__all__ = ["Tensor", "empty", "asarray", "from_dlpack", "tensor_from_numpy"]

#: DLPack device types of the first-party kinds, used when no registered backend claims a type
#: (kDLCPU, kDLCUDA, kDLROCM in dlpack.h).
STANDARD_DLPACK_DEVICES: dict[int, str] = {1: "cpu", 2: "cuda", 10: "hip"}
_STANDARD_DLPACK_TYPES: dict[str, int] = {kind: code for code, kind in STANDARD_DLPACK_DEVICES.items()}
_KDL_CPU = 1
_CPU = Device("cpu")


class Tensor:
    """A contiguous row-major view of ``storage`` starting ``offset`` bytes in.

    The constructor does no validation: it wraps kernel outputs on the run loop's hot path. Build
    tensors from outside data with ``empty``, ``asarray``, ``from_dlpack`` or ``tensor_from_numpy``.
    ``registry`` is the plugin registry whose backends copy this tensor (``numpy()`` of device
    memory, ``to()``); ``None`` means ``engine.plugins.default_registry()``.
    """

    __slots__ = ("storage", "dtype", "shape", "offset", "registry", "__weakref__")

    def __init__(self, storage: Storage, dtype: DType, shape: tuple[int, ...], offset: int = 0, *,
                 registry: "Registry | None" = None):
        self.storage = storage
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.registry = registry

    # -- metadata --------------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        return self.storage.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.nbytes

    @property
    def ptr(self) -> "DevicePtr":
        """The device pointer of the first element (the backend's pointer type plus ``offset``)."""
        return self.storage.ptr + self.offset

    @property
    def addr(self) -> int:
        """``ptr`` as an integer address; only for backends whose pointers are addresses."""
        return self.storage.addr + self.offset

    def __repr__(self) -> str:
        return f"Tensor(shape={tuple(self.shape)}, dtype={self.dtype.name}, device={self.storage.device})"

    # -- numpy -----------------------------------------------------------------------------------
    def numpy(self, *, registry: "Registry | None" = None) -> np.ndarray:
        """The tensor as a numpy array: a zero-copy view of host memory (read-only if the storage is),
        otherwise a copy made by the device's backend after synchronizing it."""
        view = self.storage.host_view
        if view is not None:
            if self.size == 0:
                array = np.empty(self.shape, self.dtype.numpy)
                array.flags.writeable = not view.readonly
                return array
            return np.frombuffer(view, dtype=self.dtype.numpy, count=self.size,
                                 offset=self.offset).reshape(self.shape)
        backend = _backend(self.device.kind, registry or self.registry)
        out = np.empty(self.shape, self.dtype.numpy)
        if out.nbytes:
            index = self.device.index
            stream = backend.current_stream(index)
            order_after(backend, index, self.storage.stream, stream)
            backend.copy_to_host(array_address(out), self.ptr, out.nbytes, stream)
            host_wait(backend, index, stream)
        return out

    def __array__(self, dtype: "np.typing.DTypeLike | None" = None, copy: bool | None = None) -> np.ndarray:
        """numpy 2 protocol: ``copy=False`` raises ``ValueError`` when a copy cannot be avoided."""
        on_host = self.storage.host_view is not None
        want = None if dtype is None else np.dtype(dtype)
        converts = want is not None and want != self.dtype.numpy
        if copy is False and (not on_host or converts):
            why = (f"{self!r} is in device memory" if not on_host
                   else f"converting {self.dtype.name} to {want} needs a copy")
            raise ValueError(f"cannot make a numpy array without copying: {why}; use copy=None or .numpy()")
        array = self.numpy()
        if converts:
            return array.astype(want)
        if copy and on_host:
            return array.copy()
        return array

    # -- DLPack ----------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return _dlpack_type(self.device.kind, self.registry), self.device.index

    def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
        """A DLPack capsule of this tensor, without copying unless ``copy=True`` or ``dl_device``
        names another device. Versioned (``"dltensor_versioned"``, carrying the read-only flag)
        when the consumer accepts DLPack >= 1.0, legacy ``"dltensor"`` otherwise."""
        source = self
        copied = False
        here = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != here:
            if copy is False:
                raise BufferError(f"{self!r} lives on DLPack device {here}, not {tuple(dl_device)}, "
                                  f"and copy=False forbids moving it")
            target = Device(_kind_for_dlpack_type(dl_device[0], self.registry), dl_device[1])
            source, copied = self.to(target), True
            here = source.__dlpack_device__()
        elif copy:
            source, copied = self._clone(), True
        data, byte_offset = source.ptr, 0
        if source.storage.host_view is None:
            backend = _backend(source.device.kind, source.registry)
            data, byte_offset = backend.export_pointer(source.ptr)
            if stream != -1:
                # The consumer reads on its own stream: order it after the work queued on the
                # tensor's stream (an event) where the backend can use the consumer's stream,
                # else wait on the host for that work (an event, not a device-wide synchronize).
                index = source.device.index
                producer = _producer_stream(source.storage, backend, index)
                consumer = backend.dlpack_stream(stream if isinstance(stream, int) else None, index)
                if consumer is None:
                    host_wait(backend, index, producer)
                else:
                    order_after(backend, index, producer, consumer)
        versioned = max_version is not None and max_version[0] >= 1
        readonly = source.storage.readonly
        if readonly and not versioned:
            raise BufferError(
                f"{self!r} is read-only and a legacy (pre-1.0) DLPack capsule cannot say so; "
                f"consume it with a DLPack >= 1.0 consumer or ask for copy=True")
        version = _dlpack.DLPACK_VERSION
        if versioned and tuple(max_version) < version:  # type: ignore[arg-type]
            version = (1, max_version[1])  # type: ignore[index]
        return _dlpack.export_capsule(
            data, source.shape, source.dtype, here[0], here[1], source, byte_offset=byte_offset,
            versioned=versioned, readonly=readonly, copied=copied, version=version)

    def torch(self) -> Any:  # torch.Tensor (torch is optional: not named in annotations)
        """A torch tensor sharing this tensor's memory (through DLPack)."""
        try:
            import torch
        except ImportError as exc:
            raise ImportError("Tensor.torch() needs PyTorch: install torch, or use .numpy()") from exc
        return torch.from_dlpack(self)

    # -- copies ----------------------------------------------------------------------------------
    def to(self, device: Device | str, *, registry: "Registry | None" = None) -> "Tensor":
        """This tensor on ``device``: ``self`` if it is already there, else a copy."""
        target = Device.parse(device)
        if target == self.device:
            return self
        registry = registry if registry is not None else self.registry
        out = empty(self.shape, self.dtype, target, registry=registry)
        _copy(self, out, registry)
        return out

    def _clone(self) -> "Tensor":
        out = empty(self.shape, self.dtype, self.device, registry=self.registry)
        _copy(self, out, self.registry)
        return out


# -- factories ---------------------------------------------------------------------------------------
def empty(shape: int | Sequence[int], dtype: "_dtypes.DTypeLike", device: Device | str = "cpu", *,
          registry: "Registry | None" = None) -> Tensor:
    """An uninitialized tensor allocated by ``device``'s backend (``OutOfMemoryError`` naming this
    call's shape and dtype when the device cannot provide it)."""
    dims = _shape(shape)
    dt = _dtypes.dtype(dtype)
    target = Device.parse(device)
    backend = _backend(target.kind, registry)
    nbytes = math.prod(dims) * dt.nbytes
    try:
        storage = backend.allocate(nbytes, target.index, backend.current_stream(target.index))
    except MemoryError as exc:
        raise OutOfMemoryError.from_error(exc, nbytes, f"{target.kind}:{target.index}",
                                          f"engine.empty({_dims_text(dims)}, {dt.name})") from exc
    return Tensor(storage, dt, dims, 0, registry=registry)


def tensor_from_numpy(array: np.ndarray, *, device: Device | str = _CPU) -> Tensor:
    """Wrap a C-contiguous numpy array without copying; a read-only array gives read-only storage.

    ``device`` must name host memory (it is not checked against a backend): the array stays where
    numpy put it.
    """
    if not isinstance(array, np.ndarray):
        raise InputError(f"tensor_from_numpy expects a numpy.ndarray, got {type(array).__name__}")
    dt = _dtypes.from_numpy_dtype(array.dtype)
    if not array.flags.c_contiguous:
        raise InputError(f"numpy array of shape {array.shape} with strides {array.strides} is not "
                         f"C-contiguous; pass np.ascontiguousarray(array) or use engine.asarray()")
    # A flat byte view: memoryview cannot describe ml_dtypes (bfloat16, float8) element formats.
    host_view = array.reshape(-1).view(np.uint8).data  # memoryview(...): typed without the 3.12 buffer protocol
    storage = ExternalStorage(Device.parse(device), array_address(array), array.nbytes, owner=array,
                              host_view=host_view)
    return Tensor(storage, dt, array.shape, 0)


def from_dlpack(obj: object, *, registry: "Registry | None" = None) -> Tensor:
    """Wrap any DLPack producer (numpy, torch, cupy, an engine tensor) or a raw capsule, zero-copy.

    The producer is kept alive by the storage; the producer's deleter runs once when the storage
    and every numpy view of it are gone. Only C-contiguous tensors are accepted.
    """
    if isinstance(obj, Tensor):
        return obj
    if type(obj).__name__ == "PyCapsule":
        imported = _dlpack.import_capsule(obj)
    else:
        if not hasattr(obj, "__dlpack__"):
            raise InputError(f"{type(obj).__name__} does not implement the DLPack protocol (__dlpack__)")
        stream = None
        if hasattr(obj, "__dlpack_device__"):
            device_type, device_id = obj.__dlpack_device__()
            if device_type != _KDL_CPU:
                stream = _consumer_stream(_resolve_dlpack_device(device_type, registry)[1], device_id)
        capsule = _request_capsule(obj, stream)
        imported = _dlpack.import_capsule(capsule, keepalive=obj)
        del capsule
    try:
        return _wrap_imported(imported, registry)
    except BaseException:
        imported.release()
        raise


def asarray(obj: object, dtype: "_dtypes.DTypeLike | None" = None, device: Device | str = "cpu", *,
            registry: "Registry | None" = None) -> Tensor:
    """``obj`` as a tensor of ``dtype`` on ``device``.

    Zero copy when ``obj`` (an engine tensor, a numpy array, any DLPack producer) is already
    contiguous, of that dtype and on that device; otherwise a converted, contiguous copy (numpy
    does the dtype conversion, ml_dtypes' bfloat16 and float8 included).
    """
    target = Device.parse(device)
    want = None if dtype is None else _dtypes.dtype(dtype)
    tensor = _source_tensor(obj, want, registry)
    if want is not None and tensor.dtype != want:
        tensor = tensor_from_numpy(tensor.numpy(registry=registry).astype(want.numpy, order="C"))
        tensor.registry = registry
    return tensor.to(target, registry=registry)


def _source_tensor(obj: object, want: DType | None, registry: "Registry | None") -> Tensor:
    """``obj`` as a contiguous tensor wherever it lives: zero copy when it can be, else a host copy
    (converted to ``want`` on the way when numpy does the copying anyway)."""
    if isinstance(obj, Tensor):
        return obj
    array: np.ndarray | None
    if isinstance(obj, np.ndarray):
        array = obj
    elif hasattr(obj, "__dlpack__"):
        try:
            return from_dlpack(obj, registry=registry)
        except InputError:
            # Strided or of a dtype the engine lacks: numpy can still read it if it is host memory.
            array = _numpy_from_dlpack(obj)
            if array is None:
                raise
    else:
        array = np.asarray(obj, dtype=None if want is None else want.numpy)
    if want is not None and array.dtype != want.numpy:
        array = array.astype(want.numpy, order="C")
    elif not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    tensor = tensor_from_numpy(array)
    tensor.registry = registry
    return tensor


# -- helpers -------------------------------------------------------------------------------------------
def _registry(registry: "Registry | None") -> "Registry":
    if registry is not None:
        return registry
    from engine.plugins import default_registry  # deferred: plugins pulls in pluggy

    return default_registry()


def _backend(kind: str, registry: "Registry | None") -> "BackendBase":
    return _registry(registry).backend(kind)


def _dlpack_type(kind: str, registry: "Registry | None") -> int:
    # The first-party kinds have fixed DLPack types: exporting host memory needs no plugin.
    code = _STANDARD_DLPACK_TYPES.get(kind)
    if code is not None:
        return code
    return _backend(kind, registry).dlpack_device_type


def _kind_for_dlpack_type(device_type: int, registry: "Registry | None") -> str:
    return _resolve_dlpack_device(device_type, registry)[0]


def _resolve_dlpack_device(device_type: int, registry: "Registry | None") -> "tuple[str, BackendBase | None]":
    """The device kind of a DLPack device type and its backend (``None`` if no plugin provides it):
    the first-party kind for a standard type when its backend claims it, else a registered backend
    that declares the type, else the standard table."""
    reg = _registry(registry)
    kinds = reg.kinds()
    standard = STANDARD_DLPACK_DEVICES.get(device_type)
    if standard in kinds:
        backend = reg.backend(standard)  # type: ignore[arg-type]
        if backend.dlpack_device_type == device_type:
            return standard, backend  # type: ignore[return-value]
    for kind in kinds:
        backend = reg.backend(kind)
        if backend.dlpack_device_type == device_type:
            return kind, backend
    if standard is not None:
        return standard, None
    raise InputError(f"DLPack device type {device_type} belongs to no registered device kind; "
                     f"install the plugin for that device")


def _consumer_stream(backend: "BackendBase | None", index: int) -> object:
    """The stream handle to pass a producer: the backend's current stream when it is an integer
    handle (the array API's convention), else ``None`` (the producer's default stream)."""
    stream = backend.current_stream(index) if backend is not None else None
    return stream if isinstance(stream, int) and not isinstance(stream, bool) else None


def _request_capsule(obj: object, stream: object) -> object:
    kwargs = {} if stream is None else {"stream": stream}
    try:
        try:
            return obj.__dlpack__(max_version=_dlpack.DLPACK_VERSION, **kwargs)  # type: ignore[attr-defined]
        except TypeError:
            # Producers from before DLPack 1.0 take no max_version.
            return obj.__dlpack__(**kwargs)  # type: ignore[attr-defined]
    except BufferError as exc:
        # The producer refuses to share this tensor (torch: one that requires grad): say so as the
        # engine's error, with the producer's own advice.
        raise InputError(f"{type(obj).__module__.split('.')[0]}.{type(obj).__name__} refused to share its memory "
                         f"through DLPack: {exc}") from exc


class _HostMemory:
    """Describes borrowed host memory to numpy; the arrays built from it keep ``keepalive``."""

    __slots__ = ("__array_interface__", "keepalive")

    def __init__(self, addr: int, nbytes: int, readonly: bool, keepalive: object):
        self.__array_interface__ = {"version": 3, "shape": (nbytes,), "typestr": "|u1",
                                    "data": (addr, readonly)}
        self.keepalive = keepalive


def _borrowed_host_view(addr: int, nbytes: int, readonly: bool, keepalive: object) -> memoryview:
    """A memoryview of ``nbytes`` at ``addr`` whose referents keep ``keepalive`` alive, so that a
    numpy view made from it pins the producer's memory even after the storage is gone."""
    if nbytes == 0:
        return memoryview(b"") if readonly else memoryview(bytearray())
    return np.asarray(_HostMemory(addr, nbytes, readonly, keepalive)).data


def _wrap_imported(imported: _dlpack.ImportedDLTensor, registry: "Registry | None") -> Tensor:
    shape, strides = imported.shape, imported.strides
    if strides is not None and not _is_contiguous(shape, strides):
        raise InputError(f"DLPack tensor of shape {shape} has strides {strides} (in elements) and is "
                         f"not contiguous; call .contiguous() (torch) or np.ascontiguousarray() first")
    kind, backend = _resolve_dlpack_device(imported.device_type, registry)
    device = Device(kind, imported.device_id)
    host_view = None
    if backend.host_accessible if backend is not None else imported.device_type == _KDL_CPU:
        host_view = _borrowed_host_view(imported.addr, imported.nbytes, imported.readonly, imported.holder)
    # The holder owns the producer's struct (its deleter runs when the holder dies) and keeps the
    # producer alive; the storage and the host view both reference it.
    if backend is None or host_view is not None:
        ptr: object = imported.addr
    else:
        ptr = backend.import_pointer(imported.data, imported.byte_offset, imported.device_id, imported.holder)
    storage = ExternalStorage(device, ptr, imported.nbytes, owner=imported.holder, host_view=host_view)
    return Tensor(storage, imported.dtype, shape, 0, registry=registry)


def _numpy_from_dlpack(obj: object) -> np.ndarray | None:
    """A numpy view of a host-memory DLPack producer, or ``None`` if numpy cannot read it."""
    try:
        device_type, _ = obj.__dlpack_device__()  # type: ignore[attr-defined]
        if device_type != _KDL_CPU:
            return None
        return np.from_dlpack(obj)  # type: ignore[arg-type]  # checked above: a host DLPack producer
    except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):
        return None


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    if 0 in shape:
        return True
    expected = 1
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _dims_text(dims: tuple[int, ...]) -> str:
    """A shape for messages; one with an absurd dimension is summarised (Python refuses to print
    integers of more than a few thousand digits)."""
    if all(d < 2**63 for d in dims):
        return str(list(dims))
    return f"a {len(dims)}-dimensional shape with a dimension of 2**63 or more"


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    dims: tuple[int, ...] | None
    try:
        dims = (operator.index(shape),)  # type: ignore[arg-type]  # a sequence raises TypeError here
    except TypeError:
        dims = None
    try:
        if dims is None:
            dims = tuple(operator.index(d) for d in shape)  # type: ignore[union-attr]
    except TypeError:
        raise InputError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise InputError(f"shape {dims} has a negative dimension")
    return dims


def order_after(backend: "BackendBase", index: int, producer: object, stream: object) -> None:
    """Make work queued next on ``stream`` wait for the work already queued on ``producer``
    (an event recorded on one, waited for on the other; nothing when they are the same stream)."""
    if producer is None or producer == stream:
        return
    event = backend.create_event(index)
    event.record(producer)
    event.wait(stream)


def host_wait(backend: "BackendBase", index: int, stream: object) -> None:
    """Block the host until the work queued on ``stream`` so far is done (one event, not the device)."""
    event = backend.create_event(index)
    event.record(stream)
    event.synchronize()


def _producer_stream(storage: Storage, backend: "BackendBase", index: int) -> object:
    stream = storage.stream
    return stream if stream is not None else backend.current_stream(index)


def _copy(src: Tensor, dst: Tensor, registry: "Registry | None") -> None:
    """Copy ``src``'s bytes into ``dst`` (same shape and dtype).

    The copy is queued on the destination's current stream after the work pending on the
    source's stream; when the host needs the bytes (a host destination) it waits for them.
    """
    nbytes = src.nbytes
    if nbytes == 0:
        return
    src_host = src.storage.host_view is not None
    dst_host = dst.storage.host_view is not None
    if src_host and dst_host:
        # Both in host memory: the destination backend copies (a memmove for host kinds).
        backend = _backend(dst.device.kind, registry)
        index = dst.device.index
        stream = backend.current_stream(index)
        backend.copy_from_host(dst.ptr, src.ptr, nbytes, stream)
        host_wait(backend, index, stream)
        return
    if dst_host:
        backend = _backend(src.device.kind, registry)
        index = src.device.index
        stream = backend.current_stream(index)
        order_after(backend, index, src.storage.stream, stream)
        backend.copy_to_host(dst.ptr, src.ptr, nbytes, stream)
        host_wait(backend, index, stream)
        return
    backend = _backend(dst.device.kind, registry)
    index = dst.device.index
    stream = backend.current_stream(index)
    if src_host:
        # The host bytes may be reused once copy_from_host returns (the contract's pageable-copy rule).
        backend.copy_from_host(dst.ptr, src.ptr, nbytes, stream)
    elif src.device.kind == dst.device.kind:
        order_after(backend, index, src.storage.stream, stream)
        backend.copy_device(dst.ptr, src.ptr, nbytes, stream)
        if isinstance(src.storage, ExternalStorage):
            host_wait(backend, index, stream)  # borrowed memory is freed by its producer, unordered
        else:
            src.storage.stream = stream  # its release is now ordered after this copy
    else:
        # Two device kinds: stage through host memory (numpy() waits for the bytes).
        staged = src.numpy(registry=registry)
        backend.copy_from_host(dst.ptr, array_address(staged), nbytes, stream)
    dst.storage.stream = stream
