"""Tensors: numpy views, DLPack both ways (numpy, torch, hand-built capsules), copies between
kinds, lifetimes and leaks.

Two backends live in this file so that the tests need no plugin: "cpu" (host memory) and
"fakedev" (host memory the engine must treat as device memory: ``host_accessible`` is False, so
every read goes through the backend's copies).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import sys
import weakref

import ml_dtypes
import numpy as np
import pytest

from engine import dlpack
from engine.backend import Availability, BackendBase
from engine.device import Device
from engine.dtypes import DTYPES
from engine.errors import InputError
from engine.plugins import Registry
from engine.settings import Settings
from engine.storage import Storage
from engine.tensor import Tensor, asarray, empty, from_dlpack, tensor_from_numpy

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

FAKEDEV_DLPACK_TYPE = 9
OTHERDEV_DLPACK_TYPE = 14


# -- test backends ---------------------------------------------------------------------------------
class HostBackend(BackendBase):
    """Numpy-backed aligned allocations, memmove copies; counts what it is asked to do."""

    kind = "cpu"
    workspace_slot = 0
    dlpack_device_type = 1
    host_accessible = True
    alignment = 64

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def availability(self) -> Availability:
        return Availability(True, 2, ("test host 0", "test host 1"))

    def _allocate(self, nbytes: int, device_index: int, stream: object) -> Storage:
        raw = np.empty(nbytes + self.alignment, np.uint8)
        start = (-raw.ctypes.data) % self.alignment
        buf = raw[start:start + nbytes]
        view = memoryview(buf) if self.host_accessible else None
        self.calls["allocate"] += 1
        return Storage(self.device(device_index), buf.ctypes.data, nbytes, host_view=view, owner=raw, stream=stream)

    def copy_from_host(self, dst: int, src_host: int, nbytes: int, stream: object = None) -> None:
        self.calls["copy_from_host"] += 1
        ctypes.memmove(dst, src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int, stream: object = None) -> None:
        self.calls["copy_to_host"] += 1
        ctypes.memmove(dst_host, src, nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, stream: object = None) -> None:
        self.calls["copy_device"] += 1
        ctypes.memmove(dst, src, nbytes)

    def memset(self, dst: int, value: int, nbytes: int, stream: object = None) -> None:
        ctypes.memset(dst, value, nbytes)

    def synchronize(self, device_index: int = 0, stream: object = None) -> None:
        self.calls["synchronize"] += 1


class FakeDevBackend(HostBackend):
    kind = "fakedev"
    workspace_slot = 5  # third-party kinds: >= 3 and not reserved (3 is opencl's)
    dlpack_device_type = FAKEDEV_DLPACK_TYPE
    host_accessible = False


class OtherDevBackend(HostBackend):
    kind = "otherdev"
    workspace_slot = 4
    dlpack_device_type = OTHERDEV_DLPACK_TYPE
    host_accessible = False


@pytest.fixture
def registry() -> Registry:
    reg = Registry(Settings(), autoload=False)
    for backend in (HostBackend(), FakeDevBackend(), OtherDevBackend()):
        reg.register_backend(backend)
    assert reg.failures() == []
    return reg


def calls(registry: Registry, kind: str) -> collections.Counter:
    return registry.backend(kind).calls  # type: ignore[attr-defined]


# -- helpers ---------------------------------------------------------------------------------------
def sample(dtype_name: str) -> np.ndarray:
    """Six small values every dtype holds exactly (bool, uint8 and float8 included)."""
    return np.array([0, 1, 2, 3, 1, 2], np.float32).astype(DTYPES[dtype_name].numpy)


def raw_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).view(np.uint8).tobytes()


def torch_bytes(tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


NUMPY_DLPACK_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                       "float16", "float32", "float64"]
TORCH_DTYPES = {
    "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}


class Producer:
    """A DLPack producer that delegates to a numpy array and records what it was asked."""

    def __init__(self, array: np.ndarray, *, legacy: bool = False, device: tuple[int, int] | None = None):
        self.array = array
        self.legacy = legacy
        self.device = device
        self.requests: list[dict] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device or self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.requests.append(kwargs)
        if self.legacy:
            return self.array.__dlpack__()
        return self.array.__dlpack__(**kwargs)


class TensorProducer:
    """Hands out an engine tensor's capsules without being a Tensor (so from_dlpack cannot shortcut)."""

    def __init__(self, tensor: Tensor, *, legacy: bool = False):
        self.tensor = tensor
        self.legacy = legacy

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.tensor.__dlpack__(stream=stream, max_version=None if self.legacy else max_version)


