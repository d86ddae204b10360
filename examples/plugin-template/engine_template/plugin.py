"""The ``engine.devices`` entry point: hands the registry one backend per kind.

Called once at discovery. It must be cheap and must not touch the hardware: a machine without
the device still imports this module, and ``TemplateBackend.availability()`` says why it cannot
be used.
"""

from __future__ import annotations

from engine.hookspecs import hookimpl
from engine.settings import Settings

from engine_template.backend import TemplateBackend

__all__ = ["engine_backends"]


@hookimpl
def engine_backends(settings: Settings) -> list[TemplateBackend]:
    return [TemplateBackend(cache_dir=settings.cache_dir)]
