"""Environment configuration, read once into a frozen object.

Nothing deep in the engine reads ``os.environ``: the registry and graphs receive a ``Settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import attrs

__all__ = ["Settings", "DISPATCH_POLICIES"]

DISPATCH_POLICIES = ("tune", "first", "nearest", "error")


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engine"


@attrs.frozen
class Settings:
    #: ``ENGINE_DEVICES=cuda,cpu``: kinds to use, in preference order (``None``: all).
    devices: tuple[str, ...] | None = None
    #: ``ENGINE_PLUGINS_AUTOLOAD=0`` disables entry-point discovery (tests register backends).
    autoload_plugins: bool = True
    #: ``ENGINE_CACHE_DIR``: extracted kernels, compiled sources, dispatch tables.
    cache_dir: Path = attrs.field(factory=lambda: _default_cache_dir(os.environ))
    #: ``ENGINE_DISPATCH_POLICY``: what to do at a shape with no dispatch-table entry.
    dispatch_policy: str = attrs.field(default="tune")
    #: ``ENGINE_DISPATCH_CACHE=0`` stops reading and writing tuned rows under ``cache_dir/dispatch``.
    dispatch_cache: bool = True

    @dispatch_policy.validator
    def _check_policy(self, _attr: attrs.Attribute, value: str) -> None:
        if value not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch policy {value!r}: expected one of {', '.join(DISPATCH_POLICIES)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        devices = env.get("ENGINE_DEVICES")
        kinds = tuple(k.strip().lower() for k in devices.split(",") if k.strip()) if devices else None
        policy = env.get("ENGINE_DISPATCH_POLICY", "tune").strip().lower() or "tune"
        if policy not in DISPATCH_POLICIES:
            raise ValueError(f"ENGINE_DISPATCH_POLICY={policy!r}: expected one of {', '.join(DISPATCH_POLICIES)}")
        return cls(
            devices=kinds,
            autoload_plugins=_flag(env.get("ENGINE_PLUGINS_AUTOLOAD", "1")),
            cache_dir=Path(env["ENGINE_CACHE_DIR"]) if env.get("ENGINE_CACHE_DIR") else _default_cache_dir(env),
            dispatch_policy=policy,
            dispatch_cache=_flag(env.get("ENGINE_DISPATCH_CACHE", "1")),
        )


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")
