"""Building bundles from kernels written by hand or emitted by a compiler (DESIGN §8)."""

from engine.build.builder import GraphBuilder, KernelDef, Value

__all__ = ["GraphBuilder", "KernelDef", "Value"]
