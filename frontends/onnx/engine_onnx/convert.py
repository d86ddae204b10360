"""``convert``: an ONNX model to a bundle (a ``GraphBuilder``, saved or built by the caller).

Kernels are compiled in parallel threads ahead of the builder (the CPU plugin caches builds by
content, so the builder's own compile of each source is then a cache hit): a model has tens of
distinct kernels and the compiler runs are the bulk of a cold conversion.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import onnx

from engine.build import GraphBuilder
from engine.bundle.save import check_save_target
from engine.bundle.target import same_file
from engine.errors import SaveTargetError
from engine_onnx.gpu import GPU_KINDS, GpuKernelSpec, render
from engine_onnx.lowering import Lowering, lower
from engine_onnx.model import load_model, model_name

__all__ = ["convert", "convert_file", "check_output", "Progress"]

Progress = Callable[[int, int], None]


def convert(model: "str | os.PathLike[str] | bytes | onnx.ModelProto", *, batch_symbol: str | None = None,
            registry=None, progress: Progress | None = None, jobs: int | None = None, device: str = "cpu",
            io_device: str | None = None) -> GraphBuilder:
    """Import ``model`` and compile its kernels; returns the ``GraphBuilder`` (``.build()``, ``.save()``).

    ``batch_symbol`` makes the leading dimension of every input a symbol of that name (dimensions the
    model already names, ``dim_param``, are symbols anyway). ``device`` is the kind the kernels are
    generated for: ``cpu`` (the default), or ``cuda`` / ``opencl`` (``engine_onnx.gpu``; fewer ops have
    kernels there, docs/onnx.md). ``io_device`` puts the graph's inputs and outputs on another kind
    (``"cpu"``: host arrays in and out of a GPU model, copied by the engine). Raises
    ``UnsupportedModelError`` listing every node that cannot be imported, ``ModelLoadError`` for a
    model that cannot be read. A declared dimension the model holds at one value only (a sequence
    length torch baked into a reshape) becomes that constant, with a ``SymbolPinnedWarning``.
    """
    proto = load_model(model)
    lowering = lower(proto, batch_symbol=batch_symbol, name=model_name(model, proto), device=device,
                     io_device=io_device)
    builder = lowering.builder(registry)
    precompile(builder, lowering, progress=progress, jobs=jobs)
    return builder


def precompile(builder: GraphBuilder, lowering: Lowering, *, progress: Progress | None = None,
               jobs: int | None = None) -> None:
    """Compile every distinct kernel source on a thread pool (fills the plugin's build cache)."""
    options: dict[str, dict] = {}
    for spec in lowering.specs():
        if isinstance(spec, GpuKernelSpec):
            options[render(spec.source, lowering.device)] = {}
        else:
            options.update(spec.sources())
    specs = list(options)
    language = GPU_KINDS.get(lowering.device, "c")
    backend = builder.registry.backend(lowering.device)
    done = 0
    if progress:
        progress(0, len(specs))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for _ in pool.map(lambda src: backend.compile(src, language, options[src]), specs):
            done += 1
            if progress:
                progress(done, len(specs))


#: ``SaveTargetError.reason`` when the output names the model being converted (no overwrite helps).
MODEL_ITSELF = "the model being converted"


def check_output(src: "str | os.PathLike[str]", dst: "str | os.PathLike[str]", *, overwrite: bool = False) -> None:
    """Refuse, before any work, a ``dst`` that is the model itself (even with ``overwrite``: the
    model would be gone and the bundle could not be made again from it) or that exists and is not a
    bundle (unless ``overwrite``): ``SaveTargetError``."""
    if same_file(src, dst):
        path = os.fspath(dst)
        raise SaveTargetError(f"refusing to save the bundle to {path!r}: it is {MODEL_ITSELF}; "
                              "nothing was written (choose another path, e.g. one ending in .cgb)",
                              path=path, reason=MODEL_ITSELF)
    check_save_target(dst, overwrite=overwrite)


def convert_file(src: "str | os.PathLike[str]", dst: "str | os.PathLike[str]", *, overwrite: bool = False,
                 **kwargs) -> GraphBuilder:
    """``convert(src)`` saved to ``dst`` (a ``.cgb`` zip; a directory bundle when ``dst`` ends in ``/``).

    An existing ``dst`` is replaced only when it is a bundle; anything else (the model itself, a
    directory of other files, another file) raises ``SaveTargetError`` before the conversion starts,
    unless ``overwrite`` (which never allows replacing the model itself)."""
    check_output(src, dst, overwrite=overwrite)
    builder = convert(src, **kwargs)
    form = "dir" if str(dst).endswith(("/", os.sep)) else "zip"
    builder.save(Path(dst), form=form, overwrite=overwrite)
    return builder
