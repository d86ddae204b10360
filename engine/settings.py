"""Environment configuration, read once into a frozen object.

Nothing deep in the engine reads ``os.environ``: the registry and graphs receive a ``Settings``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Mapping

import attrs

from engine.errors import InputError

__all__ = ["Settings", "env_flag", "DISPATCH_POLICIES", "DEFAULT_CACHE_MAX_BYTES", "DEFAULT_TUNING_WARN_S",
           "parse_size", "cache_max_bytes_from_env", "parse_seconds"]

DISPATCH_POLICIES = ("tune", "first", "nearest", "error")
#: The cache directory's default size cap (``ENGINE_CACHE_MAX_BYTES``); see ``engine.cache``.
DEFAULT_CACHE_MAX_BYTES = 1 << 30
#: Tuning a key at run time that is estimated to take at least this many seconds is announced at
#: WARNING level before it starts (``ENGINE_TUNING_WARN_S``; the estimate is
#: ``engine.runtime.tuning.estimate_tuning_s``, docs/runtime.md §4.1). One second: a first request
#: that stalls that long is worth an operator's attention; shorter ones are logged at INFO only.
DEFAULT_TUNING_WARN_S = 1.0
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}
_SIZE_RE = re.compile(r"\s*([0-9]{1,15})\s*([a-zA-Z]{0,3})\s*\Z")


def parse_size(text: str, *, what: str) -> int:
    """``"512M"``, ``"2GiB"``, ``"1000000"`` as bytes (binary units); ``InputError`` (a ``ValueError``)
    naming ``what`` and the expected spelling otherwise."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise InputError(f"{what}={text!r}: expected a size in bytes such as 500000000, 512M or 2G "
                         "(0 for no cap)")
    return int(match.group(1)) * _SIZE_UNITS[unit]  # type: ignore[index]


def cache_max_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    """``ENGINE_CACHE_MAX_BYTES`` (default ``DEFAULT_CACHE_MAX_BYTES``; 0: no cap)."""
    env = os.environ if env is None else env
    text = env.get("ENGINE_CACHE_MAX_BYTES", "").strip()
    return parse_size(text, what="ENGINE_CACHE_MAX_BYTES") if text else DEFAULT_CACHE_MAX_BYTES


def parse_seconds(text: str, *, what: str) -> float:
    """A non-negative number of seconds (``"2"``, ``"0.5"``; ``"inf"`` for never); ``InputError``
    (a ``ValueError``) naming ``what`` otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise InputError(f"{what}={text!r}: expected a non-negative number of seconds such as 1, 0.5 or 30 "
                         "(0: every tuning; inf: never)")
    return value


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
    #: ``ENGINE_CACHE_MAX_BYTES=2G``: the cache directory's size cap, kept by evicting the least
    #: recently used entries (``engine.cache``; 0: no cap).
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    #: ``ENGINE_TUNING_TRACES=1``: write a Chrome trace of each tuning run under ``cache_dir/traces``.
    tuning_traces: bool = False
    #: ``ENGINE_TUNING_WARN_S=SECONDS``: tuning at run time estimated to take at least this long is
    #: announced at WARNING level before it starts (``TuningOptions.warn_s``; 0: every tuning; inf: never).
    tuning_warn_s: float = DEFAULT_TUNING_WARN_S
    #: ``ENGINE_NATIVE_RUN=0`` turns the native run path off (``engine.runtime.native``: prepared runs
    #: on the CPU as one compiled call). The default reads the variable, so that registries built
    #: with explicit settings follow the switch too.
    native_run: bool = attrs.field(factory=lambda: env_flag(os.environ.get("ENGINE_NATIVE_RUN", "1")))

    @dispatch_policy.validator
    def _check_policy(self, _attr: "attrs.Attribute[str]", value: str) -> None:
        if value not in DISPATCH_POLICIES:
            raise InputError(f"dispatch policy {value!r}: expected one of {', '.join(DISPATCH_POLICIES)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        devices = env.get("ENGINE_DEVICES")
        kinds = tuple(k.strip().lower() for k in devices.split(",") if k.strip()) if devices else None
        policy = env.get("ENGINE_DISPATCH_POLICY", "tune").strip().lower() or "tune"
        if policy not in DISPATCH_POLICIES:
            # InputError (an EngineError and a ValueError): the CLI names the variable, not "internal error".
            raise InputError(f"ENGINE_DISPATCH_POLICY={policy!r}: expected one of {', '.join(DISPATCH_POLICIES)}")
        return cls(
            devices=kinds,
            autoload_plugins=env_flag(env.get("ENGINE_PLUGINS_AUTOLOAD", "1")),
            cache_dir=Path(env["ENGINE_CACHE_DIR"]) if env.get("ENGINE_CACHE_DIR") else _default_cache_dir(env),
            dispatch_policy=policy,
            dispatch_cache=env_flag(env.get("ENGINE_DISPATCH_CACHE", "1")),
            cache_max_bytes=cache_max_bytes_from_env(env),
            tuning_traces=env_flag(env.get("ENGINE_TUNING_TRACES", "0")),
            tuning_warn_s=_seconds(env, "ENGINE_TUNING_WARN_S", DEFAULT_TUNING_WARN_S),
            native_run=env_flag(env.get("ENGINE_NATIVE_RUN", "1")),
        )


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    return parse_seconds(text, what=name) if text else default


def env_flag(value: str) -> bool:
    """An on/off environment setting: off for ``0``, ``false``, ``no`` or ``off`` (any case)."""
    return value.strip().lower() not in ("0", "false", "no", "off")