_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))


class CountingProducer:
    """Builds its own DLManagedTensorVersioned with ctypes, with a byte_offset, and counts how
    often its deleter is called."""

    def __init__(self, array: np.ndarray, *, byte_offset: int, shape: tuple[int, ...], readonly: bool = False):
        self.array = array
        self.deleted = 0
        self.byte_offset = byte_offset
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.ndim = len(shape)
        self.readonly = readonly
        self.capsules: list[object] = []
        self._structs: list[dlpack.DLManagedTensorVersioned] = []
        self._deleter = dlpack.DeleterFunc(self._on_delete)

    def _on_delete(self, address: int) -> None:
        self.deleted += 1

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        managed = dlpack.DLManagedTensorVersioned()
        managed.version.major, managed.version.minor = 1, 1
        managed.flags = dlpack.FLAG_READ_ONLY if self.readonly else 0
        managed.deleter = self._deleter
        tensor = managed.dl_tensor
        tensor.data = self.array.ctypes.data
        tensor.byte_offset = self.byte_offset
        tensor.device.device_type, tensor.device.device_id = 1, 0
        tensor.ndim = self.ndim
        tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = 2, 32, 1
        tensor.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        tensor.strides = None  # compact row-major
        self._structs.append(managed)
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor_versioned", None)
        self.capsules.append(capsule)
        return capsule


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- construction and metadata -----------------------------------------------------------------------
def test_empty_allocates_on_the_backend(registry):
    t = empty((2, 3), "float32", registry=registry)
    assert isinstance(t, Tensor)
    assert (t.shape, t.dtype, t.device, t.ndim, t.size, t.nbytes) == ((2, 3), DTYPES["float32"], "cpu", 2, 6, 24)
    assert t.addr % HostBackend.alignment == 0
    assert t.registry is registry
    t.numpy()[:] = 7
    assert (t.numpy() == 7).all() and t.numpy().flags.writeable
    assert repr(t) == "Tensor(shape=(2, 3), dtype=float32, device=cpu)"


def test_empty_shapes_dtypes_and_devices(registry):
    assert empty(4, np.int64, registry=registry).shape == (4,)
    scalar = empty((), DTYPES["float64"], registry=registry)
    assert (scalar.shape, scalar.size, scalar.numpy().shape) == ((), 1, ())
    zero = empty((3, 0), "bfloat16", registry=registry)
    assert (zero.size, zero.nbytes, zero.numpy().shape) == (0, 0, (3, 0))
    fake = empty((5,), "int8", "fakedev:1", registry=registry)
    assert fake.device == Device("fakedev", 1) and fake.storage.host_view is None
    assert repr(fake) == "Tensor(shape=(5,), dtype=int8, device=fakedev:1)"
    with pytest.raises(InputError, match="negative"):
        empty((2, -1), "float32", registry=registry)
    with pytest.raises(InputError, match="shape"):
        empty("abc", "float32", registry=registry)
    with pytest.raises(InputError, match="unknown dtype"):
        empty((2,), "float7", registry=registry)


def test_tensor_constructor_offset_view(registry):
    storage = registry.backend("cpu").allocate(64)
    np.frombuffer(storage.host_view, np.float32)[:] = np.arange(16)
    t = Tensor(storage, DTYPES["float32"], (2, 2), 16)
    assert t.addr == storage.addr + 16
    np.testing.assert_array_equal(t.numpy(), [[4, 5], [6, 7]])
    exported = np.from_dlpack(t)
    assert exported.ctypes.data == storage.addr + 16


