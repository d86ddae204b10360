"""The error tree in ``engine.errors``' docstring is whole and true.

Every module of the core, the plugins and the ONNX importer is imported, and every subclass of
``EngineError`` they define must appear in the tree under each of its engine parents; every name
in the tree must be such a class. A new error class without its line in the tree fails here.
"""

from __future__ import annotations

import importlib
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

