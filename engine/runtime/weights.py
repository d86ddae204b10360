"""Placing weights on their devices, and checking weights a user hands to ``set_weights``.

On a host-accessible backend (the CPU) weights are used straight from the memory-mapped
``weights.bin``: loading costs the same for 1 MiB and 1 GiB. Other backends get one copy each.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.backend import BackendBase
from engine.bundle.contents import BundleContents
from engine.device import Device
from engine.errors import InputError
from engine.hostptr import array_address
from engine.plugins import Registry
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor, from_dlpack, host_wait, order_after

__all__ = ["place_weights", "upload_host_array", "check_weights"]


def upload_host_array(array: np.ndarray, backend: BackendBase, device: Device, *, zero_copy: bool,
                      registry: Registry | None = None) -> Tensor:
    """A tensor on ``device`` with the bytes of the C-contiguous host ``array``."""
    from engine.dtypes import from_numpy_dtype

    dtype = from_numpy_dtype(array.dtype)
    nbytes = array.nbytes
    # Zero copy only when the bytes are aligned as the backend promises its kernels (a bundle written by
    # another tool may not have aligned weights.bin in the archive); otherwise one aligned copy.
    if zero_copy and backend.host_accessible and array_address(array) % backend.alignment == 0:
        # Bytes through numpy: ml_dtypes arrays (bfloat16, float8) export no buffer format.
        host = array.reshape(-1).view(np.uint8).data if nbytes else memoryview(b"")
        storage: Storage = ExternalStorage(device, array_address(array), nbytes, owner=array,
                                           host_view=host)
        return Tensor(storage, dtype, tuple(array.shape), 0, registry=registry)
    stream = backend.current_stream(device.index)
    storage = backend.allocate(nbytes, device.index, stream)
    if nbytes:
        # The host bytes may be reused once the call returns (contract: pageable-copy semantics);
        # kernels queued later on the stream see them.
        backend.copy_from_host(storage.ptr, array_address(array), nbytes, stream)
    return Tensor(storage, dtype, tuple(array.shape), 0, registry=registry)


def place_weights(contents: BundleContents, backends: dict[str, BackendBase],
                  devices: dict[str, Device], registry: Registry | None = None) -> list[Tensor] | None:
    """Weights in ``weights_index`` order, or ``None`` when the bundle was saved without them."""
    ex = contents.execution
    if not ex.weights_index:
        return []
    if contents.npz_weights is not None:
        arrays = list(contents.npz_weights)
        for j, (array, t) in enumerate(zip(arrays, ex.weights_index)):
            sig = ex.tensor_signatures[t]
            if array.dtype != sig.dtype.numpy or tuple(array.shape) != tuple(e.constant for e in sig.shape):
                from engine.errors import BundleError
                raise BundleError(f"arr_{j} is {array.dtype}{list(array.shape)}, tensor {t} expects "
                                  f"{sig.dtype.name}{sig.shape_str()}", member="weights.npz")
        return [upload_host_array(a, backends[ex.tensor_device[t]], devices[ex.tensor_device[t]], zero_copy=True,
                                  registry=registry) for a, t in zip(arrays, ex.weights_index)]
    blob = contents.weight_blob
    if blob is None or contents.weight_entries is None:
        return None
    flat = np.frombuffer(blob, dtype=np.uint8)
    out = []
    for entry, t in zip(contents.weight_entries, ex.weights_index):
        kind = ex.tensor_device[t]
        array = flat[entry.offset:entry.offset + entry.nbytes].view(entry.dtype.numpy).reshape(entry.shape)
        out.append(upload_host_array(array, backends[kind], devices[kind], zero_copy=True, registry=registry))
    return out


def check_weights(weights: Sequence[Any], contents: BundleContents, devices: dict[str, Device],
                  backends: dict[str, BackendBase], registry: Registry | None = None) -> list[Tensor]:
    """Validate user weights (count, dtype, shape, device) and copy them into engine-owned storage."""
    ex = contents.execution
    names = [e.name for e in contents.weight_entries] if contents.weight_entries else [
        f"weight {j}" for j in range(len(ex.weights_index))]
    if len(weights) != len(ex.weights_index):
        raise InputError(f"set_weights: the graph has {len(ex.weights_index)} weights, got {len(weights)}")
    out = []
    for j, (w, t) in enumerate(zip(weights, ex.weights_index)):
        sig = ex.tensor_signatures[t]
        kind = ex.tensor_device[t]
        shape = tuple(e.constant for e in sig.shape)
        label = f"set_weights: weight {j} ({names[j]!r})"
        if isinstance(w, Tensor) or (not isinstance(w, np.ndarray) and hasattr(w, "__dlpack__")):
            tensor = w if isinstance(w, Tensor) else from_dlpack(w, registry=registry)
            if tensor.device != devices[kind]:
                raise InputError(f"{label}: expected a tensor on {devices[kind]}, got one on {tensor.device}")
            if tensor.dtype != sig.dtype:
                raise InputError(f"{label}: expected dtype {sig.dtype.name}, got {tensor.dtype.name}")
            if tuple(tensor.shape) != shape:
                raise InputError(f"{label}: expected shape {list(shape)}, got {list(tensor.shape)}")
            backend = backends[kind]
            index = devices[kind].index
            stream = backend.current_stream(index)
            storage = backend.allocate(tensor.nbytes, index, stream)
            if tensor.nbytes:
                order_after(backend, index, tensor.storage.stream, stream)
                backend.copy_device(storage.ptr, tensor.ptr, tensor.nbytes, stream)
                host_wait(backend, index, stream)  # the caller may free or change its tensor on return
            out.append(Tensor(storage, sig.dtype, shape, 0, registry=registry))  # type: ignore[arg-type]  # constant
            continue
        if not isinstance(w, np.ndarray):
            raise InputError(f"{label}: expected a numpy array, an engine.Tensor or a DLPack tensor, got "
                             f"{type(w).__name__}")
        if w.dtype != sig.dtype.numpy:
            raise InputError(f"{label}: expected dtype {sig.dtype.name}, got numpy {w.dtype}")
        if tuple(w.shape) != shape:
            raise InputError(f"{label}: expected shape {list(shape)}, got {list(w.shape)}")
        out.append(upload_host_array(np.array(w, order="C", copy=True), backends[kind], devices[kind],
                                     zero_copy=True, registry=registry))
    return out