# -- numpy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DTYPES))
def test_tensor_from_numpy_is_zero_copy_for_every_dtype(name):
    array = sample(name)
    t = tensor_from_numpy(array)
    assert t.dtype is DTYPES[name] and t.shape == array.shape and t.addr == array.ctypes.data
    view = t.numpy()
    assert view.dtype == DTYPES[name].numpy and np.shares_memory(view, array)
    view[0] = view[1]
    assert raw_bytes(array[:1]) == raw_bytes(array[1:2])


def test_tensor_from_numpy_refuses_what_it_cannot_wrap():
    with pytest.raises(InputError, match="C-contiguous"):
        tensor_from_numpy(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(InputError, match="no engine equivalent"):
        tensor_from_numpy(np.zeros(3, np.complex64))
    with pytest.raises(InputError, match="numpy.ndarray"):
        tensor_from_numpy([1, 2, 3])


def test_read_only_array_gives_read_only_storage_and_views(registry):
    array = np.arange(6, dtype=np.float32)
    array.flags.writeable = False
    t = tensor_from_numpy(array)
    assert t.storage.readonly
    assert not t.numpy().flags.writeable
    assert not np.asarray(t).flags.writeable
    assert not np.from_dlpack(t).flags.writeable
    capsule = t.__dlpack__(max_version=(1, 0))
    imported = dlpack.import_capsule(capsule)
    assert imported.readonly
    imported.release()
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()
    # A copy is writable, so it may go out as a legacy capsule.
    copied = np.from_dlpack(asarray(array, registry=registry), copy=True)
    assert copied.flags.writeable and not np.shares_memory(copied, array)


def test_array_protocol(registry):
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = tensor_from_numpy(array)
    assert np.shares_memory(np.asarray(t), array)
    assert np.shares_memory(np.asarray(t, copy=False), array)
    assert not np.shares_memory(np.array(t, copy=True), array)
    converted = np.asarray(t, dtype=np.int32)
    assert converted.dtype == np.int32 and (converted == array).all()
    with pytest.raises(ValueError, match="copy"):
        np.asarray(t, dtype=np.int32, copy=False)

    fake = t.to("fakedev", registry=registry)
    np.testing.assert_array_equal(np.asarray(fake), array)
    with pytest.raises(ValueError, match="device memory"):
        np.asarray(fake, copy=False)


def test_numpy_of_device_memory_copies_after_synchronizing(registry):
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    fake = asarray(array, device="fakedev", registry=registry)
    counter = calls(registry, "fakedev")
    before = dict(counter)
    first = fake.numpy()
    np.testing.assert_array_equal(first, array)
    assert counter["copy_to_host"] == before.get("copy_to_host", 0) + 1
    assert counter["synchronize"] > before.get("synchronize", 0)
    first[:] = 0  # a copy: the device memory is untouched
    np.testing.assert_array_equal(fake.numpy(), array)
    assert not np.shares_memory(fake.numpy(), fake.numpy())


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_ml_dtypes_through_numpy(registry, name):
    values = np.array([0.5, 1.0, -2.0, 3.0], np.float32)
    t = asarray(values, dtype=name, registry=registry)
    assert t.dtype is DTYPES[name]
    np.testing.assert_array_equal(t.numpy().astype(np.float32), values)
    back = t.to("fakedev", registry=registry).numpy()
    assert back.dtype == DTYPES[name].numpy and raw_bytes(back) == raw_bytes(t.numpy())


# -- DLPack with numpy -------------------------------------------------------------------------------
@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize("name", NUMPY_DLPACK_DTYPES)
def test_numpy_consumes_engine_tensors_zero_copy(name, legacy):
    array = sample(name)
    t = tensor_from_numpy(array.copy())
    producer = TensorProducer(t, legacy=legacy)
    out = np.from_dlpack(producer)
    assert out.dtype == DTYPES[name].numpy and out.ctypes.data == t.addr
    t.numpy()[2] = array[0]  # write through the engine, read through numpy
    assert raw_bytes(out[2:3]) == raw_bytes(array[:1])
    # numpy imports legacy capsules read-only (they cannot say whether writing is allowed).
    assert out.flags.writeable == (not legacy)
    if not legacy:
        out[0] = out[1]  # write through numpy, read through the engine
        assert raw_bytes(t.numpy()[:1]) == raw_bytes(array[1:2])


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize("name", NUMPY_DLPACK_DTYPES)
def test_engine_consumes_numpy_zero_copy(registry, name, legacy):
    array = sample(name)
    producer = Producer(array, legacy=legacy)
    t = from_dlpack(producer, registry=registry)
    assert producer.requests and "max_version" in producer.requests[0]
    assert t.dtype is DTYPES[name] and t.device == "cpu" and t.addr == array.ctypes.data
    view = t.numpy()
    assert np.shares_memory(view, array)
    view[0] = view[1]
    assert raw_bytes(array[:1]) == raw_bytes(array[1:2])


def test_versioned_capsule_fields():
    t = tensor_from_numpy(np.zeros((2, 3), ml_dtypes.bfloat16))
    legacy = t.__dlpack__()
    versioned = t.__dlpack__(max_version=(1, 5))
    old_minor = t.__dlpack__(max_version=(1, 0))
    assert _capsule_get_name(legacy) == b"dltensor"
    assert _capsule_get_name(versioned) == b"dltensor_versioned"
    pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    managed = dlpack.DLManagedTensorVersioned.from_address(pointer(versioned, b"dltensor_versioned"))
    assert (managed.version.major, managed.version.minor) == dlpack.DLPACK_VERSION
    assert managed.flags == 0
    tensor = managed.dl_tensor
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (4, 16, 1)
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 0)
    assert [tensor.shape[i] for i in range(2)] == [2, 3]
    assert [tensor.strides[i] for i in range(2)] == [3, 1]
    assert tensor.data == t.addr and tensor.byte_offset == 0
    managed_old = dlpack.DLManagedTensorVersioned.from_address(pointer(old_minor, b"dltensor_versioned"))
    assert (managed_old.version.major, managed_old.version.minor) == (1, 0)
    for capsule in (legacy, versioned, old_minor):
        imported = dlpack.import_capsule(capsule)
        assert imported.shape == (2, 3) and imported.dtype is DTYPES["bfloat16"] and imported.addr == t.addr
        imported.release()
    assert _capsule_get_name(legacy) == b"used_dltensor"
    assert _capsule_get_name(versioned) == b"used_dltensor_versioned"
    with pytest.raises(InputError, match="already consumed"):
        dlpack.import_capsule(versioned)


