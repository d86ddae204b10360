"""GPU tests: the core's end-to-end behaviours parametrized over device kinds (issue 10).

Every test here takes the ``kind`` fixture: ``cpu`` (runs everywhere, so the test code itself is
exercised in CI), ``cuda`` and ``hip`` (``gpu`` marker). The GPU cases are skipped, with the reason
their plugin itself gives (``engine devices``: no driver library, no device, ...), where that kind is
not usable; ``scripts/gpu-check`` runs them (``-m gpu``) on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine

KINDS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
         pytest.param("hip", id="hip", marks=pytest.mark.gpu)]
#: The GPU kinds, and the label of each in skip reasons.
GPU_KINDS = {"cuda": "CUDA", "hip": "HIP"}


def kind_unusable(kind: str) -> str | None:
    """``None`` when the installed plugin of ``kind`` reports a usable device, else why not (its own words)."""
    rows = {row.kind: row for row in engine.devices()}
    row = rows.get(kind)
    if row is None:
        return f"the engine-{kind} plugin is not installed (pip install plugins/{kind})"
    if not row.available:
        return f"{GPU_KINDS.get(kind, kind)} is not usable here: {row.reason or 'the plugin gave no reason'}"
    return None


def cuda_unusable() -> str | None:
    return kind_unusable("cuda")


def _item_kind(item) -> str:
    """The GPU kind a ``gpu`` test runs on: its ``kind`` (or ``gpu_kind``) parameter, else ``cuda``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return str(params.get("kind") or params.get("gpu_kind") or "cuda")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` cases of this folder with their plugin's own reason (before the root
    conftest's generic nvidia-smi check adds its marker, so this reason is the one reported)."""
    here = Path(__file__).parent
    # get_closest_marker, not ``"gpu" in item.keywords``: keywords also hold this folder's name.
    gpu_items = [item for item in items
                 if item.get_closest_marker("gpu") is not None and here in Path(str(item.fspath)).parents]
    if not gpu_items:
        return
    reasons = {kind: kind_unusable(kind) for kind in {_item_kind(item) for item in gpu_items}}
    for item in gpu_items:
        reason = reasons[_item_kind(item)]
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def on_device(kind, registry):
    """``on_device(array)``: the array where a graph on ``kind`` reads it (itself on the CPU)."""
    def put(array: np.ndarray):
        return array if kind == "cpu" else engine.asarray(array, device=kind, registry=registry)
    return put


@pytest.fixture
def backend(kind, registry):
    return registry.backend(kind)
