"""Loading a model: the file, the opset check and ONNX's own checker and shape inference."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from engine_onnx.errors import ModelLoadError, UnsupportedOpsetError

__all__ = ["load_model", "MIN_OPSET", "MAX_OPSET"]

#: The default-domain opsets the importer reads. ONNX's shipped ``light`` models are opset 9, so the
#: per-op differences from 9 on (Unsqueeze axes as an input, Softmax's axis semantics…) are handled.
MIN_OPSET = 9
MAX_OPSET = onnx.defs.onnx_opset_version()


def load_model(model: "str | os.PathLike[str] | bytes | onnx.ModelProto") -> onnx.ModelProto:
    """The model, checked and with inferred shapes; ``ModelLoadError`` when it cannot be imported."""
    if isinstance(model, onnx.ModelProto):
        proto = model
        where = proto.graph.name or "model"
    else:
        where = str(model) if not isinstance(model, bytes) else "model bytes"
        try:
            proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
        except FileNotFoundError:
            raise ModelLoadError(f"{where}: no such file; expected an .onnx model") from None
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types for a damaged file
            raise ModelLoadError(f"{where}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or not MIN_OPSET <= opset <= MAX_OPSET:
        raise UnsupportedOpsetError(f"{where}: default-domain opset {opset}; expected an opset from {MIN_OPSET} to "
                             f"{MAX_OPSET}")
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        raise ModelLoadError(f"{where}: the ONNX checker refuses it: {str(exc).splitlines()[0]}") from None
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors mean an inconsistent model
        raise ModelLoadError(f"{where}: ONNX shape inference fails: {str(exc).splitlines()[0]}") from None
    return proto


def model_name(model, proto: onnx.ModelProto) -> str:
    if isinstance(model, (str, os.PathLike)):
        return Path(model).stem
    return proto.graph.name or "model"
