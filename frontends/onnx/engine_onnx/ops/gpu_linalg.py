"""GPU kernels of MatMul and Gemm (``engine_onnx.gpu`` dialect), float32.

One kernel computes ``Y[b, i, j] = ep(alpha * sum_k A[b, i, k] * B[b, k, j] + bias[i, j])`` for a
(possibly broadcast) batch of matrices; ``A`` and ``B`` are read at any row/column strides, so a
Gemm's ``transA``/``transB`` on a tensor computed at run time costs no transpose kernel. It has two
candidates, which the runtime's tuner picks between per shape:

* ``mm_simple``: one thread per output element, a dot product over ``K``;
* ``mm_tiled``: a 16x16 block of threads per 16x16 output tile, ``A`` and ``B`` staged through
  shared memory 16 columns of ``K`` at a time, so each element read from global memory is used
  16 times.

The tiled grid is (column tiles, row tiles, batch); CUDA caps grid y and z at 65535, so both are
clamped there and the block loops over the rest.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from engine_onnx.dims import Dim, Mono, dim_expr, dims_product, symbols_of
from engine_onnx.gpu import GpuKernelSpec, gdim, launch_1d, params
from engine_onnx.ops.kernel_exprs import coordinates, lit, loop_nest, offset

__all__ = ["MatmulLayout", "matmul_kernel", "TILE"]

#: Edge of the tiled candidate's output tile (and of its thread block).
TILE = 16
#: CUDA's limit on grid y and z.
GRID_YZ = 65535


class MatmulLayout:
    """Where the operands of one batched product live: ``batch`` (the output's batch shape),
    ``a_batch``/``b_batch`` (the operands' batch shapes, broadcast against it), ``m``, ``k``, ``n``,
    and the element strides of ``A`` along (row, column) and of ``B`` along (row, column) within one
    matrix (``[k, 1]`` and ``[n, 1]`` for contiguous operands)."""

    def __init__(self, batch: Sequence[Dim], a_batch: Sequence[Dim], b_batch: Sequence[Dim], m: Dim, k: Dim,
                 n: Dim, a_strides: Sequence[Dim] | None = None, b_strides: Sequence[Dim] | None = None):
        self.batch, self.a_batch, self.b_batch = list(batch), list(a_batch), list(b_batch)
        self.m, self.k, self.n = m, k, n
        self.a_strides = list(a_strides) if a_strides is not None else [k, 1]
        self.b_strides = list(b_strides) if b_strides is not None else [n, 1]

    def symbols(self) -> list[str]:
        return symbols_of([*self.batch, *self.a_batch, *self.b_batch, self.m, self.k, self.n,
                           *self.a_strides, *self.b_strides])


def _batch_offsets(lay: MatmulLayout, flat: str) -> str:
    """Statements defining ``oa``/``ob`` (the first element of batch ``flat``'s A and B)."""
    if not lay.batch:
        return "    const int64_t oa = 0, ob = 0;\n"
    sizes, strides = loop_nest(lay.batch, [lay.a_batch, lay.b_batch])
    if not sizes:
        return "    const int64_t oa = 0, ob = 0;\n"
    body = (coordinates(sizes, flat) + f"    oa = ({offset(strides[0])}) * {gdim(lay.m * lay.k)};\n"
            f"    ob = ({offset(strides[1])}) * {gdim(lay.k * lay.n)};\n")
    return "    int64_t oa, ob;\n    {\n" + _indent(body) + "    }\n"


def _store(out_index: str, row: str, col: str, alpha: float, bias: tuple[int, Sequence[Dim]] | None,
           beta: float, ep: Callable[[str], str]) -> str:
    """The statements writing accumulator ``acc`` to ``out0[out_index]``: scaled, biased, activated.
    ``bias`` is (its input slot, its strides along rows and columns)."""
    f32 = np.dtype("float32")
    v = "acc" if alpha == 1.0 else f"{lit(alpha, f32)} * acc"
    if bias is not None:
        slot, (si, sj) = bias
        off = " + ".join(f"{ix} * {gdim(s)}" for ix, s in ((row, si), (col, sj)) if s != 0) or "0"
        term = f"in{slot}[{off}]" if beta == 1.0 else f"{lit(beta, f32)} * in{slot}[{off}]"
        v = f"{v} + {term}"
    return f"        const float v = {v};\n        out0[{out_index}] = {ep('v')};\n"


def matmul_kernel(name: str, lay: MatmulLayout, ep: Callable[[str], str], *, alpha: float = 1.0, beta: float = 1.0,
                  bias_strides: Sequence[Dim] | None = None) -> GpuKernelSpec:
    """The product of ``lay`` with both candidates; inputs are ``A``, ``B`` and, when
    ``bias_strides`` is given (its strides along output rows and columns), the bias, scaled by
    ``beta``; ``ep`` builds the fused activations' expression."""
    m, k, n = lay.m, lay.k, lay.n
    nb = dims_product(lay.batch)
    (sam, sak), (sbk, sbn) = lay.a_strides, lay.b_strides
    bias = None if bias_strides is None else (2, list(bias_strides))
    symbols = lay.symbols()
    ins = ["float", "float"] + (["float"] if bias else [])
    sig = params(ins, ["float"], symbols)
    M, K, N, NB = gdim(m), gdim(k), gdim(n), gdim(nb)

    simple = f"""KERNEL mm_simple({sig}) {{
    const int64_t t = GLOBAL_ID;
    if (t >= {NB} * {M} * {N}) return;
    const int64_t col = t % {N}, row = (t / {N}) % {M}, bi = t / ({N} * {M});
{_batch_offsets(lay, "bi")}    const GLOBAL float *a = in0 + oa + row * {gdim(sam)};
    const GLOBAL float *b = in1 + ob + col * {gdim(sbn)};
    float acc = 0.0f;
    for (int64_t q = 0; q < {K}; q++) acc += a[q * {gdim(sak)}] * b[q * {gdim(sbk)}];
    {{
{_store("t", "row", "col", alpha, bias, beta, ep)}    }}
}}
"""
    tiles = f"ceil_div({M}, {TILE})"
    a_at = f"oa + row * {gdim(sam)} + (q0 + tx) * {gdim(sak)}"
    b_at = f"ob + (q0 + ty) * {gdim(sbk)} + col * {gdim(sbn)}"
    tiled = f"""KERNEL mm_tiled({sig}) {{
    SHARED float As[{TILE}][{TILE}];
    SHARED float Bs[{TILE}][{TILE}];
    const int64_t tx = LOCAL_ID(0), ty = LOCAL_ID(1);
    const int64_t col = GROUP_ID(0) * {TILE} + tx;
    for (int64_t bi = GROUP_ID(2); bi < {NB}; bi += {GRID_YZ}) {{
{_indent(_batch_offsets(lay, "bi"))}        for (int64_t tile = GROUP_ID(1); tile < {tiles}; tile += {GRID_YZ}) {{
            const int64_t row = tile * {TILE} + ty;
            float acc = 0.0f;
            for (int64_t q0 = 0; q0 < {K}; q0 += {TILE}) {{
                As[ty][tx] = (row < {M} && q0 + tx < {K}) ? in0[{a_at}] : 0.0f;
                Bs[ty][tx] = (q0 + ty < {K} && col < {N}) ? in1[{b_at}] : 0.0f;
                BARRIER();
                for (int q = 0; q < {TILE}; q++) acc += As[ty][q] * Bs[q][tx];
                BARRIER();
            }}
            if (row < {M} && col < {N}) {{
{_indent(_store(f"(bi * {M} + row) * {N} + col", "row", "col", alpha, bias, beta, ep), 2)}            }}
        }}
    }}
}}
"""
    tiled_launch = {"grid": [_ceil(n, TILE), _clamp(_ceil(m, TILE)), _clamp(nb)], "block": [TILE, TILE, 1]}
    return GpuKernelSpec(name, simple + tiled, ("mm_simple", "mm_tiled"),
                         (launch_1d(nb * m * n), tiled_launch), tuple(symbols))


def _indent(text: str, levels: int = 1) -> str:
    pad = "    " * levels
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def _ceil(d: Dim, by: int) -> int | str:
    return -(-int(d) // by) if not isinstance(d, Mono) else f"ceil_div({dim_expr(d)}, {by})"


def _clamp(e: int | str | Dim) -> int | str:
    if isinstance(e, Mono):
        e = dim_expr(e)
    return min(int(e), GRID_YZ) if not isinstance(e, str) else f"min({e}, {GRID_YZ})"
