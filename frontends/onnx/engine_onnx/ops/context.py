"""``LoweringContext``: what an op handler may ask of the lowering, as a Protocol.

The op modules are written against this interface rather than against ``lowering.Lowering``, so
they can be read, typed and imported without the lowering (which imports the op registry at run
time): the dependency points one way, from the lowering to the ops. ``Lowering`` provides every
member (frontends/onnx/tests/test_onnx_ops_layout.py holds it to that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import onnx

from engine_onnx.dims import Dim

if TYPE_CHECKING:
    from engine_onnx.batch_flow import BatchFlow
    from engine_onnx.codegen import KernelSpec
    from engine_onnx.concat_slices import ConcatFill, ConcatSlice
    from engine_onnx.gpu import GpuKernelSpec

__all__ = ["LoweringContext", "Handler"]


@runtime_checkable
class LoweringContext(Protocol):
    """The lowering as an op handler sees it (``lowering.Lowering`` documents each member)."""

    #: The model's name (error messages).
    name: str
    #: The model's default-domain opset version.
    opset: int
    #: Values that could not be computed (their producer was refused).
    poisoned: set[str]
    #: Whether the batch flows sample by sample through a value (``batch_flow``).
    batch_flow: BatchFlow

    @property
    def gpu(self) -> bool: ...

    def attr(self, node: onnx.NodeProto, name: str, default: Any = None) -> Any: ...

    def is_const(self, name: str) -> bool: ...

    def const(self, name: str) -> np.ndarray | None: ...

    def require_const(self, name: str, what: str) -> np.ndarray: ...

    def value(self, name: str) -> np.ndarray | None: ...

    def shape(self, name: str) -> tuple[Dim, ...]: ...

    def static_size(self, name: str, axis: int) -> int | None: ...

    def dtype(self, name: str) -> np.dtype: ...

    def set_const(self, name: str, value: np.ndarray) -> None: ...

    def add_weight(self, array: np.ndarray, hint: str) -> str: ...

    def alias(self, out: str, src: str, shape: Sequence[Dim]) -> None: ...

    def emit(self, spec: KernelSpec | GpuKernelSpec, inputs: Iterable[str],
             outputs: Sequence[tuple[str, Any, Sequence[Dim]]],
             *, in_place: Mapping[int, int] | None = None) -> None: ...

    def take_concat_slice(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> ConcatSlice | None: ...

    def concat_fill(self, node: onnx.NodeProto) -> ConcatFill | None: ...

    def mark_sliced(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> None: ...

    def sole_consumer(self, name: str) -> onnx.NodeProto | None: ...

    def sole_value_consumer(self, name: str) -> onnx.NodeProto | None: ...

    def defer(self, name: str, dtype: np.dtype, shape: Sequence[Dim], payload: Any,
              materialize: Callable[[], None]) -> None: ...

    def pending(self, name: str) -> Any | None: ...

    def take_pending(self, name: str) -> Any: ...

    def is_used(self, name: str) -> bool: ...

    def mark_fused(self, node: onnx.NodeProto) -> None: ...

    def take_epilogue(self, node: onnx.NodeProto, dtype: np.dtype,
                      start: str | None = None) -> tuple[Callable[[str], str], str]: ...

    def take_residual_add(self, name: str, dtype: np.dtype, shape: Sequence[Dim]) -> tuple[str, str] | None: ...

    def take_bias_add(self, name: str, n: Dim, rank: int) -> tuple[np.ndarray, str] | None: ...

    def next_id(self) -> int: ...


#: An op handler: lowers one node through the context, or raises ``NodeUnsupported``.
Handler = Callable[[LoweringContext, onnx.NodeProto], None]
