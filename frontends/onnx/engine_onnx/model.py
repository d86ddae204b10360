"""Loading a model: the file, the opset check and ONNX's own checker and shape inference."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx.version_converter
from onnx import helper, numpy_helper

from engine_onnx.errors import ModelLoadError, UnsupportedOpsetError

__all__ = ["load_model", "MIN_OPSET", "MAX_OPSET", "BASE_OPSET", "older_definition", "upgrade_opset",
           "channel_slopes"]

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
    per-node ``older_definition`` check then names the nodes that predate ``BASE_OPSET``), as it is
    when a PRelu slope's opset-6 meaning cannot be kept (``channel_slopes``). The converter works on
    a copy; the caller's model is never changed."""
    slopes = channel_slopes(proto)
    if slopes is None:
        return proto
    try:
        upgraded = onnx.version_converter.convert_version(slopes, BASE_OPSET)
        onnx.checker.check_model(upgraded)
    except Exception:  # noqa: BLE001 - the converter raises RuntimeError/ValidationError/IndexError…
        return proto
    return upgraded


def channel_slopes(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """``proto`` with each PRelu slope of an opset older than 7 made to broadcast as that opset meant,
    or None when a slope's meaning cannot be kept.

    Before version 7, PRelu applies a slope of shape ``[C]`` along axis 1 of an ``[N, C, ...]`` input
    (PyTorch's multi-parameter PReLU exports so); from version 7 on, the slope broadcasts from the
    right, and the version converter keeps it as it is, which then applies along the last axis, or
    fails to broadcast. A constant slope is reshaped to ``[C, 1, ...]`` (the same values along axis
    1, read the same way by every later version; a new initializer where other nodes read it too).
    A slope computed at run time, or an input of unknown rank, gives None: the caller then reads the
    model node by node, which refuses the opset-6 PRelu naming it, rather than risk a slope read
    along the wrong axis. Returns ``proto`` itself when nothing changes, else a changed copy.
    """
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), BASE_OPSET)
    nodes = [i for i, n in enumerate(proto.graph.node)
             if n.op_type == "PRelu" and n.domain in ("", "ai.onnx") and len(n.input) == 2]
    if opset >= 7 or not nodes:
        return proto
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception:  # noqa: BLE001 - the node-by-node check reports what is wrong with the model
        return None
    shapes = {v.name: v.type.tensor_type.shape for v in (*inferred.graph.input, *inferred.graph.value_info)
              if v.type.tensor_type.HasField("shape")}
    initializers = {t.name: t for t in proto.graph.initializer}
    reshaped: dict[int, tuple[str, list[int]]] = {}  # node index -> (slope, its new shape)
    for index in nodes:
        x, slope = proto.graph.node[index].input
        tensor = initializers.get(slope)
        slope_shape = [d.dim_value if d.HasField("dim_value") else None for d in shapes[slope].dim] \
            if slope in shapes else None
        dims = list(tensor.dims) if tensor is not None else slope_shape
        if dims is not None and (len(dims) != 1 or dims[0] == 1):
            continue  # one value for every element, or a slope laid out for broadcasting already
        rank = len(shapes[x].dim) if x in shapes else None
        if rank is not None and rank <= 2:
            continue  # [N, C]: axis 1 is the last axis, both rules agree
        if tensor is None or rank is None:
            return None
        reshaped[index] = (slope, [tensor.dims[0]] + [1] * (rank - 2))
    if not reshaped:
        return proto
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    taken = {t.name for t in proto.graph.initializer} | {v.name for v in proto.graph.input}
    for index, (slope, shape) in reshaped.items():
        name, k = f"{slope}_channels", 1
        while name in taken:
            name, k = f"{slope}_channels{k}", k + 1
        taken.add(name)
        values = numpy_helper.to_array(initializers[slope]).reshape(shape)
        proto.graph.initializer.append(numpy_helper.from_array(values, name))
        if proto.ir_version < 4:  # IR 3 and older list every initializer among the graph's inputs
            elem_type = initializers[slope].data_type
            proto.graph.input.append(helper.make_tensor_value_info(name, elem_type, shape))
        proto.graph.node[index].input[1] = name
    # A slope no node reads any more goes, with its entry among the inputs (old exporters list them).
    read = {name for node in proto.graph.node for name in node.input} | {o.name for o in proto.graph.output}
    unread = {slope for slope, _ in reshaped.values()} - read
    for field in (proto.graph.initializer, proto.graph.input):
        for item in [item for item in field if item.name in unread]:
            field.remove(item)
    return proto


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
