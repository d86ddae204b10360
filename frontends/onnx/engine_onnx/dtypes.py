"""ONNX element types and the numpy dtypes the importer handles them as.

Its own module because both the lowering (graph inputs, initializers) and the op handlers (Cast)
map ONNX element types, and op modules must not import the lowering.
"""

from __future__ import annotations

import numpy as np
import onnx

from engine_onnx.errors import NodeUnsupported

__all__ = ["ONNX_DTYPES", "onnx_dtype"]

#: ONNX element type -> numpy dtype name, for every type the importer handles.
ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
               onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT16: "int16",
               onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.UINT8: "uint8",
               onnx.TensorProto.UINT16: "uint16", onnx.TensorProto.UINT32: "uint32",
               onnx.TensorProto.UINT64: "uint64", onnx.TensorProto.BOOL: "bool"}


def onnx_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of ONNX element type ``elem_type``; ``NodeUnsupported`` for one the importer does not handle."""
    try:
        return np.dtype(ONNX_DTYPES[elem_type])
    except KeyError:
        raise NodeUnsupported(f"element type {onnx.TensorProto.DataType.Name(elem_type)} is not supported") from None
