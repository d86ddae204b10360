"""GPU kernels of the ONNX importer (``engine_onnx.gpu``): elementwise groups and data movement.

Every model is converted for ``opencl`` and run on the OpenCL driver (PoCL in CI) against ONNX
Runtime, and converted for ``cuda`` with every kernel compiled by NVRTC (cubins and PTX); on a
machine with a CUDA GPU the same models run there (``onnx_support.check_gpu``). Ops without GPU
kernels are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnx_support import check_gpu, gpu_reason, small_model, value_info

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))

RNG = np.random.default_rng(0)


def _feeds(shapes: dict, batches=(1, 3), dtype=np.float32):
    return [{n: RNG.standard_normal((b, *s)).astype(dtype) for n, s in shapes.items()} for b in batches]


def test_a_fused_elementwise_chain_with_broadcasting_matches_ort(tmp_path) -> None:
    nodes = [helper.make_node("Add", ["x", "y"], ["a"]), helper.make_node("Erf", ["a"], ["b"]),
             helper.make_node("Mul", ["b", "x"], ["c"]), helper.make_node("Sigmoid", ["c"], ["d"]),
             helper.make_node("Div", ["d", "y"], ["z"]), helper.make_node("Max", ["z", "x", "a"], ["m"])]
    m = small_model(nodes, [value_info("x", T.FLOAT, ["batch", 3, 4]), value_info("y", T.FLOAT, [4])],
               [value_info("z", T.FLOAT, None), value_info("m", T.FLOAT, None)])
    feeds = [{"x": RNG.standard_normal((b, 3, 4)).astype(np.float32),
              "y": RNG.uniform(0.5, 2, 4).astype(np.float32)} for b in (1, 3)]
    names = check_gpu(m, feeds, tmp_path)
    # "a" is read twice, so it is written; the Erf…Div chain is one kernel, Max another
    assert [n.rsplit("_", 1)[0] for n in names if "copy" not in n] == ["add", "fused_erf_mul_sigmoid_div", "max"]