def test_dlpack_device_and_cross_device_requests(registry):
    array = np.arange(4, dtype=np.float32)
    t = asarray(array, registry=registry)
    fake = t.to("fakedev", registry=registry)
    assert t.__dlpack_device__() == (1, 0)
    assert fake.__dlpack_device__() == (FAKEDEV_DLPACK_TYPE, 0)
    with pytest.raises((BufferError, RuntimeError)):
        np.from_dlpack(fake)  # numpy cannot read device type 9
    moved = np.from_dlpack(fake, device="cpu")  # asks for dl_device=(1, 0): a copy
    np.testing.assert_array_equal(moved, array)
    with pytest.raises(BufferError, match="copy=False"):
        fake.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)
    copied = np.from_dlpack(t, copy=True)
    np.testing.assert_array_equal(copied, array)
    assert not np.shares_memory(copied, array)


def test_zero_size_and_scalar_tensors_round_trip(registry):
    for array in (np.zeros((0, 3), np.float32), np.array(2.5, np.float64)):
        t = tensor_from_numpy(array)
        out = np.from_dlpack(t)
        assert out.shape == array.shape and raw_bytes(out) == raw_bytes(array)
        back = from_dlpack(out, registry=registry)
        assert back.shape == array.shape and raw_bytes(back.numpy()) == raw_bytes(array)


