"""engine-plugin-template: a complete device plugin to copy and rename (see README.md)."""

from engine_template.backend import TemplateBackend

__all__ = ["TemplateBackend"]
