"""Which device a Ray worker runs its graph on, from the resources Ray assigned to it.

An actor or replica started with ``num_gpus=1`` gets a GPU id from Ray (``ray.get_gpu_ids()``),
and Ray limits ``CUDA_VISIBLE_DEVICES`` to the ids it assigned, so inside the worker the device's
index is the id's position in that list (usually ``cuda:0``). Without a GPU, or without an engine
plugin for ``cuda``, the graph runs where the bundle says (the CPU); that choice and its reason are
kept on ``Placement`` and logged, never silent.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from attrs import frozen

from engine.device import Device
from engine.plugins import Registry, default_registry

__all__ = ["Placement", "choose_placement", "current_placement"]

_log = logging.getLogger("engine.ray")


@frozen
class Placement:
    """``device`` is what ``load_compiled_graph`` gets (``None``: the bundle's own kinds, index 0)."""

    device: str | None
    reason: str


def choose_placement(requested: str | None, gpu_ids: Sequence[str | int], visible: str | None,
                     kinds: Sequence[str]) -> Placement:
    """The placement for ``gpu_ids`` assigned by Ray, ``CUDA_VISIBLE_DEVICES`` and usable engine kinds.

    ``requested`` (a device string from the user) always wins.
    """
    if requested is not None:
        return Placement(str(Device.parse(requested)), "asked for explicitly")
    if not gpu_ids:
        return Placement(None, "no GPU assigned by Ray: the bundle's devices (CPU)")
    first = str(gpu_ids[0])
    if "cuda" not in kinds:
        return Placement(None, f"Ray assigned GPU {first}, but no engine plugin provides 'cuda' "
                               f"(usable kinds: {', '.join(kinds) or 'none'}): running on the CPU")
    order = [v.strip() for v in visible.split(",")] if visible else []
    index = order.index(first) if first in order else int(first)
    return Placement(f"cuda:{index}", f"Ray assigned GPU {first} (CUDA_VISIBLE_DEVICES={visible or 'unset'})")


def current_placement(requested: str | None = None, registry: Registry | None = None) -> Placement:
    """``choose_placement`` for the calling Ray worker (outside Ray: no GPU ids)."""
    import ray

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    kinds = (registry or default_registry()).kinds() if gpu_ids and requested is None else []
    placement = choose_placement(requested, gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), kinds)
    _log.info("engine.ray placement: %s (%s)", placement.device or "bundle default", placement.reason)
    return placement
