"""Loading a model: the file, the opset check and ONNX's own checker and shape inference."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx.version_converter

from engine_onnx.errors import ModelLoadError, UnsupportedOpsetError

__all__ = ["load_model", "MIN_OPSET", "MAX_OPSET", "BASE_OPSET", "older_definition", "upgrade_opset"]

#: The opset whose operator definitions the handlers read, and every later one: ONNX's shipped
#: ``light`` models are opset 9, so the per-op differences from 9 on (Unsqueeze axes as an input,
#: Softmax's axis semantics…) are handled.
BASE_OPSET = 9
#: The default-domain opsets a model may declare. A model older than ``BASE_OPSET`` is first
#: rewritten to ``BASE_OPSET`` by ONNX's own version converter (``upgrade_opset``: Add v6's
#: ``broadcast``/``axis``, BatchNormalization v6's ``is_test``, Constant v1…), which knows each
#: operator's history; where it cannot convert the model, the model is read node by node: an
#: operator whose definition did not change between the model's opset and ``BASE_OPSET`` (Relu,
#: Not, And…) is the operator the handler knows; any other is refused with its node named
#: (``older_definition``), so an old model imports exactly when everything in it means today's thing.
MIN_OPSET = 1
MAX_OPSET = onnx.defs.onnx_opset_version()


def older_definition(op_type: str, opset: int) -> str | None:
    """Why a default-domain node of a model at ``opset`` (older than ``BASE_OPSET``) cannot be read
    as the operator the handlers know; None when its definition is the one in force at
    ``BASE_OPSET``."""
    if opset >= BASE_OPSET:
        return None
    try:
        version = onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:
        return None  # not an ONNX operator at that opset: the handler lookup names it
    try:
        base = onnx.defs.get_schema(op_type, BASE_OPSET, "").since_version
    except onnx.defs.SchemaError:
        base = None
    if version == base:
        return None
    return (f"the opset-{opset} definition of {op_type} (version {version}); the importer reads "
            + (f"version {base} and later (opset {BASE_OPSET} on)" if base else f"operators as of opset {BASE_OPSET}"))


def upgrade_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` rewritten to ``BASE_OPSET`` by ONNX's version converter, or ``proto`` itself when the
    converter has no adapter for one of its operators or its result fails the checker (the caller's
    per-node ``older_definition`` check then names the nodes that predate ``BASE_OPSET``). The
    converter works on a copy; the caller's model is never changed."""
    try:
        upgraded = onnx.version_converter.convert_version(proto, BASE_OPSET)
        onnx.checker.check_model(upgraded)
    except Exception:  # noqa: BLE001 - the converter raises RuntimeError/ValidationError/IndexError…
        return proto
    return upgraded


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
    if opset < BASE_OPSET:
        proto = upgrade_opset(proto)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors mean an inconsistent model
        raise ModelLoadError(f"{where}: ONNX shape inference fails: {str(exc).splitlines()[0]}") from None
    return proto


def model_name(model, proto: onnx.ModelProto) -> str:
    if isinstance(model, (str, os.PathLike)):
        return Path(model).stem
    return proto.graph.name or "model"
