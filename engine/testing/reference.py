"""The reference kernels: the names, signatures and results every backend's ``reference_kernels()``
must follow, so that one suite (and ``engine demo --device KIND``) can run them anywhere.

A backend writes each kernel in its own language (``ReferenceKernel``); this module says what the
kernel must compute. All tensors are float32, contiguous and row-major; tensor arguments are the
inputs then the outputs; symbols are passed in the order listed. Macros (``K``, ``N``) are
``#define`` lines the caller puts in front of the source.
"""

from __future__ import annotations

from typing import Mapping

import attrs

__all__ = ["ReferenceSignature", "REFERENCE_KERNELS", "MLP_KERNELS", "with_macros"]


@attrs.frozen
class ReferenceSignature:
    """What a reference kernel takes and computes (the backend supplies the code)."""

    name: str
    summary: str
    num_inputs: int
    num_outputs: int
    symbols: tuple[str, ...]
    #: Workspace bytes as an expression over the symbols ("0": none).
    workspace: str = "0"
    macros: tuple[str, ...] = ()
    #: Output index -> input index written in place.
    share_map: Mapping[int, int] = attrs.field(factory=dict)
    optional: bool = False


REFERENCE_KERNELS: Mapping[str, ReferenceSignature] = {
    sig.name: sig for sig in (
        ReferenceSignature("add", "z[n] = x[n] + y[n]", 2, 1, ("n",)),
        ReferenceSignature("scale_ws", "ws[i] = 2 * x[i] (workspace of n * 4 bytes), then y[i] = ws[i] + 1",
                           1, 1, ("n",), workspace="n * 4"),
        ReferenceSignature("busy", "y[i] = x[i] + iters, by adding 1.0f iters times (run time grows with iters)",
                           1, 1, ("n", "iters")),
        ReferenceSignature("fail_code", "returns error code 7 (devices whose kernels return a code)", 1, 1,
                           ("n",), optional=True),
        ReferenceSignature("mlp_matmul", "c[batch, N] = a[batch, K] @ w[K, N]; one or more entries, same result",
                           2, 1, ("batch",), macros=("K", "N")),
        ReferenceSignature("mlp_bias_relu", "y[batch, N] = max(x + b[N], 0), written in place over x", 2, 1,
                           ("batch",), macros=("N",), share_map={0: 0}),
        ReferenceSignature("mlp_bias_add", "y[batch, N] = x + b[N], written in place over x", 2, 1, ("batch",),
                           macros=("N",), share_map={0: 0}),
        ReferenceSignature("mlp_softmax", "y[batch, N] = row-wise softmax of x; workspace of batch * 4 bytes "
                           "(one float per row, e.g. the row maximum)", 1, 1, ("batch",), workspace="batch * 4",
                           macros=("N",)),
    )
}

#: The kernels of the demo model (``engine.demo.mlp``'s topology).
MLP_KERNELS: tuple[str, ...] = ("mlp_matmul", "mlp_bias_relu", "mlp_bias_add", "mlp_softmax")


def with_macros(source: str, macros: Mapping[str, int]) -> str:
    """``source`` with ``#define NAME value`` lines in front (how callers specialise a kernel)."""
    return "".join(f"#define {name} {value}\n" for name, value in macros.items()) + source
