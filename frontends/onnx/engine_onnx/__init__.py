"""engine-onnx: ONNX models in, engine bundles out (C kernels for the CPU plugin, or CUDA / OpenCL kernels).

``convert(model)`` returns a ``GraphBuilder``; ``convert_file(src, dst)`` writes a ``.cgb``;
``engine convert MODEL.onnx -o MODEL.cgb`` does the same from a terminal. ``EngineOnnxBackend`` is
the ``onnx.backend.base.Backend`` that ONNX's own backend test runner drives. See docs/onnx.md.

``convert``, ``convert_file`` and ``supported_ops`` are imported on first use (module
``__getattr__``): they import onnx, and importing this package must not, because the ``engine``
command loads ``engine_onnx.cli`` (its ``engine.commands`` entry point) for every command it runs.
The function ``convert`` shares its name with the submodule ``engine_onnx.convert``, which the
import system binds on the package when it first loads; the package's class (documented Python:
"customizing module attribute access") declines that binding, so ``engine_onnx.convert`` stays the
function whatever was imported first.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from engine_onnx.errors import (ImportErrorBase, ModelLoadError, SymbolPin, SymbolPinnedWarning,
                                UnsupportedModelError, UnsupportedNode, UnsupportedOpsetError)

if TYPE_CHECKING:
    from engine_onnx.convert import convert, convert_file
    from engine_onnx.ops import supported_ops

__all__ = ["convert", "convert_file", "supported_ops", "ImportErrorBase", "ModelLoadError",
           "UnsupportedModelError", "UnsupportedNode", "UnsupportedOpsetError", "SymbolPin", "SymbolPinnedWarning"]

#: The names that import onnx, and the module each comes from.
_LAZY = {"convert": "engine_onnx.convert", "convert_file": "engine_onnx.convert", "supported_ops": "engine_onnx.ops"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_onnx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """This package's module type: a lazily imported name is never shadowed by the submodule of that name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
