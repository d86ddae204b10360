"""Finding device plugins and isolating the broken ones.

The registry loads each ``engine.devices`` entry point on its own: a plugin that fails to import,
returns garbage, or speaks another API major is recorded with its cause and shown by
``engine devices``; the failure is raised only when its kind is asked for. Registries are objects,
not process globals; ``default_registry()`` builds one lazily for the public API.
"""

from __future__ import annotations

import threading
import traceback
from typing import TYPE_CHECKING, Iterable

import attrs
import pluggy

from engine import hookspecs
from engine.backend import API_CHANGES, API_VERSION, BackendBase
from engine.device import KIND_PATTERN
from engine.errors import DeviceUnavailableError, PluginError
from engine.log import get_logger
from engine.settings import Settings

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["DeviceInfo", "PluginFailure", "Registry", "default_registry", "devices", "KNOWN_DISTRIBUTIONS",
           "RESERVED_SLOTS"]

log = get_logger("engine.plugins")

#: Where to get the first-party kinds, for "install X" messages.
KNOWN_DISTRIBUTIONS = {"cpu": "engine-cpu", "cuda": "engine-cuda", "hip": "engine-hip", "opencl": "engine-opencl"}
#: Workspace slots of the first-party kinds; third-party kinds take any other slot >= 3.
RESERVED_SLOTS = {"cpu": 0, "cuda": 1, "hip": 2, "opencl": 3}


@attrs.frozen
class PluginFailure:
    """A plugin (or one backend of it) that could not be used, and why."""

    plugin: str
    distribution: str | None
    version: str | None
    cause: str
    kinds: tuple[str, ...] = ()
    details: str = ""


@attrs.frozen
class DeviceInfo:
    """One row of ``engine devices``."""

    kind: str
    available: bool
    device_count: int
    device_names: tuple[str, ...]
    distribution: str | None
    version: str | None
    api_version: tuple[int, int] | None
    workspace_slot: int | None
    reason: str | None
    #: The driver or platform and its version, when the backend reports it.
    driver: str | None = None


@attrs.define
class _Entry:
    backend: BackendBase
    plugin: str
    distribution: str | None
    version: str | None


