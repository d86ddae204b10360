"""The error tree in ``engine.errors``' docstring is whole and true.

Every module of the core, the plugins and the ONNX importer is imported, and every subclass of
``EngineError`` they define must appear in the tree under each of its engine parents; every name
in the tree must be such a class. A new error class without its line in the tree fails here.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re

import engine.errors
from engine.errors import EngineError

#: The distributions whose errors the tree lists; one that is not installed is left out of the check.
PACKAGES = ("engine", "engine_cpu", "engine_cuda", "engine_hip", "engine_opencl", "engine_onnx")


def _import_all() -> set[str]:
    """Imports every module of ``PACKAGES`` that is installed; returns the packages found."""
    found = set()
    for name in PACKAGES:
        try:
            package = importlib.import_module(name)
        except ImportError:
            continue
        found.add(name)
        for module in pkgutil.walk_packages(package.__path__, prefix=f"{name}."):
            if module.name.rsplit(".", 1)[-1] == "__main__":
                continue  # runs the command line
            importlib.import_module(module.name)
    return found


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def _tree_edges() -> set[tuple[str, str]]:
    """(class, parent) for every line of the docstring's tree."""
    doc = engine.errors.__doc__ or ""
    lines = doc[doc.index("    EngineError\n"):].splitlines()
    edges = set()
    stack = ["EngineError"]
    for line in lines[1:]:
        m = re.match(r"^(\s*(?:│\s*)*)[├└]── (\w+)", line)
        if not m:
            if not line.strip():
                break
            continue
        depth = len(m.group(1)) // 5
        name = m.group(2)
        del stack[depth:]
        edges.add((name, stack[depth - 1]))
        stack.append(name)
    return edges


def test_the_tree_parses_into_the_documented_shape() -> None:
    edges = _tree_edges()
    assert ("BundleError", "EngineError") in edges
    assert ("BundleNotFoundError", "BundleFileError") in edges
    assert ("SaveTargetError", "SaveError") in edges


def test_every_engine_error_class_is_in_the_tree_under_each_parent() -> None:
    found = _import_all()
    assert {"engine", "engine_cpu"} <= found
    edges = _tree_edges()
    listed = {name for name, _ in edges}
    missing = []
    for cls in sorted(_subclasses(EngineError), key=lambda c: (c.__module__, c.__qualname__)):
        if cls.__module__.split(".")[0] not in PACKAGES or cls.__name__.startswith("_"):
            continue  # a test's own class, or a private one
        for base in cls.__bases__:
            if issubclass(base, EngineError) and (cls.__name__, base.__name__) not in edges:
                missing.append(f"{cls.__module__}.{cls.__qualname__} under {base.__name__}")
    assert not missing, f"not in engine.errors' tree: {missing}"
    known = {c.__name__ for c in _subclasses(EngineError)}
    if found == set(PACKAGES):
        assert listed <= known, f"in the tree but no such class: {sorted(listed - known)}"



def _sample(cls: type) -> BaseException:
    """An instance of ``cls`` with every attribute its ``__init__`` takes set to a telling value."""
    import errno

    samples = {
        "BundleError": lambda: cls("a message", member="plan.json", path="$.tasks[3]"),
        "BundleFileError": lambda: cls("a message", errno=errno.EACCES, strerror="Permission denied",
                                       filename="/x.cgb"),
        "BundleNotFoundError": lambda: cls("a message", errno=errno.ENOENT, strerror="No such file",
                                           filename="/x.cgb"),
        "UnconvertedModelError": lambda: cls("a message", filename="m.onnx", model_format="ONNX",
                                             command="engine convert m.onnx -o m.cgb"),
        "OutOfMemoryError": lambda: cls(1 << 30, "cpu:0", "the limit", "output 0 ('y') at batch=8"),
        "SaveError": lambda: cls("a message", path="/x.cgb", errno=errno.ENOSPC),
        "SaveTargetError": lambda: cls("a message", path="/x", reason="a directory of other files"),
        "UnsupportedModelError": lambda: cls([_unsupported_node()], "m.onnx"),
        "PinSymbol": lambda: cls("seq", 16, "the attention Reshape holds 16 only"),
    }
    if cls.__name__ in samples:
        return samples[cls.__name__]()
    # Any other: the message, and each further required parameter named in its value.
    import inspect

    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    args, kwargs = ["a message"], {}
    for param in params[1:]:
        value = 7 if str(param.annotation) in ("int", "<class 'int'>") else f"<{param.name}>"
        if param.default is inspect.Parameter.empty and param.kind is param.KEYWORD_ONLY:
            kwargs[param.name] = value
        elif param.default is inspect.Parameter.empty and param.kind is param.POSITIONAL_OR_KEYWORD:
            args.append(value)
    return cls(*args, **kwargs)


def _unsupported_node():
    from engine_onnx.errors import UnsupportedNode

    return UnsupportedNode("n1", "Loop", "op type not supported")


def _state(error: BaseException) -> tuple:
    attributes = dict(vars(error))
    if isinstance(error, OSError):
        attributes.update(errno=error.errno, strerror=error.strerror, filename=error.filename)
    return type(error), str(error), error.args, attributes


def test_every_engine_error_pickles_with_its_message_and_attributes() -> None:
    """Errors cross processes (process pools, Ray, pytest-xdist): each comes back the same class,
    with the same message and every attribute, whatever its ``__init__`` takes."""
    import pickle

    _import_all()
    classes = [c for c in _subclasses(EngineError) | {EngineError}
               if c.__module__.split(".")[0] in PACKAGES and not c.__name__.startswith("_")]
    assert len(classes) > 15
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        if cls.__name__ == "UnsupportedModelError" and importlib.util.find_spec("engine_onnx") is None:
            continue
        error = _sample(cls)
        assert _state(pickle.loads(pickle.dumps(error))) == _state(error), cls.__qualname__


def test_the_symbol_pinned_warning_pickles_and_rebuilds_from_its_args() -> None:
    import pickle

    import pytest

    errors = pytest.importorskip("engine_onnx.errors")
    pin = errors.SymbolPin("seq", 16, "/layers.0/Reshape", "Reshape", "its shape constant holds 16")
    warning = errors.SymbolPinnedWarning(pin, "encoder")
    for copy in (pickle.loads(pickle.dumps(warning)), type(warning)(*warning.args)):
        assert str(copy) == str(warning) and copy.pin == pin and copy.model == "encoder"
    assert str(warning).startswith("encoder: seq fixed to 16: /layers.0/Reshape (Reshape)")
