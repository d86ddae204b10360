"""Models for tests and benchmarks, built locally (no downloads).

* ONNX's shipped ``light`` models (``onnx/backend/test/data/light``): their weights are
  ``ConstantOfShape`` fills of 0.02, which drive activations into denormals and make every output
  class equal; ``with_random_weights`` swaps them for seeded random initializers (same graph).
* ``batch_generalised``: the same model with a symbolic leading input dimension and every
  constant Reshape target's leading ``1`` replaced by ``0`` (copy the input's dimension), so ONNX
  Runtime and engine can both run it at any batch size.
* ``transformer_encoder``: a torch ``TransformerEncoder`` exported with dynamic batch and sequence.
* ``resnet18``, ``mobilenet_v2``: torchvision's architectures written out in torch (torchvision is
  not a dependency and nothing is downloaded), seeded random weights and BatchNorm statistics,
  exported with a dynamic batch.
* ``bert_encoder``: a small BERT-style encoder written in torch (token, position and token-type
  embeddings, an additive attention mask from a 0/1 mask, erf GELU, a tanh pooler), dynamic batch
  and sequence; ``bert_inputs`` makes matching token ids and masks.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["LIGHT_MODELS", "light_model_path", "with_random_weights", "batch_generalised", "transformer_encoder",
           "graph_inputs", "resnet18", "mobilenet_v2", "bert_encoder", "bert_inputs"]

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
            # Drawn in float32: a float64 draw converted afterwards takes several times as long.
            arr = rng.standard_normal(shape, dtype=np.float32)
            arr *= np.float32(1.0 / np.sqrt(fan_in))
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

    torch's exporter bakes the traced sequence length into one reshape, so the model holds at
    ``seq`` only: ``convert`` pins that dimension (``SymbolPinnedWarning``).
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


def _export(module, args: tuple, input_names: list[str], output_names: list[str], dynamic_axes: dict,
            *, keep_batchnorm: bool = False) -> onnx.ModelProto:
    """``module`` (eval mode) exported at opset 17 by torch's TorchScript exporter.

    ``keep_batchnorm``: export in ``TrainingMode.PRESERVE`` (the module is in eval mode, so the
    BatchNormalization nodes are inference ones) instead of ``EVAL``, whose peephole pass folds each
    BatchNormalization into the Conv before it: the importer's own folding is then what is tested.
    """
    import warnings

    import torch

    extra = {"training": torch.onnx.TrainingMode.PRESERVE} if keep_batchnorm else {}
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=17, dynamo=False, **extra)
    return onnx.load_from_string(buf.getvalue())


def _randomise_batchnorm(module, generator) -> None:
    """Give every BatchNorm2d random affine parameters and running statistics (variances positive),
    so that a fold of the normalisation into the Conv before it is checked with values that matter."""
    import torch

    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            c = m.num_features
            m.weight.data = torch.rand(c, generator=generator) * 0.5 + 0.75
            m.bias.data = torch.randn(c, generator=generator) * 0.1
            m.running_mean.data = torch.randn(c, generator=generator) * 0.1
            m.running_var.data = torch.rand(c, generator=generator) + 0.5


def _init_conv_linear(module, generator) -> None:
    """torchvision's initialisation (Kaiming-normal, fan out, for convolutions; small normal for the
    classifier), drawn from ``generator`` so the weights are the same on every machine and run."""
    import torch

    for m in module.modules():
        if isinstance(m, torch.nn.Conv2d):
            fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]  # torch's fan_out ignores groups
            m.weight.data = torch.randn(m.weight.shape, generator=generator) * (2.0 / fan_out) ** 0.5
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, torch.nn.Linear):
            m.weight.data = torch.randn(m.weight.shape, generator=generator) * 0.01
            m.bias.data = torch.randn(m.bias.shape, generator=generator) * 0.01


def _resnet18_module():
    """torchvision's ``resnet18`` (BasicBlock, layers [2, 2, 2, 2], 1000 classes), written out."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int = 1):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = None
            if stride != 1 or inplanes != planes:
                self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                                nn.BatchNorm2d(planes))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            layers, inplanes = [], 64
            for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
                inplanes = planes
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _mobilenet_v2_module():
    """torchvision's ``mobilenet_v2`` (width 1.0, ReLU6, 1000 classes), written out."""
    import torch
    from torch import nn

    def conv_bn_relu6(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        return nn.Sequential(nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(out), nn.ReLU6(inplace=True))

    class InvertedResidual(nn.Module):
        def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
            super().__init__()
            hidden = int(round(inp * expand_ratio))
            self.use_res_connect = stride == 1 and inp == oup
            layers = [conv_bn_relu6(inp, hidden, 1)] if expand_ratio != 1 else []
            layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                       nn.Conv2d(hidden, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self, num_classes: int = 1000, width_mult: float = 1.0):
            super().__init__()
            settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
                        [6, 160, 3, 2], [6, 320, 1, 1]]
            inp = _make_divisible(32 * width_mult)
            self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
            features = [conv_bn_relu6(3, inp, stride=2)]
            for t, c, n, s in settings:
                out = _make_divisible(c * width_mult)
                for i in range(n):
                    features.append(InvertedResidual(inp, out, s if i == 0 else 1, t))
                    inp = out
            features.append(conv_bn_relu6(inp, self.last_channel, 1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(self.last_channel, num_classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(torch.flatten(x, 1))

    return MobileNetV2()


def _vision_model(module, seed: int, size: int, keep_batchnorm: bool) -> onnx.ModelProto:
    import torch

    generator = torch.Generator().manual_seed(seed)
    _init_conv_linear(module, generator)
    _randomise_batchnorm(module, generator)
    module.eval()
    x = torch.randn(1, 3, size, size, generator=generator)
    return _export(module, (x,), ["x"], ["y"], {"x": {0: "batch"}, "y": {0: "batch"}},
                   keep_batchnorm=keep_batchnorm)


def resnet18(seed: int = 0, *, keep_batchnorm: bool = True) -> onnx.ModelProto:
    """torchvision's ResNet-18 (random weights, random BatchNorm statistics) with a dynamic ``batch``;
    input ``x`` [batch, 3, 224, 224], output ``y`` [batch, 1000]. ``keep_batchnorm``: see ``_export``."""
    return _vision_model(_resnet18_module(), seed, 224, keep_batchnorm)


def mobilenet_v2(seed: int = 0, *, keep_batchnorm: bool = True) -> onnx.ModelProto:
    """torchvision's MobileNetV2 (width 1.0, ReLU6; random weights and BatchNorm statistics) with a
    dynamic ``batch``; input ``x`` [batch, 3, 224, 224], output ``y`` [batch, 1000]."""
    return _vision_model(_mobilenet_v2_module(), seed, 224, keep_batchnorm)


def _bert_module(vocab: int, hidden: int, layers: int, heads: int, intermediate: int, max_positions: int,
                 type_vocab: int):
    """A BERT encoder written as Hugging Face's ``BertModel`` computes it (post-LayerNorm layers, erf
    GELU, additive attention mask from a 0/1 mask, tanh pooler over the first token)."""
    import math

    import torch
    from torch import nn

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(vocab, hidden)
            self.position_embeddings = nn.Embedding(max_positions, hidden)
            self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
            self.register_buffer("position_ids", torch.arange(max_positions).expand((1, -1)), persistent=False)

        def forward(self, input_ids, token_type_ids):
            position_ids = self.position_ids[:, : input_ids.size(1)]
            x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
                 + self.position_embeddings(position_ids))
            return self.LayerNorm(x)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim = hidden // heads
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

        def split(self, x):
            return x.view(x.size()[:-1] + (heads, self.head_dim)).permute(0, 2, 1, 3)

        def forward(self, x, mask):
            q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
            return ctx.view(ctx.size()[:-2] + (hidden,))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = SelfAttention()
            self.attention_output = nn.Linear(hidden, hidden)
            self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.intermediate = nn.Linear(hidden, intermediate)
            self.output = nn.Linear(intermediate, hidden)
            self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x, mask):
            x = self.attention_norm(x + self.attention_output(self.attention(x, mask)))
            h = nn.functional.gelu(self.intermediate(x))  # erf GELU, as BERT's "gelu"
            return self.output_norm(x + self.output(h))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = Embeddings()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.pooler = nn.Linear(hidden, hidden)

        def forward(self, input_ids, attention_mask):
            token_type_ids = torch.zeros_like(input_ids)
            mask = attention_mask[:, None, None, :].to(torch.float32)
            mask = (1.0 - mask) * torch.finfo(torch.float32).min
            x = self.embeddings(input_ids, token_type_ids)
            for layer in self.layers:
                x = layer(x, mask)
            return x, torch.tanh(self.pooler(x[:, 0]))

    return Bert()


def bert_encoder(layers: int = 4, hidden: int = 128, heads: int = 4, intermediate: int = 512, vocab: int = 1000,
                 max_positions: int = 128, seed: int = 0) -> onnx.ModelProto:
    """A small BERT-style encoder (random weights) with dynamic ``batch`` and ``seq``.

    Inputs ``input_ids`` and ``attention_mask`` (int64, [batch, seq]; the mask is 1 for tokens, 0 for
    padding); outputs ``last_hidden_state`` [batch, seq, hidden] and ``pooler_output`` [batch, hidden].
    """
    import torch

    torch.manual_seed(seed)
    module = _bert_module(vocab, hidden, layers, heads, intermediate, max_positions, 2)
    with torch.no_grad():  # BERT's initialisation: normal(0, 0.02) weights, so LayerNorm sees realistic ranges
        for p in module.parameters():
            p.normal_(0.0, 0.02)
        for m in module.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.8, 1.2)
    module.eval()
    ids = torch.randint(0, vocab, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "last_hidden_state": {0: "batch", 1: "seq"}, "pooler_output": {0: "batch"}}
    return _export(module, (ids, mask), ["input_ids", "attention_mask"], ["last_hidden_state", "pooler_output"], axes)


def bert_inputs(batch: int, seq: int, vocab: int = 1000, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids and a 0/1 attention mask for ``bert_encoder``: row ``i`` has its last ``i % seq`` positions
    padded (mask 0), so the additive mask changes the result."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for i in range(batch):
        pad = i % seq
        if pad:
            mask[i, seq - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}
