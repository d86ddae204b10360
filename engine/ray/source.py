"""Where a Ray worker gets its bundle from: a path, or the bundle's bytes in Ray's object store.

The object-store path is the one that keeps **one copy of the weights per node**. ``put_bundle``
stores the zip form as a numpy ``uint8`` array: Ray hands numpy arrays to every worker on a node as
a read-only view of its shared-memory store (no copy; ``bytes`` would be unpickled into each
worker's own heap), and ``load_compiled_graph`` over that buffer uses the weights in place (on the
CPU they are never copied; ``docs/runtime.md`` §1). The zip form keeps ``weights.bin`` at a
4096-aligned offset, so the weights stay aligned for the kernels inside the store's buffer.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Union

import numpy as np

from engine.bundle.contents import read_bundle
from engine.bundle.save import write_failure
from engine.bundle.writer import bundle_to_file, copy_members
from engine.errors import EngineError, InputError, SaveError
from engine.plugins import Registry
from engine.runtime.compiled_graph import ENGINE_VERSION, CompiledGraph, load_compiled_graph

if TYPE_CHECKING:
    import ray

__all__ = ["BundleSource", "put_bundle", "bundle_buffer", "load_graph"]

#: What the integration accepts as a bundle: a path (zip file or directory form, read on each node
#: from a shared file system), an ``ObjectRef`` from ``put_bundle``, or the bundle's bytes.
BundleSource = Union[str, os.PathLike, "ray.ObjectRef", np.ndarray, bytes, bytearray, memoryview]


def put_bundle(bundle: str | os.PathLike | CompiledGraph | bytes | bytearray | memoryview) -> Any:
    """Put a bundle into Ray's object store once; returns the ``ObjectRef`` to hand to workers.

    A zip bundle's file is mapped and copied straight into the store. A directory-form bundle is
    written as the zip form, its members as they are: it is read and its weights hash-checked (the
    new manifest records whatever bytes are written), but not loaded, so the driver needs neither
    its device nor its kernels. A ``CompiledGraph`` is written with its current weights and dispatch
    table (``CompiledGraph.write_to``). Either goes through an unnamed temporary file
    (``tempfile``'s directory, ``TMPDIR``), mapped the same way: this process's heap never holds a
    copy of the weights, however big. Every worker on a node then maps the same bytes.
    """
    import ray

    if isinstance(bundle, CompiledGraph):
        return _put_zip_form(bundle.write_to, "the graph")
    if isinstance(bundle, (bytes, bytearray, memoryview)):
        return ray.put(np.frombuffer(bundle, dtype=np.uint8))
    if not isinstance(bundle, (str, os.PathLike)):
        raise InputError(f"put_bundle: expected a bundle path, a CompiledGraph or the bundle's bytes, got "
                         f"{type(bundle).__name__}")
    path = Path(bundle)
    if path.is_dir():
        contents = read_bundle(path)
        with contents.archive as archive:
            contents.verify_weights()
            members = copy_members(archive, {})
            return _put_zip_form(lambda file: bundle_to_file(file, members, engine_version=ENGINE_VERSION),
                                 repr(str(path)))
    if not path.is_file():
        raise InputError(f"put_bundle: {str(path)!r} is neither a bundle file nor a bundle directory")
    if path.stat().st_size == 0:
        raise InputError(f"put_bundle: {str(path)!r} is empty, not a bundle")
    with open(path, "rb") as file:
        return _put_mapped(file)


def _put_zip_form(write: Callable[[BinaryIO], object], what: str) -> Any:
    """``write`` the zip form into a temporary file, then put that file's bytes."""
    try:
        file = tempfile.TemporaryFile(prefix="engine-put-")
    except OSError as exc:
        raise _temporary_file_error(what, exc) from exc
    with file:
        try:
            write(file)
            file.flush()
        except EngineError:
            raise  # the bundle's own errors (a weight that cannot be read) say what they are
        except OSError as exc:
            raise _temporary_file_error(what, exc) from exc
        return _put_mapped(file)


def _temporary_file_error(what: str, exc: OSError) -> SaveError:
    where = tempfile.gettempdir()
    return SaveError(f"put_bundle: cannot write the zip form of {what} to a temporary file in {where!r}: "
                     f"{write_failure(exc)}; set TMPDIR to a directory with room for the bundle",
                     path=where, errno=exc.errno)


def _put_mapped(file: BinaryIO) -> Any:
    """``ray.put`` of a file's bytes as a ``uint8`` array, read through a map (no heap copy)."""
    import ray

    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        array = np.frombuffer(mapped, dtype=np.uint8)
        try:
            return ray.put(array)
        finally:
            del array  # the map cannot close while a view of it lives


def bundle_buffer(source: BundleSource) -> str | os.PathLike | memoryview:
    """What ``load_compiled_graph`` reads for ``source``: a path, or a read-only view of the store.

    An ``ObjectRef`` is fetched with ``ray.get``; the numpy array it gives is the shared-memory
    buffer itself, kept alive by the view (and so by the graph loaded from it).
    """
    if isinstance(source, (str, os.PathLike)):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return memoryview(source).toreadonly()
    if isinstance(source, np.ndarray):
        return _array_view(source)
    import ray

    if isinstance(source, ray.ObjectRef):
        value = ray.get(source)
        if isinstance(value, np.ndarray):
            return _array_view(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            # Unpickled into this worker's heap: works, but is a copy per worker (use put_bundle).
            return memoryview(value).toreadonly()
        raise InputError(f"the ObjectRef holds a {type(value).__name__}, not a bundle; create it with "
                         f"engine.ray.put_bundle(path)")
    raise InputError(f"expected a bundle path, an ObjectRef from engine.ray.put_bundle or the bundle's bytes, "
                     f"got {type(source).__name__}")


def _array_view(array: np.ndarray) -> memoryview:
    if array.dtype != np.uint8 or array.ndim != 1:
        raise InputError(f"a bundle buffer must be a 1-D uint8 array (engine.ray.put_bundle), got "
                         f"{array.dtype}{list(array.shape)}")
    return memoryview(array.data).toreadonly()


def load_graph(source: BundleSource, device: str | None = None, *, registry: Registry | None = None,
               dispatch_policy: str | None = None) -> CompiledGraph:
    """``load_compiled_graph`` for a path or an object-store bundle (weights used in place)."""
    return load_compiled_graph(bundle_buffer(source), device, registry=registry,  # type: ignore[arg-type]
                               dispatch_policy=dispatch_policy)
