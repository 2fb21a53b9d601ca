"""Blockwise casts as :class:`Float8Data`, through the fused kernels where they run.

The blockwise recipe (DeepSeek-V3) needs, per Linear fwd+bwd: ``x`` in 1x128 tiles (output
GEMM) and in 128x1 tiles (weight gradient, where ``x`` is the B operand contracting over M);
``dY`` likewise (grad_input; weight gradient as ``dY^T``); ``W`` in 128x128 blocks, row-major
for the output GEMM and transposed for grad_input. On CUDA with the Triton kernels
(:func:`lowprec.fp8.kernels.cast_block_1d` / ``cast_block_2d``) one read of each
high-precision tensor writes both, each in the memory layout its GEMM reads (torch's blockwise
``scaled_mm``: A row-major, B column-major), so :mod:`lowprec.fp8.block_gemm` copies nothing.
Values are those of :func:`lowprec.fp8.quantize.quantize_blockwise_torch`; only the layouts
(of data and scales) differ, and every consumer reads through strides.
"""

from __future__ import annotations

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.quantize import Float8Data, quantize_blockwise

__all__ = ["fusable", "quantize_blockwise_fused", "cast_block_both"]


def _edge(block: tuple[int, int]) -> int:
    return max(block)


def fusable(block: tuple[int, int]) -> bool:
    """Tiles the fused kernel computes: 1 x b, b x 1 or b x b with b a power of two in 16..128."""
    b = _edge(block)
    return 16 <= b <= 128 and not b & (b - 1) and block in ((1, b), (b, 1), (b, b))


def quantize_blockwise_fused(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], power_of_2: bool) -> Float8Data:
    """One layout, fused (``quantize_blockwise`` on CUDA); a (b, 1) cast is written transposed
    and returned as a column-major view, the layout of the GEMM that contracts over its rows."""
    b = _edge(block)
    x = x.detach()
    if block == (b, b):
        q, s, _, _ = kernels.cast_block_2d(x, dtype, b, power_of_2, transpose=False)
        return Float8Data(q, s, "block", block, power_of_2)
    rows = block == (1, b)
    q, rs, qt, cs = kernels.cast_block_1d(x, dtype, b, power_of_2, rows=rows, cols=not rows)
    if rows:
        return Float8Data(q, rs, "block", block, power_of_2)
    return Float8Data(qt.t(), cs, "block", block, power_of_2)


def cast_block_both(t: torch.Tensor, block_2d: bool, dtype: torch.dtype, size: int, power_of_2: bool
                    ) -> tuple[Float8Data, Float8Data]:
    """``(row-major cast contracting dim 1, column-major cast contracting dim 0)`` of a 2-D
    operand: ``size`` x ``size`` blocks for both with ``block_2d`` (the weight), else 1 x size
    and size x 1 tiles. One pass on CUDA; two torch casts elsewhere (one for square blocks)."""
    sq = (size, size)
    fused = fusable(sq) and t.dim() == 2 and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        kernels.available(t.device)
    )
    if not fused:
        if block_2d:
            q = quantize_blockwise(t, dtype, sq, power_of_2=power_of_2)
            return q, q
        return (quantize_blockwise(t, dtype, (1, size), power_of_2=power_of_2),
                quantize_blockwise(t, dtype, (size, 1), power_of_2=power_of_2))
    t = t.detach()
    if block_2d:
        q, s, qt, st = kernels.cast_block_2d(t, dtype, size, power_of_2, transpose=True)
        return Float8Data(q, s, "block", sq, power_of_2), Float8Data(qt.t(), st, "block", sq, power_of_2)
    q, rs, qt, cs = kernels.cast_block_1d(t, dtype, size, power_of_2)
    return Float8Data(q, rs, "block", (1, size), power_of_2), Float8Data(qt.t(), cs, "block", (size, 1), power_of_2)
