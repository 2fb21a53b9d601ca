"""Blockwise casts as :class:`Float8Data`, through the fused kernels where they run.

The blockwise recipe (DeepSeek-V3) needs, per Linear fwd+bwd: ``x`` in 1x128 tiles (output
GEMM) and in 128x1 tiles (weight gradient, where ``x`` is the B operand contracting over M);
``dY`` likewise (grad_input; weight gradient as ``dY^T``); ``W`` in 128x128 blocks, row-major
for the output GEMM and, cast again from the Parameter in backward (so that backward keeps no
FP8 weight), transposed for grad_input. On CUDA with the Triton kernels
(:func:`lowprec.fp8.kernels.cast_block_1d` / ``cast_block_2d``) one read of each
high-precision tensor writes both, each in the memory layout its GEMM reads (torch's blockwise
``scaled_mm``: A row-major, B column-major), so :mod:`lowprec.fp8.gemm.block` copies nothing.
Values are those of :func:`lowprec.fp8.cast.torch_casts.quantize_blockwise_torch`; only the layouts
(of data and scales) differ, and every consumer reads through strides.
"""

from __future__ import annotations

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.cast.torch_casts import Float8Data, quantize_blockwise_torch

__all__ = [
    "fusable",
    "quantize_blockwise_fused",
    "cast_block_both",
    "quantize_square_transposed",
    "cast_experts_square",
]


def _edge(block: tuple[int, int]) -> int:
    return max(block)


def fusable(block: tuple[int, int]) -> bool:
    """Tiles the fused kernel computes: 1 x b, b x 1 or b x b with b a power of two in 16..128."""
    b = _edge(block)
    return 16 <= b <= 128 and not b & (b - 1) and block in ((1, b), (b, 1), (b, b))


def _fused(t: torch.Tensor, size: int) -> bool:
    return (
        fusable((size, size))
        and t.dim() == 2
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (kernels.available(t.device))
    )


def quantize_blockwise_fused(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], power_of_2: bool
) -> Float8Data:
    """One layout, fused (``quantize_blockwise`` on CUDA); a (b, 1) cast is written transposed
    and returned as a column-major view, the layout of the GEMM that contracts over its rows."""
    b = _edge(block)
    x = x.detach()
    if block == (b, b):
        q, s, _, _ = kernels.cast_block_2d(x, dtype, b, power_of_2, rows=True, cols=False)
        return Float8Data(q, s, "block", block, power_of_2)
    rows = block == (1, b)
    q, rs, qt, cs = kernels.cast_block_1d(x, dtype, b, power_of_2, rows=rows, cols=not rows)
    if rows:
        return Float8Data(q, rs, "block", block, power_of_2)
    return Float8Data(qt.t(), cs, "block", block, power_of_2)


def cast_block_both(
    t: torch.Tensor, dtype: torch.dtype, size: int, power_of_2: bool, square: bool = False
) -> tuple[Float8Data, Float8Data]:
    """``(1 x size tiles, row-major; size x 1 tiles, column-major)`` of ``x`` or ``dY``: the
    casts for the GEMM contracting its dim 1 and for the one contracting dim 0. One pass on
    CUDA; two torch casts elsewhere. ``square``: size x size blocks, row-major and transposed
    (a frozen weight, whose casts are kept for both GEMMs)."""
    if square:
        sq = (size, size)
        if not _fused(t, size):
            q = quantize_blockwise_torch(t, dtype, sq, power_of_2)
            return q, q
        d, s, dt, st = kernels.cast_block_2d(t.detach(), dtype, size, power_of_2, rows=True, cols=True)
        return Float8Data(d, s, "block", sq, power_of_2), Float8Data(dt.t(), st, "block", sq, power_of_2)
    if not _fused(t, size):
        return (
            quantize_blockwise_torch(t, dtype, (1, size), power_of_2),
            quantize_blockwise_torch(t, dtype, (size, 1), power_of_2),
        )
    d, rs, dt, cs = kernels.cast_block_1d(t.detach(), dtype, size, power_of_2)
    return Float8Data(d, rs, "block", (1, size), power_of_2), Float8Data(dt.t(), cs, "block", (size, 1), power_of_2)


def quantize_square_transposed(w: torch.Tensor, dtype: torch.dtype, size: int, power_of_2: bool) -> Float8Data:
    """``w`` in size x size blocks for the GEMM contracting its dim 0 (grad_input's ``W``): on
    CUDA written transposed in one pass, so the GEMM reads it column-major without a copy."""
    if not _fused(w, size):
        return quantize_blockwise_torch(w, dtype, (size, size), power_of_2)
    _, _, qt, st = kernels.cast_block_2d(w.detach(), dtype, size, power_of_2, rows=False, cols=True)
    return Float8Data(qt.t(), st, "block", (size, size), power_of_2)


def cast_experts_square(
    w: torch.Tensor, dtype: torch.dtype, size: int, power_of_2: bool
) -> tuple[list[Float8Data], list[Float8Data]]:
    """Each expert weight of ``w`` (E, N, K) in size x size blocks, both layouts, as
    ``cast_block_both(w[e], square=True)`` per expert gives them. Where the fused kernel runs and
    ``N % size == 0`` (a block never spans two experts) the experts are cast as one (E*N, K)
    tensor, one launch, and each expert's casts are views of one buffer per layout (the grouped
    GEMMs read them there: no stack of the experts' casts)."""
    experts, n, k = w.shape
    flat = w.reshape(experts * n, k)
    if n % size or not _fused(flat, size):
        pairs = [cast_block_both(w[e], dtype, size, power_of_2, square=True) for e in range(experts)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    q, qt = cast_block_both(flat, dtype, size, power_of_2, square=True)
    nb = n // size

    def part(c: Float8Data, e: int) -> Float8Data:
        return Float8Data(c.data[e * n : (e + 1) * n], c.scale[e * nb : (e + 1) * nb], "block", c.block, power_of_2)

    return [part(q, e) for e in range(experts)], [part(qt, e) for e in range(experts)]
