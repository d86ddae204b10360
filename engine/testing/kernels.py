"""The backend's reference kernels as loaded ``Kernel`` objects, the way the core would load them.

``ReferenceKit`` compiles a reference kernel's source (macros first) with the backend's own
``compile``, wraps the payloads in one ``CandidateSpec`` per entry (signature from
``engine.testing.reference``), loads them with ``load_kernel`` and evaluates launch dimensions
with ``LaunchConfig.evaluate``, as the runtime does for a bundle. A missing kernel or an
``Unsupported`` compile skips the test with the capability's name; anything else that goes wrong
while compiling fails rule ``kernel.reference_load``.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from engine.backend import (BackendBase, BinaryPayload, CandidateSpec, Kernel, LaunchConfig, LaunchDims,
                            PreparedLaunch, ReferenceKernel)
from engine.errors import Unsupported
from engine.expr import parse_expr
from engine.testing.checks import fail, lacks
from engine.testing.reference import MLP_KERNELS, REFERENCE_KERNELS, with_macros

__all__ = ["ReferenceKit", "launch_config", "candidate_specs", "capability_of"]


def capability_of(name: str) -> str:
    """The capability a reference kernel stands for (``reference.add``; ``reference.mlp`` for all mlp_*)."""
    return "reference.mlp" if name in MLP_KERNELS else f"reference.{name}"


def launch_config(launch: Mapping[str, Any] | None) -> LaunchConfig | None:
    """A GraphBuilder launch dict (``grid``, ``block``, optional ``shared_memory``) as a LaunchConfig."""
    if launch is None:
        return None
    grid = tuple(parse_expr(v) for v in launch["grid"])
    block = tuple(parse_expr(v) for v in launch["block"])
    return LaunchConfig(grid, block, parse_expr(launch.get("shared_memory", 0)))  # type: ignore[arg-type]


def candidate_specs(name: str, reference: ReferenceKernel,
                    binaries: Sequence[BinaryPayload]) -> tuple[CandidateSpec, ...]:
    """One spec per entry of ``reference``, with the signature ``REFERENCE_KERNELS[name]`` documents."""
    sig = REFERENCE_KERNELS[name]
    launch = launch_config(reference.launch)
    return tuple(CandidateSpec(name, i, entry, tuple(binaries), launch, sig.num_inputs, sig.num_outputs,
                               sig.symbols, sig.workspace != "0")
                 for i, entry in enumerate(reference.entries))


class ReferenceKit:
    """Reference kernels of one backend and device, compiled and loaded once per session."""

    def __init__(self, backend: BackendBase, device_index: int):
        self.backend = backend
        self.device_index = device_index
        self._lock = threading.RLock()
        self._references: Mapping[str, ReferenceKernel] | None = None
        self._specs: dict[tuple[str, tuple[tuple[str, int], ...]], tuple[CandidateSpec, ...]] = {}
        self._kernels: dict[tuple[str, tuple[tuple[str, int], ...], int], Kernel] = {}

    def references(self) -> Mapping[str, ReferenceKernel]:
        __tracebackhide__ = True  # skips and failures point at the suite test
        with self._lock:
            if self._references is None:
                try:
                    self._references = dict(self.backend.reference_kernels())
                except Exception as exc:  # noqa: BLE001 - reported as the rule it breaks
                    fail("kernel.reference_names", "reference_kernels() to return a mapping",
                         f"{type(exc).__name__}: {exc}")
            return self._references

    def reference(self, name: str) -> ReferenceKernel:
        """The backend's ``name`` kernel; skips the test when the backend has none."""
        __tracebackhide__ = True  # skips and failures point at the suite test
        ref = self.references().get(name)
        if ref is None:
            lacks(capability_of(name), f"the {self.backend.kind} backend's reference_kernels() has no {name!r}")
        return ref

    def binaries(self, name: str, **macros: int) -> tuple[BinaryPayload, ...]:
        """The payloads ``compile`` makes of reference kernel ``name`` specialised with ``macros``."""
        __tracebackhide__ = True  # skips and failures point at the suite test
        ref = self.reference(name)
        try:
            built = self.backend.compile(with_macros(ref.source, macros), ref.language, ref.options)
        except Unsupported as exc:
            lacks("compile", f"the {self.backend.kind} backend cannot compile {ref.language!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported as the rule it breaks
            fail("kernel.reference_load", f"reference kernel {name!r} ({ref.language}) to compile",
                 f"{type(exc).__name__}: {exc}")
        payloads = tuple(built)
        if not payloads or not all(isinstance(p, BinaryPayload) for p in payloads):
            fail("kernel.reference_load", f"compile() of {name!r} to return a non-empty tuple of BinaryPayload",
                 repr(built))
        return payloads

    def specs(self, name: str, **macros: int) -> tuple[CandidateSpec, ...]:
        __tracebackhide__ = True  # skips and failures point at the suite test
        key = (name, tuple(sorted(macros.items())))
        with self._lock:
            specs = self._specs.get(key)
            if specs is None:
                specs = self._specs[key] = candidate_specs(name, self.reference(name), self.binaries(name, **macros))
            return specs

    def kernel(self, name: str, entry: int = 0, **macros: int) -> Kernel:
        """Candidate ``entry`` of ``name``, loaded (failures fail ``kernel.reference_load``)."""
        __tracebackhide__ = True  # skips and failures point at the suite test
        key = (name, tuple(sorted(macros.items())), entry)
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                spec = self.specs(name, **macros)[entry]
                try:
                    kernel = self.backend.load_kernel(spec, self.device_index)
                except Exception as exc:  # noqa: BLE001 - reported as the rule it breaks
                    fail("kernel.reference_load", f"{spec.describe()} to load",
                         f"{type(exc).__name__}: {exc}")
                self._kernels[key] = kernel
            return kernel

    def dims(self, kernel: Kernel, symbol_values: Sequence[int]) -> LaunchDims | None:
        spec = kernel.spec
        return None if spec.launch is None else spec.launch.evaluate(spec.symbols, symbol_values)

    def launch(self, kernel: Kernel, tensors: Sequence[Any], symbol_values: Sequence[int], workspace: Any,
               stream: Any) -> None:
        kernel.launch(tensors, symbol_values, workspace, stream, self.dims(kernel, symbol_values))

    def prepare(self, kernel: Kernel, tensors: Sequence[Any], symbol_values: Sequence[int], workspace: Any,
                stream: Any) -> PreparedLaunch:
        return kernel.prepare(tensors, symbol_values, workspace, stream, self.dims(kernel, symbol_values))