class Registry:
    """Backends by kind, discovered through pluggy entry points or registered directly."""

    def __init__(self, settings: Settings | None = None, *, autoload: bool | None = None):
        self.settings = settings if settings is not None else Settings.from_env()
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._backends: dict[str, _Entry] = {}
        self._failures: list[PluginFailure] = []
        self._lock = threading.RLock()
        self._autoload = self.settings.autoload_plugins if autoload is None else autoload
        self._loaded = not self._autoload
        from engine.cache import configure  # the cache's size cap follows these settings

        configure(self.settings.cache_dir, max_bytes=self.settings.cache_max_bytes)

    # -- registration --------------------------------------------------------------------------
    def register_plugin(self, plugin: object, *, name: str | None = None,
                        distribution: str | None = None, version: str | None = None) -> None:
        """Register a module/object with ``engine.hookimpl`` functions; failures are recorded."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        with self._lock:
            try:
                self._pm.register(plugin, name=name)
                self._pm.check_pending()
                # Call this plugin's implementation alone: one plugin's failure must not hide others.
                args = {"settings": self.settings}
                results = [impl.function(*(args[name] for name in impl.argnames))
                           for impl in self._pm.hook.engine_backends.get_hookimpls() if impl.plugin is plugin]
            except Exception as exc:  # noqa: BLE001 - any failure of a third-party plugin is isolated
                self._safe_unregister(plugin)
                # As for import failures: the plugin's name is, by convention, the kind it provides.
                kinds = (name,) if KIND_PATTERN.match(name) else ()
                self._record(name, distribution, version, f"{type(exc).__name__}: {exc}", kinds=kinds, exc=exc)
                return
            for backends in results:
                for backend in _as_list(backends):
                    self._add(backend, name, distribution, version)

    def register_backend(self, backend: BackendBase, *, distribution: str | None = None,
                         version: str | None = None) -> None:
        """Register one backend object directly (tests, embedding applications)."""
        with self._lock:
            self._add(backend, f"<direct:{getattr(backend, 'kind', '?')}>", distribution, version)

    def _add(self, backend: object, plugin: str, distribution: str | None, version: str | None) -> None:
        kind = getattr(backend, "kind", None)
        kinds = (kind,) if isinstance(kind, str) else ()
        problem = _check_backend(backend)
        if problem is None:
            slot = backend.workspace_slot  # type: ignore[attr-defined]
            for entry in self._backends.values():
                if entry.backend.kind == kind:
                    problem = f"kind {kind!r} is already provided by {entry.distribution or entry.plugin}"
                elif entry.backend.workspace_slot == slot:
                    problem = (f"workspace slot {slot} is already used by kind {entry.backend.kind!r} "
                               f"({entry.distribution or entry.plugin}); slots must be unique per process")
        if problem is not None:
            self._record(plugin, distribution, version, problem, kinds=kinds)
            return
        self._backends[kind] = _Entry(backend, plugin, distribution, version)  # type: ignore[index, arg-type]
        log.info("device kind %r provided by plugin %r (%s %s, plugin API %s)", kind, plugin,
                 distribution or "no distribution", version or "", backend.api_version)  # type: ignore[attr-defined]

    def _record(self, plugin: str, distribution: str | None, version: str | None, cause: str, *,
                kinds: tuple[str, ...] = (), exc: BaseException | None = None) -> None:
        details = "".join(traceback.format_exception(exc)) if exc is not None else ""
        self._failures.append(PluginFailure(plugin, distribution, version, cause, kinds, details))
        log.warning("plugin %r (%s) could not be used: %s", plugin, distribution or "unknown distribution", cause,
                    exc_info=exc)

    def _safe_unregister(self, plugin: object) -> None:
        try:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
        except Exception:  # noqa: BLE001 - best effort cleanup after a failed registration
            pass

    def load_entry_points(self) -> None:
        """Load every ``engine.devices`` entry point once, each in isolation."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            from importlib.metadata import entry_points  # lazy: only when discovery happens

            found = entry_points(group=hookspecs.ENTRY_POINT_GROUP)
            log.debug("discovering plugins: %d %r entry points (%s)", len(found), hookspecs.ENTRY_POINT_GROUP,
                      ", ".join(ep.name for ep in found) or "none")
            for ep in found:
                self._load_entry(ep)

    def load_entry_point(self, name: str) -> bool:
        """Load the one installed ``engine.devices`` entry point called ``name`` (by convention the kind
        it provides), even in a registry built with ``autoload=False``.

        For callers that need a particular installed plugin next to backends they registered by hand
        (the conformance suite adds the host kind this way) without naming the plugin's module, so any
        distribution that provides the kind serves. False when no such entry point is installed; an
        entry point that fails to import is recorded as a failure like any other.
        """
        from importlib.metadata import entry_points  # lazy: only when discovery happens

        with self._lock:
            found = entry_points(group=hookspecs.ENTRY_POINT_GROUP, name=name)
            for ep in found:
                self._load_entry(ep)
            return len(found) > 0

    def _load_entry(self, ep: EntryPoint) -> None:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        if self._pm.get_plugin(ep.name) is not None or self._pm.is_blocked(ep.name):
            return
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - import failures are recorded, not raised
            # The entry point's name is, by convention, the kind it provides.
            kinds = (ep.name,) if KIND_PATTERN.match(ep.name) else ()
            self._record(ep.name, dist, version, f"import failed: {type(exc).__name__}: {exc}", kinds=kinds,
                         exc=exc)
            return
        self.register_plugin(plugin, name=ep.name, distribution=dist, version=version)

    # -- lookup --------------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """Usable kinds (registered without error), ordered/limited by ``ENGINE_DEVICES``."""
        self.load_entry_points()
        kinds = list(self._backends)
        wanted = self.settings.devices
        if wanted is None:
            return kinds
        return [k for k in wanted if k in self._backends]

    def backend(self, kind: str) -> BackendBase:
        """The backend for ``kind``.

        Raises ``PluginError`` with the recorded cause when the plugin for ``kind`` is installed but
        broken, and ``DeviceUnavailableError`` saying what to install when nothing provides it.
        """
        self.load_entry_points()
        wanted = self.settings.devices
        if wanted is not None and kind not in wanted:
            raise DeviceUnavailableError(
                f"device kind {kind!r} is excluded by ENGINE_DEVICES={','.join(wanted)}")
        entry = self._backends.get(kind)
        if entry is not None:
            return entry.backend
        for failure in self._failures:
            if kind in failure.kinds or (failure.distribution and failure.distribution == KNOWN_DISTRIBUTIONS.get(kind)):
                raise PluginError(
                    f"device kind {kind!r}: plugin {failure.plugin!r} "
                    f"({failure.distribution or 'unknown distribution'}) could not be used: {failure.cause}")
        hint = KNOWN_DISTRIBUTIONS.get(kind)
        install = f"install the '{hint}' distribution" if hint else f"install a plugin that provides kind {kind!r}"
        have = ", ".join(self._backends) or "none"
        raise DeviceUnavailableError(f"no plugin provides device kind {kind!r} (available kinds: {have}); {install}")

    def failures(self) -> list[PluginFailure]:
        self.load_entry_points()
        return list(self._failures)

    def devices(self) -> list[DeviceInfo]:
        """Every kind, usable or not, with the reason when it cannot be used."""
        self.load_entry_points()
        rows = []
        wanted = self.settings.devices
        for kind, entry in self._backends.items():
            if wanted is not None and kind not in wanted:
                rows.append(DeviceInfo(kind, False, 0, (), entry.distribution, entry.version, entry.backend.api_version,
                                       entry.backend.workspace_slot, f"excluded by ENGINE_DEVICES={','.join(wanted)}"))
                continue
            try:
                avail = entry.backend.availability()
            except Exception as exc:  # noqa: BLE001 - a plugin's availability probe must not break listing
                rows.append(DeviceInfo(kind, False, 0, (), entry.distribution, entry.version,
                                       entry.backend.api_version, entry.backend.workspace_slot,
                                       f"availability check failed: {type(exc).__name__}: {exc}"))
                continue
            rows.append(DeviceInfo(kind, avail.available, avail.device_count, avail.device_names,
                                   entry.distribution, entry.version, entry.backend.api_version,
                                   entry.backend.workspace_slot, avail.reason, avail.driver))
        for failure in self._failures:
            for kind in failure.kinds or ("?",):
                rows.append(DeviceInfo(kind, False, 0, (), failure.distribution, failure.version,
                                       None, None, f"plugin {failure.plugin!r}: {failure.cause}"))
        return rows


