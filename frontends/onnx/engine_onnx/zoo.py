"""Models for tests and benchmarks, built locally (no downloads).

* ONNX's shipped ``light`` models (``onnx/backend/test/data/light``): their weights are
  ``ConstantOfShape`` fills of 0.02, which drive activations into denormals and make every output
  class equal; ``with_random_weights`` swaps them for seeded random initializers (same graph).
* ``batch_generalised``: the same model with a symbolic leading input dimension and every
  constant Reshape target's leading ``1`` replaced by ``0`` (copy the input's dimension), so ONNX
  Runtime and engine can both run it at any batch size.
* ``transformer_encoder``: a torch ``TransformerEncoder`` exported with dynamic batch and sequence.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["LIGHT_MODELS", "light_model_path", "with_random_weights", "batch_generalised", "transformer_encoder",
           "graph_inputs"]

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
                "squeezenet", "vgg19", "zfnet512")


def light_model_path(name: str) -> Path:
    return LIGHT_DIR / f"light_{name}.onnx"


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def with_random_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """``model`` with its constant-fill weights replaced by random initializers (variances positive)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    rng = np.random.default_rng(seed)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    keep, new = [], []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            fan_in = max(1, int(np.prod(shape[1:])))
            arr = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
            new.append(numpy_helper.from_array(arr, node.output[0]))
        else:
            keep.append(node)
    # BatchNormalization variances must stay positive.
    variances = {n.input[4] for n in keep if n.op_type == "BatchNormalization" and len(n.input) > 4}
    for t in new:
        if t.name in variances:
            t.CopyFrom(numpy_helper.from_array(rng.uniform(0.5, 1.5, tuple(t.dims)).astype(np.float32), t.name))
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model.graph.initializer.extend(new)
    model.ir_version = max(model.ir_version, 4)  # initializers need not be listed as inputs
    names = {i.name for i in model.graph.initializer}
    ins = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(ins)
    used = {name for n in model.graph.node for name in n.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:  # the fills' shape tensors
        model.graph.initializer.remove(init)
    return model


def batch_generalised(model: onnx.ModelProto, symbol: str = "batch") -> onnx.ModelProto:
    """``model`` with a symbolic batch: input dim 0 named, Reshape targets' leading 1 made 0."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for vi in graph_inputs(model):
        vi.type.tensor_type.shape.dim[0].dim_param = symbol
    for vi in model.graph.output:
        vi.type.tensor_type.shape.dim[0].dim_param = symbol
    del model.graph.value_info[:]
    targets = {n.input[1] for n in model.graph.node if n.op_type == "Reshape" and len(n.input) > 1}
    for init in model.graph.initializer:
        if init.name in targets:
            arr = numpy_helper.to_array(init).copy()
            if arr.size and arr[0] == 1:
                arr[0] = 0
                init.CopyFrom(numpy_helper.from_array(arr, init.name))
    return model


def transformer_encoder(layers: int = 4, d_model: int = 64, heads: int = 4, ff: int = 128, seq: int = 16,
                        seed: int = 0) -> onnx.ModelProto:
    """A torch ``TransformerEncoder`` (random weights) exported with dynamic ``batch`` and ``seq``.

    torch's exporter bakes the traced sequence length into one reshape, so run it at ``seq``.
    """
    import warnings

    import torch

    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, heads, ff, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(enc, (torch.randn(2, seq, d_model),), buf, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch", 1: "seq"}}, opset_version=17, dynamo=False)
    return onnx.load_from_string(buf.getvalue())
