"""engine-onnx: ONNX models in, engine bundles out (C kernels for the CPU plugin, or CUDA / OpenCL kernels).

``convert(model)`` returns a ``GraphBuilder``; ``convert_file(src, dst)`` writes a ``.cgb``;
``engine convert MODEL.onnx -o MODEL.cgb`` does the same from a terminal. ``EngineOnnxBackend`` is
the ``onnx.backend.base.Backend`` that ONNX's own backend test runner drives. See docs/onnx.md.
"""

from engine_onnx.convert import convert, convert_file
from engine_onnx.errors import (ImportErrorBase, ModelLoadError, UnsupportedModelError, UnsupportedNode,
                                UnsupportedOpsetError)
from engine_onnx.ops import supported_ops

__all__ = ["convert", "convert_file", "supported_ops", "ImportErrorBase", "ModelLoadError",
           "UnsupportedModelError", "UnsupportedNode", "UnsupportedOpsetError"]
