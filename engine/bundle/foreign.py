"""Files people hand over where a bundle belongs that are models still to be converted.

An ONNX model given to ``load_compiled_graph`` or ``engine inspect/run/bench`` would otherwise be
reported as "not a zip archive", which says what is wrong but not what to do. Recognised by the
name alone (``.onnx``) and only when the file does not start like a zip: a bundle that happens to
be named ``.onnx`` still loads, and nothing is parsed to find out.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.bundle.zipformat import ZIP_MAGIC
from engine.errors import UnconvertedModelError

__all__ = ["check_not_a_model", "CONVERTERS"]

#: File suffix -> (format, the command that turns such a file into a bundle, the package providing it).
CONVERTERS = {".onnx": ("ONNX", "engine convert {src} -o {dst}", "engine-onnx")}


def check_not_a_model(source: object) -> None:
    """Raise ``UnconvertedModelError`` when ``source`` is a path to a model file to convert first."""
    if not isinstance(source, (str, os.PathLike)):
        return
    path = Path(source)
    known = CONVERTERS.get(path.suffix.lower())
    if known is None or not path.is_file():
        return
    try:
        with open(path, "rb") as f:
            if f.read(4) in ZIP_MAGIC:
                return
    except OSError:
        return  # unreadable: the bundle reader says so
    fmt, command, package = known
    text = os.fspath(source)
    text = text if isinstance(text, str) else os.fsdecode(text)
    run = command.format(src=text, dst=str(Path(text).with_suffix(".cgb")))
    raise UnconvertedModelError(f"{text}: an {fmt} model, not a bundle: convert it first with '{run}' "
                                f"(the {package} package)", filename=text, model_format=fmt, command=run)
