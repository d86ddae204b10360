"""Test configuration for every distribution's tests: an isolated cache directory, registries, the
example model, the ``gpu`` marker's skip and the ``ENGINE_TEST_TORCH`` check.

It lives at the repository's root, not in ``tests/``, because the tests are kept beside their
distribution (``tests/`` for the core, ``plugins/*/tests``, ``frontends/onnx/tests``) and pytest
loads a root ``conftest.py`` for every test under the root (``pytest`` with no arguments runs the
``testpaths`` of ``pyproject.toml``; ``pytest plugins/cpu/tests`` also works). It puts ``tests/`` on
``sys.path`` so that the shared helper modules (``support``, ``gpu_fakes``, ``gpu_abi``,
``cli_support``, ...) import the same way from any test folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent
# pytest (import mode "prepend") put the root itself first on sys.path to import this file. Run from
# elsewhere (scripts/gpu-check runs pytest from $OUT, on test files given by path) the checkout's
# engine/ would then shadow the installed one, which has the compiled extensions: take it back off.
# Run from the root, it stays (``python -m pytest`` puts the working directory there anyway).
if sys.path and sys.path[0] == str(_ROOT) and Path.cwd().resolve() != _ROOT:
    del sys.path[0]
sys.path.insert(0, str(_ROOT / "tests"))


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One compile/extract cache for the session, so C sources are compiled once."""
    return tmp_path_factory.mktemp("engine-cache")


@pytest.fixture(scope="session")
def registry(session_cache):
    """A registry with the installed CPU plugin (found through its entry point)."""
    from support import make_registry

    return make_registry(session_cache)


@pytest.fixture(scope="session")
def registry2(session_cache):
    """A registry with the CPU plugin and a second kind, 'hostdev' (slot 4; 3 is reserved for opencl)."""
    from support import make_registry

    return make_registry(session_cache, with_hostdev=True)


@pytest.fixture(scope="session")
def mlp_bundle(tmp_path_factory, registry) -> Path:
    """The example MLP saved once as a zip bundle."""
    from engine.demo.mlp import build_mlp

    path = tmp_path_factory.mktemp("mlp") / "mlp.cgb"
    build_mlp(registry=registry).save(path)
    return path


def pytest_collection_modifyitems(config, items):
    """Files with the most `slow` tests first; skip `gpu` tests, with the reason, where no GPU exists
    (probing is done by each test's plugin).

    The order is for ``scripts/test``'s parallel workers (pytest-xdist, ``--dist loadfile``), which
    take whole files in collection order: a long file collected last would run on alone after the
    others are done. Within a file the order is unchanged, and the sort is stable, so every worker
    collects the same order."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])
    for item in items:
        # The marker, not the keyword: "gpu" is also the name of the tests/gpu folder, whose CPU
        # cases must run everywhere.
        if item.get_closest_marker("gpu") is not None and not _has_gpu():
            item.add_marker(pytest.mark.skip(reason="no GPU device on this machine (nvidia-smi/rocm-smi absent)"))


def _has_gpu() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None or shutil.which("rocm-smi") is not None


def pytest_configure(config):
    """``ENGINE_TEST_TORCH=1`` (CI: ``.ci/run``) makes the torch tests required: without torch the run
    stops here instead of skipping them. Otherwise they skip, with the reason, where torch is absent."""
    import importlib.util

    if os.environ.get("ENGINE_TEST_TORCH") == "1" and importlib.util.find_spec("torch") is None:
        raise pytest.UsageError("ENGINE_TEST_TORCH=1 but torch is not installed: install the torch-tests extra "
                                "(pip install -e '.[torch-tests]', which ./scripts/test does when ENGINE_TEST_TORCH=1)")
