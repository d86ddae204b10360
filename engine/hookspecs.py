"""Hook specifications for device plugins: the whole plugin contract a vendor has to read.

A plugin is a distribution with an entry point in the group ``engine.devices``; the entry point's
value names a module (or object) holding functions marked with ``hookimpl`` (defined here and
re-exported as ``engine.hookimpl``; plugins take it from here, the contract they depend on, rather
than from the application facade)::

    # my_accel/plugin.py
    from engine.hookspecs import hookimpl

    @hookimpl
    def engine_backends(settings):
        return [MyAccelBackend(cache_dir=settings.cache_dir)]

    # pyproject.toml
    [project.entry-points."engine.devices"]
    myaccel = "my_accel.plugin"

Hooks are called at discovery time only. The run loop never goes through pluggy (a pluggy call
costs many times a method call); it calls methods of the Backend objects returned here, bound once
when a plan is prepared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from engine.backend import BackendBase
    from engine.settings import Settings

__all__ = ["PROJECT_NAME", "ENTRY_POINT_GROUP", "hookspec", "hookimpl", "engine_backends"]

PROJECT_NAME = "engine"
ENTRY_POINT_GROUP = "engine.devices"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------


@hookspec
def engine_backends(settings: "Settings") -> "list[BackendBase]":  # type: ignore[empty-body]  # a spec
    """Return one Backend per device kind this plugin provides.

    ``settings`` is the registry's configuration (cache directory and the rest, read once from the
    environment or given by the application); a backend keeps what it needs from it instead of
    reading ``os.environ``. Implementations may omit the parameter (pluggy passes only the
    arguments an implementation names).

    Called once, when the registry loads the plugin. Must be cheap and must not touch hardware
    (no driver initialisation, no device queries): a machine without the device still imports the
    plugin, and ``Backend.availability()`` reports why it cannot be used. Each backend declares its
    ``kind``, ``workspace_slot`` (cpu 0, cuda 1, hip 2, opencl 3; third parties any other slot >= 3,
    unique per process: ``engine.plugins.RESERVED_SLOTS``)
    and ``api_version``; a backend whose API major differs from ``engine.backend.API_VERSION`` is
    refused and recorded with the reason.
    """