# -- DLPack with torch -------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_torch_consumes_engine_tensors_zero_copy(name):
    array = sample(name)
    t = tensor_from_numpy(array.copy())
    out = torch.from_dlpack(t)
    assert out.dtype == getattr(torch, TORCH_DTYPES[name]) and out.data_ptr() == t.addr
    assert torch_bytes(out) == raw_bytes(array)
    out[0] = out[1]  # write through torch, read through the engine
    assert raw_bytes(t.numpy()[:1]) == raw_bytes(array[1:2])
    shared = t.torch()
    assert shared.data_ptr() == t.addr


@needs_torch
@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_engine_consumes_torch_zero_copy(registry, name):
    source = torch.from_numpy(sample("float32")).to(getattr(torch, TORCH_DTYPES[name]))
    t = from_dlpack(source, registry=registry)
    assert t.dtype is DTYPES[name] and t.addr == source.data_ptr() and t.device == "cpu"
    assert raw_bytes(t.numpy()) == torch_bytes(source)
    view = t.numpy()
    view[0] = view[1]  # write through the engine, read through torch
    assert torch_bytes(source[:1]) == torch_bytes(source[1:2])


@needs_torch
def test_torch_legacy_capsules_both_ways(registry):
    source = torch.arange(6, dtype=torch.float32)
    t = from_dlpack(torch.utils.dlpack.to_dlpack(source), registry=registry)  # a raw legacy capsule
    assert t.addr == source.data_ptr()
    engine_side = tensor_from_numpy(np.arange(4, dtype=np.int32))
    out = torch.utils.dlpack.from_dlpack(engine_side.__dlpack__())
    assert out.data_ptr() == engine_side.addr and out.tolist() == [0, 1, 2, 3]


@needs_torch
def test_torch_slices_honour_the_offset(registry):
    source = torch.arange(10, dtype=torch.float64)
    t = from_dlpack(source[2:5], registry=registry)
    assert t.addr == source.data_ptr() + 2 * 8
    np.testing.assert_array_equal(t.numpy(), [2, 3, 4])
    t.numpy()[0] = -1
    assert source[2].item() == -1
    rows = torch.arange(12, dtype=torch.int32).reshape(4, 3)[1:3]  # contiguous rows
    np.testing.assert_array_equal(from_dlpack(rows, registry=registry).numpy(), [[3, 4, 5], [6, 7, 8]])


@needs_torch
def test_non_contiguous_input_is_refused(registry):
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for strided in (matrix.t(), matrix[:, ::2], matrix[:, 1:2]):
        with pytest.raises(InputError, match=r"contiguous\(\)"):
            from_dlpack(strided, registry=registry)
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    refs = sys.getrefcount(strided)
    with pytest.raises(InputError, match="not contiguous") as info:
        from_dlpack(strided, registry=registry)
    del info
    gc.collect()
    assert sys.getrefcount(strided) == refs  # the refused import was released
    # Size-1 dimensions may carry any stride.
    odd = np.arange(6, dtype=np.float32).reshape(2, 3)[:, None, :]
    assert from_dlpack(odd, registry=registry).shape == (2, 1, 3)


def test_torch_method_without_torch(monkeypatch):
    t = tensor_from_numpy(np.zeros(2, np.float32))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="install torch"):
        t.torch()


# -- device mapping ----------------------------------------------------------------------------------
def test_dlpack_device_types_map_to_kinds(registry):
    fake = asarray(np.arange(5, dtype=np.float32), device="fakedev", registry=registry)
    imported = from_dlpack(TensorProducer(fake), registry=registry)  # type 9 -> "fakedev"
    assert imported.device == "fakedev" and imported.addr == fake.addr
    assert imported.storage.host_view is None
    np.testing.assert_array_equal(imported.numpy(), np.arange(5))
    with pytest.raises(InputError, match="device type 42"):
        from_dlpack(Producer(np.zeros(2), device=(42, 0)), registry=registry)


