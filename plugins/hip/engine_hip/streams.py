"""The caller's stream, read from torch's ROCm build (``torch.cuda`` is HIP there).

The source returns torch's current stream on a device when torch is already imported, is a ROCm
build (``torch.version.hip``), is initialised, and the stream is not its default (null) stream;
else ``None``. So ``with torch.cuda.stream(s): graph(x)`` runs the graph on ``s`` with no extra
argument. torch is never imported here: the source only looks at ``sys.modules``. (The CUDA
plugin has its own torch source; the two are separate distributions and torch is only ever one of
the two builds, so each checks which one it is looking at.)

``ENGINE_HIP_STREAM_SOURCES`` (default ``torch``; empty for none) picks the sources.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["SOURCES", "torch_stream"]


def torch_stream(index: int) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "version", None), "hip", None) is None:
        return None
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return int(cuda.current_stream(index).cuda_stream) or None


SOURCES: dict[str, Callable[[int], int | None]] = {"torch": torch_stream}

