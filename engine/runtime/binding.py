"""Validating graph inputs and binding symbol values, on every run.

Validation is always on (DESIGN §6), so it is precompiled: each input gets a small spec (dtype,
device, which dims are constants and which bind a symbol) and the per-run work is a handful of
comparisons. Errors name the input, the dimension and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from engine.bundle.schema import GraphMetaData
from engine.device import Device
from engine.errors import InputError
from engine.hostptr import array_address
from engine.runtime.input_hints import count_message, dtype_hint, not_a_tensor_message, plural
from engine.tensor import Tensor, from_dlpack

__all__ = ["InputBinder", "NativeSpec"]

#: One input as the native run path checks it: (numpy dtype, accepts numpy arrays, rank,
#: ((dim, constant), ...), ((dim, symbol index), ...)).
NativeSpec = tuple[Any, bool, int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]


class _InputSpec:
    __slots__ = ("index", "name", "dtype", "np_dtype", "device", "on_cpu", "rank", "static_shape", "const_dims",
                 "sym_dims")

    def __init__(self, index: int, name: str, sig: Any, symbols: Sequence[str], device: Device):
        self.index = index
        self.name = name
        self.dtype = sig.dtype
        self.np_dtype = sig.dtype.numpy
        self.device = device
        self.on_cpu = device == Device("cpu")
        self.rank = len(sig.shape)
        self.const_dims = tuple((d, e.constant) for d, e in enumerate(sig.shape) if e.is_constant)
        self.sym_dims = tuple((d, symbols.index(e.source)) for d, e in enumerate(sig.shape) if not e.is_constant)
        self.static_shape = tuple(e.constant for e in sig.shape) if not self.sym_dims else None


class InputBinder:
    """Turns the caller's inputs into (addresses, keep-alive objects, dispatch key)."""

    def __init__(self, meta: GraphMetaData, devices: dict[str, Device]):
        self.symbols = meta.symbols
        names = meta.input_names or tuple(f"input {i}" for i in range(len(meta.inputs)))
        #: The bundle's input names (empty when it has none) and dtypes, for the advice in errors.
        self.names = tuple(meta.input_names or ())
        self.dtype_names = tuple(sig.dtype.name for sig in meta.inputs)
        self.specs = tuple(_InputSpec(i, f"{names[i]!r}" if meta.input_names else names[i], sig, meta.symbols,
                                      devices[sig.device])
                           for i, sig in enumerate(meta.inputs))
        self.count = len(self.specs)

    def native_specs(self) -> tuple[NativeSpec, ...]:
        """Per input ``(numpy dtype, accepts numpy arrays, rank, const dims, symbol dims)``: what the
        native run path (``engine.runtime.native``) checks numpy inputs against. It checks them the
        same way and leaves every mismatch to ``bind``, so the errors are this module's."""
        return tuple((s.np_dtype, s.on_cpu, s.rank, s.const_dims, s.sym_dims) for s in self.specs)

    def bind(self, inputs: Sequence[Any]) -> tuple[list[int], list[Any], tuple[int, ...]]:
        if type(inputs) is not list and (isinstance(inputs, (np.ndarray, Tensor)) or hasattr(inputs, "__dlpack__")):
            # Iterating a single array would pass its rows as the inputs.
            raise InputError(f"the graph takes a list of {plural(self.count, 'input')}, got a single "
                             f"{type(inputs).__name__}: pass [x]"
                             + ("" if not self.specs else f" (expected: {', '.join(s.name for s in self.specs)})"))
        if len(inputs) != self.count:
            raise InputError(count_message(inputs, self.names, self.dtype_names))
        values = [-1] * len(self.symbols)
        addrs = []
        keep = []
        for spec, x in zip(self.specs, inputs):
            if type(x) is np.ndarray:
                if x.dtype is not spec.np_dtype and x.dtype != spec.np_dtype:
                    raise InputError(f"{spec.name}: expected dtype {spec.dtype.name}, got numpy {x.dtype}"
                                     + dtype_hint(self.names[spec.index] if self.names else None, spec.dtype.name))
                if not spec.on_cpu:
                    raise InputError(f"{spec.name}: expected a tensor on {spec.device}, got a numpy array (host "
                                     f"memory); move it with engine.asarray(x, device='{spec.device}')")
                if not x.flags.c_contiguous:
                    raise InputError(f"{spec.name}: the array is not C-contiguous; pass np.ascontiguousarray(x)")
                addr = array_address(x)
                shape = x.shape
            else:
                if type(x) is not Tensor:
                    x = self._convert(spec, x, inputs)
                if x.dtype is not spec.dtype and x.dtype != spec.dtype:
                    raise InputError(f"{spec.name}: expected dtype {spec.dtype.name}, got {x.dtype.name}")
                if x.device != spec.device:
                    raise InputError(f"{spec.name}: expected a tensor on {spec.device}, got one on {x.device}; "
                                     f"move it with .to('{spec.device}')")
                addr = x.storage.ptr + x.offset
                shape = x.shape
            if spec.static_shape is not None:
                if shape != spec.static_shape:
                    raise InputError(f"{spec.name}: expected shape {list(spec.static_shape)}, got {list(shape)}")
            else:
                if len(shape) != spec.rank:
                    raise InputError(f"{spec.name}: expected {spec.rank} dimensions, got shape {list(shape)}")
                for d, c in spec.const_dims:
                    if shape[d] != c:
                        raise InputError(f"{spec.name}: dimension {d} must be {c}, got {shape[d]} (shape "
                                         f"{list(shape)})")
                for d, s in spec.sym_dims:
                    v = shape[d]
                    if values[s] < 0:
                        values[s] = v
                    elif values[s] != v:
                        raise self._inconsistent(inputs, s, spec, d, v, values[s])
            addrs.append(addr)
            keep.append(x)
        return addrs, keep, tuple(values)

    def _convert(self, spec: _InputSpec, x: Any, inputs: Sequence[Any]) -> Tensor:
        if hasattr(x, "__dlpack__"):
            try:
                return from_dlpack(x)
            except InputError as exc:
                raise InputError(f"{spec.name}: {exc}") from None
        if isinstance(inputs, Mapping):  # a dict of as many names as inputs: x is one of its keys
            raise InputError(count_message(inputs, self.names, self.dtype_names))
        raise InputError(not_a_tensor_message(spec.name, x, spec.dtype.name))

    def _inconsistent(self, inputs: Sequence[Any], sym: int, spec: _InputSpec, dim: int, value: int,
                      bound: int) -> InputError:
        name = self.symbols[sym]
        first = next((f"{s.name} dimension {d}" for s in self.specs for d, ss in s.sym_dims if ss == sym), "?")
        return InputError(f"inconsistent symbol {name!r}: {first} gives {name}={bound} but {spec.name} "
                          f"dimension {dim} gives {name}={value}")