def test_from_dlpack_of_an_engine_tensor_is_the_tensor(registry):
    t = empty((2,), "float32", registry=registry)
    assert from_dlpack(t, registry=registry) is t
    with pytest.raises(InputError, match="DLPack"):
        from_dlpack(object(), registry=registry)


# -- copies between kinds ----------------------------------------------------------------------------
def test_to_between_kinds_preserves_bytes(registry):
    array = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    t = tensor_from_numpy(array)
    assert t.to("cpu", registry=registry) is t
    fake = t.to("fakedev", registry=registry)
    assert fake.device == "fakedev" and fake.storage.host_view is None
    assert calls(registry, "fakedev")["copy_from_host"] == 1
    assert fake.to("fakedev") is fake
    back = fake.to("cpu")  # the registry travels with the tensor
    assert back.device == "cpu" and calls(registry, "fakedev")["copy_to_host"] == 1
    assert raw_bytes(back.numpy()) == raw_bytes(array)
    assert not np.shares_memory(back.numpy(), array)

    other_index = fake.to("fakedev:1")
    assert other_index.device == "fakedev:1" and calls(registry, "fakedev")["copy_device"] == 1
    other_kind = fake.to("otherdev")  # two device kinds: staged through the host
    assert calls(registry, "otherdev")["copy_from_host"] == 1
    assert raw_bytes(other_kind.numpy()) == raw_bytes(array)
    assert raw_bytes(other_index.numpy()) == raw_bytes(array)


# -- asarray -------------------------------------------------------------------------------------------
def test_asarray_is_zero_copy_when_possible(registry):
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = asarray(array, registry=registry)
    assert np.shares_memory(t.numpy(), array)
    assert asarray(t, registry=registry) is t
    assert asarray(t, "float32", registry=registry) is t
    if torch is not None:
        source = torch.zeros(4, dtype=torch.bfloat16)
        assert asarray(source, registry=registry).addr == source.data_ptr()


def test_asarray_copies_when_it_must(registry):
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    converted = asarray(array, "float16", registry=registry)
    assert converted.dtype is DTYPES["float16"] and not np.shares_memory(converted.numpy(), array)
    np.testing.assert_array_equal(converted.numpy(), array.astype(np.float16))

    strided = asarray(array[:, ::2], registry=registry)
    np.testing.assert_array_equal(strided.numpy(), array[:, ::2])

    scalar = asarray(asarray(np.array(2.5), registry=registry), "float16", registry=registry)
    assert scalar.shape == () and scalar.numpy() == np.float16(2.5)
    assert asarray(7, registry=registry).shape == ()

    listed = asarray([[1, 2], [3, 4]], "int8", registry=registry)
    assert listed.dtype is DTYPES["int8"] and listed.numpy().tolist() == [[1, 2], [3, 4]]

    on_device = asarray(array, device="fakedev", registry=registry)
    assert on_device.device == "fakedev"
    np.testing.assert_array_equal(on_device.numpy(), array)
    as_float8 = asarray(on_device, "float8_e5m2", device="fakedev", registry=registry)
    assert as_float8.dtype is DTYPES["float8_e5m2"] and as_float8.device == "fakedev"
    np.testing.assert_array_equal(as_float8.numpy(), array.astype(ml_dtypes.float8_e5m2))

    if torch is not None:
        matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        np.testing.assert_array_equal(asarray(matrix.t(), registry=registry).numpy(), matrix.t().numpy())
        halves = asarray(torch.ones(3, dtype=torch.bfloat16), "float32", registry=registry)
        assert halves.dtype is DTYPES["float32"] and halves.numpy().tolist() == [1.0, 1.0, 1.0]