def _as_list(value: object) -> Iterable[object]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return value
    return (value,)


def _check_backend(backend: object) -> str | None:
    """Why ``backend`` cannot be accepted, or None. Capabilities are declared data, checked here."""
    if not isinstance(backend, BackendBase):
        return f"engine_backends returned {type(backend).__name__}, not an engine.backend.BackendBase"
    kind = backend.kind
    if not isinstance(kind, str) or not KIND_PATTERN.match(kind):
        return f"backend {type(backend).__name__} has an invalid kind {kind!r} (lowercase identifier expected)"
    version = backend.api_version
    if not (isinstance(version, tuple) and len(version) == 2 and all(isinstance(v, int) for v in version)):
        return f"backend {kind!r} declares a malformed api_version {version!r}"
    if version[0] != API_VERSION[0]:
        message = (f"backend {kind!r} speaks plugin API {version[0]}.{version[1]}, this engine speaks "
                   f"{API_VERSION[0]}.{API_VERSION[1]}")
        if version[0] < API_VERSION[0]:
            changes = "; ".join(f"{major}.0: {API_CHANGES[major]}"
                                for major in range(version[0] + 1, API_VERSION[0] + 1) if major in API_CHANGES)
            return f"{message}: upgrade the plugin (what changed in {changes})"
        return f"{message}: upgrade the engine"
    slot = backend.workspace_slot
    expected = RESERVED_SLOTS.get(kind)
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        return f"backend {kind!r} declares an invalid workspace_slot {slot!r}"
    if expected is not None and slot != expected:
        return f"backend {kind!r} must use workspace slot {expected}, declares {slot}"
    if expected is None and (slot < 3 or slot in RESERVED_SLOTS.values()):
        reserved = ", ".join(f"{k} {v}" for k, v in RESERVED_SLOTS.items())
        return (f"third-party backend {kind!r} must use a workspace slot >= 3 that is not reserved ({reserved}), "
                f"declares {slot}")
    return None


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The registry the public API uses when none is given; created on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Registry()
    return _default


def devices(registry: Registry | None = None) -> list[DeviceInfo]:
    """``engine.devices()``: every device kind known to this process, with availability."""
    return (registry or default_registry()).devices()
