"""The importer's errors: one ``EngineError`` subclass per way a model can be refused."""

from __future__ import annotations

from typing import Sequence

import attrs

from engine.errors import EngineError

__all__ = ["ImportErrorBase", "UnsupportedModelError", "UnsupportedNode", "ModelLoadError", "NodeUnsupported",
           "PinSymbol", "UnsupportedOpsetError", "SymbolPin", "SymbolPinnedWarning"]


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


class PinSymbol(Exception):
    """Raised by an op handler: this node holds only at ``symbol = value``; the lowering starts again
    with that dimension a constant (``engine_onnx.lowering.lower``)."""

    def __init__(self, symbol: str, value: int, reason: str):
        self.symbol = symbol
        self.value = value
        self.reason = reason
        super().__init__(f"{symbol} = {value}: {reason}")


@attrs.frozen
class SymbolPin:
    """A symbol the model holds at one value only, and the node that proves it: torch bakes the
    sequence length it traced at into an attention ``Reshape``, so a model exported with a
    dynamic ``seq`` runs at that one length (ONNX Runtime refuses any other at that node too)."""

    symbol: str
    value: int
    node: str
    op_type: str
    reason: str

    def describe(self) -> str:
        return (f"{self.symbol} fixed to {self.value}: {self.node or '<unnamed>'} ({self.op_type}) holds only at "
                f"{self.symbol} = {self.value} ({self.reason})")


class SymbolPinnedWarning(UserWarning):
    """``convert`` made a declared dimension a constant (``pin``): the bundle's inputs take that
    size there, and a run at any other size is refused by input validation, naming the input."""

    def __init__(self, pin: SymbolPin, model: str = "model"):
        self.pin = pin
        self.model = model
        # The arguments, not the message, so that ``cls(*args)`` (pickling, a warning sent from a
        # pytest-xdist worker) builds the same warning; ``__str__`` gives the message.
        super().__init__(pin, model)

    def __str__(self) -> str:
        return f"{self.model}: {self.pin.describe()}; the bundle takes {self.pin.symbol} = {self.pin.value} only"
