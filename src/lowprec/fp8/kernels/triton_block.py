"""Triton kernel: blockwise FP8 casts (DeepSeek-V3 tiles), both layouts from one read.

One program loads one ``BLOCK x BLOCK`` tile of ``x`` (128x128 by default) and, from those
registers, writes what the blockwise recipe's GEMMs read:

* 1-D tiles (activations, gradients): ``ROW`` the cast with one scale per row of the tile
  (1 x BLOCK tiles along the columns) into ``q`` (M, N), and ``COL`` the cast with one scale
  per column of the tile (BLOCK x 1 tiles along the rows) stored transposed into ``qt`` (N, M),
  the row-major operand the GEMM contracting over the rows needs;
* ``SQUARE``: one scale for the whole tile (weights), ``q`` and/or its transpose ``qt``.

Numerics are :func:`lowprec.fp8.quantize.quantize_blockwise`'s, bit for bit (checked under the
Triton interpreter): tile amax of the float32 values (NaN wins), the scale as
``amax_to_scale`` computes it in float64 (clamp to ``AMAX_EPS``, one division of fp8_max by
it, floored to a power of two from the exponent bits if asked, one rounding to float32), one float32 multiply, and
the saturating round-to-nearest-even cast of ``triton_cast``. A tile with a NaN gets a NaN scale
(every value NaN); with an inf, scale 0 (finite -> 0, inf -> NaN), as the torch path.

Scale layouts (float32): the row scales of ``q`` are stored as (N/BLOCK, M), i.e. an (M, N/BLOCK)
tensor in column-major order, the column scales of ``qt`` as (M/BLOCK, N) row-major; square
scales as (M/BLOCK, N/BLOCK) and, with ``qt``, again transposed. Those are the layouts torch's
blockwise ``scaled_mm`` reads (``block_gemm._scales``), so no scale is copied before a GEMM.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_cast import _EXP_MASK_F64, _NAN_BITS, _saturate_to_fp8_bits

__all__ = ["cast_blockwise_kernel"]


@triton.jit
def _block_scale(amax, has_nan, FP8_MAX: tl.constexpr, EPS_BITS: tl.constexpr, POW2: tl.constexpr):
    """``amax_to_scale(amax)``: float64 clamp to eps, one true division ``fp8_max / amax``,
    floored to a power of two from the float64's exponent bits if asked, one rounding to
    float32; NaN tiles get a NaN scale."""
    a64 = amax.to(tl.float64)
    eps = tl.full(a64.shape, EPS_BITS, tl.int64).to(tl.float64, bitcast=True)
    s = FP8_MAX / tl.maximum(a64, eps)
    if POW2:
        s = (s.to(tl.int64, bitcast=True) & _EXP_MASK_F64).to(tl.float64, bitcast=True)
    nan = tl.full(a64.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(has_nan, nan, s.to(tl.float32))


@triton.jit
def cast_blockwise_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
    st_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    EPS_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    SQUARE: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
):
    """Tile (program_id(0), program_id(1)). ``s_ptr``: the scales of ``q`` (ROW) or, 1-D with
    COL alone, unused; ``st_ptr``: the scales of ``qt`` (COL). Pointers not written may be any
    tensor."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rn = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)  # masked lanes hold 0.0: a ragged tile's amax is its real values' (the torch path zero-pads)
    is_nan = (a != a).to(tl.int32)
    a = tl.where(is_nan > 0, 0.0, a)  # NaN is tracked apart: tl.max may drop it on the GPU
    if SQUARE:
        s = _block_scale(
            tl.max(tl.max(a, axis=1), axis=0), tl.max(tl.max(is_nan, axis=1), axis=0) > 0, FP8_MAX, EPS_BITS, POW2
        )
        q = _saturate_to_fp8_bits(x * s, FP8_MAX, E4M3, SOFT_CAST)
        nbn = tl.cdiv(N, BLOCK)
        tl.store(s_ptr + pid_m * nbn + pid_n, s)
        if ROW:
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if COL:
            tl.store(st_ptr + pid_n * tl.cdiv(M, BLOCK) + pid_m, s)
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
    else:
        if ROW:  # one scale per row of the tile: 1 x BLOCK tiles
            rs = _block_scale(tl.max(a, axis=1), tl.max(is_nan, axis=1) > 0, FP8_MAX, EPS_BITS, POW2)
            tl.store(s_ptr + pid_n * M + rm, rs, mask=rm < M)
            q = _saturate_to_fp8_bits(x * rs[:, None], FP8_MAX, E4M3, SOFT_CAST)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if COL:  # one scale per column of the tile: BLOCK x 1 tiles, stored transposed
            cs = _block_scale(tl.max(a, axis=0), tl.max(is_nan, axis=0) > 0, FP8_MAX, EPS_BITS, POW2)
            tl.store(st_ptr + pid_m * N + rn, cs, mask=rn < N)
            qt = _saturate_to_fp8_bits(x * cs[None, :], FP8_MAX, E4M3, SOFT_CAST)
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], qt, mask=mask)
