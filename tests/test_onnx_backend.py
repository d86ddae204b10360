"""ONNX's own backend node tests (``onnx.backend.test``) against the importer and the CPU plugin.

Every node test whose name starts with a supported op's test prefix is collected (``INCLUDE``).
A test fails on a wrong result, a crash or a conversion error; it is *skipped*, with the importer's
reason, only when the importer refuses the model with ``UnsupportedModelError`` (an attribute,
dtype or op outside the supported set, listed node by node in the skip message) or
``UnsupportedOpsetError`` (an opset older than 9). docs/onnx.md
gives the pass and skip counts by op.

Kernels are cached by content under the CPU plugin's cache directory, so a rerun compiles nothing.
"""

from __future__ import annotations

import unittest

import pytest

onnx = pytest.importorskip("onnx")
engine_onnx_backend = pytest.importorskip("engine_onnx.backend")

import onnx.backend.test  # noqa: E402

from engine_onnx.errors import UnsupportedModelError, UnsupportedOpsetError  # noqa: E402

#: Test-name prefixes (after ``test_``) of the ops the importer supports.
OP_PREFIXES = (
    "abs", "acos", "add", "and", "asin", "atan", "averagepool", "basic_conv", "batchnorm", "bitwise_and",
    "bitwise_or", "bitwise_xor", "cast", "castlike", "ceil", "clip", "concat", "constant", "constantofshape",
    "conv_with", "cos", "cosh", "div", "dropout", "elu", "equal", "erf", "exp", "expand", "flatten", "floor",
    "gather_0", "gather_1", "gather_2d", "gather_negative", "gelu", "gemm", "globalaveragepool", "globalmaxpool",
    "greater", "hardsigmoid", "hardswish", "identity", "layer_normalization", "leakyrelu", "less", "log",
    "logsoftmax", "lrn", "matmul", "max", "maxpool", "mean", "min", "mod", "mul", "neg", "not", "or", "pow",
    "prelu", "reciprocal", "reduce_l1", "reduce_l2", "reduce_max", "reduce_mean", "reduce_min", "reduce_prod",
    "reduce_sum", "reduce_sum_square", "relu", "reshape", "round", "selu", "shape", "sigmoid", "sign", "sin",
    "sinh", "size", "slice", "softmax", "softplus", "softsign", "split", "sqrt", "squeeze", "sub", "sum", "tan",
    "tanh", "transpose", "unsqueeze", "where", "xor",
)

#: Names the prefixes above match but that test other ops.
EXCLUDE = (
    r"^test_(matmulinteger|convinteger|convtranspose|reduce_log_sum|max_?unpool|maxroipool|logsoftmax_large|"
    r"mean_variance|constant_pad|cast_.*FLOAT8|cast_.*FLOAT4|cast_.*INT4|cast_.*UINT4|cast_.*INT2|cast_.*UINT2|"
    r"castlike_.*FLOAT8|castlike_.*FLOAT4|castlike_.*INT4|castlike_.*UINT4|castlike_.*INT2|castlike_.*UINT2)",
)


class SkippingBackend(engine_onnx_backend.EngineOnnxBackend):
    """The engine backend; a model the importer refuses is a skip carrying the importer's reasons."""

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        try:
            return super().prepare(model, device, **kwargs)
        except (UnsupportedModelError, UnsupportedOpsetError) as exc:
            raise unittest.SkipTest(f"unsupported: {exc}") from None


backend_test = onnx.backend.test.BackendTest(SkippingBackend, __name__)
for prefix in OP_PREFIXES:
    backend_test.include(rf"^test_{prefix}(_.*)?_cpu$")
for pattern in EXCLUDE:
    backend_test.exclude(pattern)

# Only the node tests: the model-zoo tests download models, the simple and PyTorch-converted ones
# are collected by their own names (none of them starts with an op prefix above).
globals().update({name: case for name, case in backend_test.test_cases.items() if "Node" in name})