# -- lifetimes -------------------------------------------------------------------------------------------
def test_producer_lives_as_long_as_the_tensor_and_deleter_runs_once(registry):
    array = np.arange(8, dtype=np.float32)
    producer = Producer(array)
    alive = weakref.ref(producer)
    refs = sys.getrefcount(array)
    t = from_dlpack(producer, registry=registry)
    assert sys.getrefcount(array) == refs + 1  # numpy's exported struct holds the array
    del producer
    gc.collect()
    assert alive() is not None  # kept by the tensor's storage
    view = t.numpy()
    del t
    gc.collect()
    assert alive() is not None  # a numpy view of the memory keeps the import alive too
    view[0] = 42
    assert array[0] == 42
    del view
    gc.collect()
    assert alive() is None
    # Deleter called exactly once: the reference numpy's struct held is gone, and only that one.
    assert sys.getrefcount(array) == refs - 1


def test_hand_built_capsule_byte_offset_and_single_deleter_call(registry):
    array = np.arange(10, dtype=np.float32)
    producer = CountingProducer(array, byte_offset=8, shape=(2, 4))
    t = from_dlpack(producer, registry=registry)
    assert _capsule_get_name(producer.capsules[0]) == b"used_dltensor_versioned"
    assert t.addr == array.ctypes.data + 8
    np.testing.assert_array_equal(t.numpy(), [[2, 3, 4, 5], [6, 7, 8, 9]])
    assert producer.deleted == 0
    del t
    gc.collect()
    assert producer.deleted == 1

    closed = from_dlpack(producer, registry=registry)
    closed.storage.close()
    assert producer.deleted == 2
    del closed
    gc.collect()
    assert producer.deleted == 2

    readonly = CountingProducer(array, byte_offset=0, shape=(10,), readonly=True)
    t = from_dlpack(readonly, registry=registry)
    assert t.storage.readonly and not t.numpy().flags.writeable
    with pytest.raises(BufferError):
        t.__dlpack__()
    del t
    gc.collect()
    assert readonly.deleted == 1


def test_exported_owner_lives_until_the_consumer_is_done():
    t = tensor_from_numpy(np.arange(4, dtype=np.float32))
    alive = weakref.ref(t)
    consumer = np.from_dlpack(t)
    unconsumed = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    assert alive() is not None
    del consumer
    gc.collect()
    assert alive() is not None  # the unconsumed capsule still owns a reference
    del unconsumed
    gc.collect()
    assert alive() is None


def test_rejected_capsule_keeps_the_consumers_exception():
    # numpy rejects bfloat16 and drops the capsule with its exception set: the release must not
    # disturb that exception (a Python-level capsule destructor would turn it into SystemError).
    t = tensor_from_numpy(np.zeros(3, ml_dtypes.bfloat16))
    alive = weakref.ref(t)
    with pytest.raises((BufferError, RuntimeError), match="(?i)dtype") as info:
        np.from_dlpack(t)
    assert not isinstance(info.value, SystemError)
    del t, info
    gc.collect()
    assert alive() is None


def test_ten_thousand_export_import_cycles_do_not_leak(registry):
    def cycle(keep: list) -> None:
        source = np.ones(4096, np.float32)  # 16 KiB: a leaked cycle shows in RSS
        t = tensor_from_numpy(source)
        by_numpy = np.from_dlpack(t)  # engine -> numpy, versioned
        by_engine = from_dlpack(TensorProducer(t, legacy=True), registry=registry)  # engine -> engine, legacy
        from_numpy = from_dlpack(Producer(source), registry=registry)  # numpy -> engine
        unconsumed = t.__dlpack__(max_version=(1, 0))  # dies unconsumed
        by_torch = torch.from_dlpack(t) if torch is not None else None  # engine -> torch
        if keep is not None:
            keep.extend(weakref.ref(x) for x in (source, t, from_numpy, by_engine))
        del by_numpy, by_engine, from_numpy, unconsumed, by_torch

    for _ in range(500):
        cycle(None)
    gc.collect()
    before = rss_bytes()
    sampled: list = []
    for i in range(10_000):
        cycle(sampled if i % 1000 == 0 else None)
    gc.collect()
    growth = rss_bytes() - before
    assert all(ref() is None for ref in sampled)
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 10,000 cycles"
