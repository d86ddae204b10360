"""The importer's errors: one ``EngineError`` subclass per way a model can be refused."""

from __future__ import annotations

from typing import Sequence

import attrs

from engine.errors import EngineError

__all__ = ["ImportErrorBase", "UnsupportedModelError", "UnsupportedNode", "ModelLoadError", "NodeUnsupported",
           "UnsupportedOpsetError"]


class ImportErrorBase(EngineError):
    """Base of every error the ONNX importer raises."""


class ModelLoadError(ImportErrorBase):
    """The file is not a loadable ONNX model (unreadable, malformed, an opset we do not import)."""


@attrs.frozen
class UnsupportedNode:
    """One node the importer cannot lower, and why."""

    name: str
    op_type: str
    reason: str

    def describe(self) -> str:
        return f"{self.name or '<unnamed>'} ({self.op_type}): {self.reason}"


class UnsupportedOpsetError(ModelLoadError):
    """The model's default-domain opset is outside the range the importer reads."""


class UnsupportedModelError(ImportErrorBase):
    """Every node of the model that cannot be imported (``nodes``); no bundle is produced."""

    def __init__(self, nodes: Sequence[UnsupportedNode], model: str = "model"):
        self.nodes = tuple(nodes)
        self.model = model
        listing = "; ".join(n.describe() for n in self.nodes)
        super().__init__(f"{model}: {len(self.nodes)} unsupported node(s): {listing}; expected only the ops and "
                         f"attributes listed in docs/onnx.md")


class NodeUnsupported(Exception):
    """Raised by an op handler: this node (op, attribute, dtype or shape) cannot be lowered."""
