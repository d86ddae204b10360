"""``engine --version``: what a bug report needs in one paste.

The core's version and plugin API, every installed plugin distribution with the kinds it provides
and the plugin API each speaks (or why it could not be used), Python and the platform. Plugins are
imported (discovery is cheap by contract) but no device is probed, so the answer is quick and the
same on a machine without its accelerator.
"""

from __future__ import annotations

import platform
import sys
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from engine.plugins import Registry

__all__ = ["PluginVersion", "plugin_versions", "version_text", "no_plugins_reason"]


@attrs.frozen
class PluginVersion:
    """One line of ``engine --version``: a kind, its distribution, and its API or failure."""

    kind: str
    distribution: str | None
    version: str | None
    api_version: tuple[int, int] | None
    failure: str | None


def _distributions() -> dict[str, tuple[str, str]]:
    """Entry-point name (the kind, by convention) -> (distribution, version), for every installed plugin."""
    from importlib.metadata import entry_points

    from engine.hookspecs import ENTRY_POINT_GROUP

    out: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None:
            out[ep.name] = (ep.dist.name, ep.dist.version)
    return out


def plugin_versions(registry: "Registry") -> list[PluginVersion]:
    """Usable kinds first (with their backends' API versions), then the plugins that failed."""
    dists = _distributions()
    rows = []
    for kind in registry.kinds():
        dist, version = dists.get(kind, (None, None))
        rows.append(PluginVersion(kind, dist, version, registry.backend(kind).api_version, None))
    for failure in registry.failures():
        for kind in failure.kinds or ("?",):
            rows.append(PluginVersion(kind, failure.distribution, failure.version, None, failure.cause))
    return rows


def no_plugins_reason(registry: "Registry") -> str:
    """Why a registry has no kind: discovery turned off (then what is installed), or nothing installed."""
    if not registry.settings.autoload_plugins:
        installed = ", ".join(f"{d} {v} ({k})" for k, (d, v) in sorted(_distributions().items())) or "none"
        return (f"none loaded: ENGINE_PLUGINS_AUTOLOAD=0 turns plugin discovery off (installed: {installed}); "
                f"unset it to use them")
    return "none installed (install 'engine-cpu' for the CPU)"


def version_text(registry: "Registry | None" = None) -> str:
    from engine import __version__
    from engine.backend import API_VERSION
    from engine.errors import EngineError

    lines = [f"engine {__version__} (plugin API {API_VERSION[0]}.{API_VERSION[1]})"]
    try:
        if registry is None:
            from engine.plugins import default_registry

            found = default_registry()
        else:
            found = registry
        rows = plugin_versions(found)
    except EngineError as exc:  # e.g. a malformed ENGINE_* variable: still answer what can be answered
        lines.append(f"plugins: not listed: {exc}")
        rows = None
    if rows is not None:
        if not rows:
            lines.append(f"plugins: {no_plugins_reason(found)}")
        for r in rows:
            who = f"{r.distribution or 'unknown distribution'} {r.version or ''}".rstrip()
            if r.failure is None and r.api_version is not None:
                lines.append(f"plugin {who}: kind {r.kind!r}, plugin API {r.api_version[0]}.{r.api_version[1]}")
            else:
                lines.append(f"plugin {who}: kind {r.kind!r} FAILED: {r.failure}")
    lines.append(f"Python {platform.python_version()} ({platform.python_implementation()}) at {sys.executable}")
    lines.append(f"platform {platform.platform()} ({platform.machine()})")
    return "\n".join(lines)
