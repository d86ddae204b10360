"""The caller's stream, read from the frameworks that have one: torch and CuPy.

Each source returns the framework's current stream on a device when the framework is already
imported and initialised in this process and the stream is not its default (legacy) stream, else
``None``. So ``with torch.cuda.stream(s): graph(x)`` runs the graph on ``s`` with no extra
argument, while code that never touches a framework stream keeps the engine's per-thread streams
(the legacy default stream serialises every thread and cannot be captured). The frameworks are
never imported here: a source only looks at ``sys.modules``.

``ENGINE_CUDA_STREAM_SOURCES`` (default ``torch,cupy``; empty for none) picks the sources.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["SOURCES", "torch_stream", "cupy_stream"]


def torch_stream(index: int) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return int(cuda.current_stream(index).cuda_stream) or None


def cupy_stream(index: int) -> int | None:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        with cupy.cuda.Device(index):
            return int(cupy.cuda.get_current_stream().ptr) or None
    except Exception:  # noqa: BLE001 - a CuPy without a usable device has no stream to follow
        return None


SOURCES: dict[str, Callable[[int], int | None]] = {"torch": torch_stream, "cupy": cupy_stream}

