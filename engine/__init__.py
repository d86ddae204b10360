"""engine: a plugin-based, multi-backend execution engine for compiled graphs.

Load a bundle and run it::

    import engine
    graph = engine.load_compiled_graph("model.cgb")      # device="cuda:1" picks a device index
    (probs,) = graph.run_async([x])                       # numpy, engine.Tensor or any DLPack tensor
    probs.numpy()

Bundles contain native code: loading one runs it. Only load bundles you trust.
"""

from engine.errors import (BundleError, BundleFileError, BundleNotFoundError, DeviceUnavailableError, EngineError,
                           GraphClosedError, InputError, KernelError, OutOfMemoryError, PluginError, SaveError,
                           SaveTargetError, UnconvertedModelError, Unsupported)
from engine.hookspecs import hookimpl
from engine.device import Device
from engine.dtypes import (DType, bfloat16, bool_, float8_e4m3fn, float8_e5m2, float16, float32, float64, int8,
                           int16, int32, int64, uint8, uint16, uint32, uint64)
from engine.storage import ExternalStorage, Storage
from engine.tensor import Tensor, asarray, empty, from_dlpack
from engine.bundle.schema import (GraphExecution, GraphExecutionInstruction, GraphMetaData, KernelMeta,
                                  TensorSignature)
from engine.plugins import devices
from engine.runtime.compiled_graph import CompiledGraph, RunStats, load_compiled_graph, save_compiled_graph
from engine.runtime.tasks import CompiledTask
from engine.runtime.capture import CapturedGraph
from engine.runtime.interpreter import ModelExecutionHook

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # loading, saving, running
    "load_compiled_graph",
    "save_compiled_graph",
    "CompiledGraph",
    "CompiledTask",
    "CapturedGraph",
    "RunStats",
    "ModelExecutionHook",
    "GraphMetaData",
    "GraphExecution",
    "GraphExecutionInstruction",
    "TensorSignature",
    "KernelMeta",
    # tensors and devices
    "Tensor",
    "asarray",
    "empty",
    "from_dlpack",
    "Storage",
    "ExternalStorage",
    "Device",
    "devices",
    "DType",
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    # plugins
    "hookimpl",
    # errors
    "EngineError",
    "BundleError",
    "BundleFileError",
    "BundleNotFoundError",
    "UnconvertedModelError",
    "InputError",
    "GraphClosedError",
    "KernelError",
    "PluginError",
    "DeviceUnavailableError",
    "OutOfMemoryError",
    "SaveError",
    "SaveTargetError",
    "Unsupported",
]
