"""The engine's exception hierarchy.

::

    EngineError
     ├── BundleError            (also ValueError)  a bundle is malformed, inconsistent or unsafe
     ├── InputError             (also ValueError)  run_async/set_weights got something it cannot use
     ├── KernelError            (also RuntimeError) a kernel failed to load, compile or run
     ├── PluginError            (also RuntimeError) a device plugin is broken or incompatible
     ├── DeviceUnavailableError (also RuntimeError) no usable plugin or device for a kind
     └── Unsupported            (also NotImplementedError) a backend lacks an optional capability

Every error carries its context in the message (which member, which input, which kernel, what was
expected) so that a log line alone is enough to act on. Subclasses also inherit the matching built-in
so that generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "BundleError",
    "InputError",
    "KernelError",
    "PluginError",
    "DeviceUnavailableError",
    "Unsupported",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class BundleError(EngineError, ValueError):
    """A bundle (or one of its members) is malformed, inconsistent, unsafe or over a limit.

    ``member`` names the bundle member and ``path`` the JSON path inside it, when known.
    """

    def __init__(self, message: str, *, member: str | None = None, path: str | None = None):
        where = ""
        if member is not None:
            where = f"{member}: "
            if path:
                where = f"{member} @ {path}: "
        elif path:
            where = f"@ {path}: "
        super().__init__(where + message)
        self.member = member
        self.path = path


class InputError(EngineError, ValueError):
    """An input (or weight) handed to the engine does not match what the graph expects."""


class KernelError(EngineError, RuntimeError):
    """A kernel could not be loaded, compiled or launched, or returned a failure code."""


class PluginError(EngineError, RuntimeError):
    """A device plugin failed to import, registered badly, or has an incompatible API version."""


class DeviceUnavailableError(EngineError, RuntimeError):
    """No plugin provides the requested device kind, or it has no usable device."""


class Unsupported(EngineError, NotImplementedError):
    """The backend does not implement an optional capability."""
