"""Triton kernel: the MXFP8 cast (OCP MX v1.0: one E8M0 power-of-two scale per 32 elements),
along rows, along columns, or both from one read.

One program loads a ``32 x BLOCK_N`` tile of ``x`` (R, C) as float32 and, from those registers,
writes what :func:`lowprec.fp8.cast.mx.quantize_mx` gives:

* ``ROW``: ``quantize_mx(x)``: 1 x 32 blocks along the columns, data (R, C padded to 32) and
  E8M0 scales (R, C/32 padded);
* ``COL``: ``quantize_mx(x.t())``: 32 x 1 blocks along the rows, stored transposed, data
  (C, R padded to 32) and scales (C, R/32 padded): the other GEMM's operand, without a copy
  of ``x.t()``.

Numerics are ``quantize_mx``'s bit for bit (checked under the Triton interpreter): a block's
amax of the float32 values (masked lanes, the zero padding, are 0 and never raise it), the
exponent k of the scale from the amax's float32 bits (``floor``: f - emax; ``rceil``: plus one
where the amax's mantissa is above 1.75, which is the bit test ``mantissa bits > 0x600000``),
-127 for a zero or subnormal amax (any such k is below -127 and clamps there), 128 (the NaN
scale, byte 255) for an inf or NaN; elements ``x * 2**-k`` (an exact product), NaN kept, +-inf
and anything beyond the format clamped to +-max, then the round-to-nearest-even cast of
``triton_cast``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_cast import _fp8_bits

__all__ = ["cast_mx_kernel", "MX_TILE_N"]

MX_TILE_N = 128  # columns per program: four 1 x 32 row blocks, 128 column blocks


@triton.jit
def _mx_exponent(amax, has_nan, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """The scale exponent k (int32) of blocks with float32 ``amax`` (>= 0, NaN tracked apart)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = bits >> 23  # amax >= 0: no sign bit
    k = e - 127 - EMAX
    if RCEIL:
        k = k + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(e == 0, -127, k)  # zero or subnormal amax
    return tl.where((e == 255) | has_nan, 128, k)


@triton.jit
def _mx_elements(x, k, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, SOFT_CAST: tl.constexpr):
    """``saturate(x * 2**-k)`` as FP8 bits (uint8); ``k`` broadcast to ``x``'s shape."""
    p = tl.minimum(tl.maximum(-k, -127), 127)
    inv_bits = tl.where(p == -127, 0x00400000, (p + 127) << 23)  # 2**-127 is a float32 subnormal
    y = x * inv_bits.to(tl.float32, bitcast=True)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))  # NaN kept, +-inf clamped
    return _fp8_bits(y, E4M3, SOFT_CAST)


@triton.jit
def cast_mx_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    E4M3: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tile (program_id(0): 32 rows, program_id(1): ``BLOCK_N`` columns). ``q`` (M, NP) and
    ``s`` (M, NP/32) for ROW, ``qt`` (N, MP) and ``st`` (N, MP/32) for COL, NP / MP the sizes
    padded to 32; the pointers not written may be any tensor."""
    BLOCK: tl.constexpr = 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    is_nan = (a != a).to(tl.int32)
    a = tl.where(is_nan > 0, 0.0, a)  # NaN is tracked apart: tl.max may drop it on the GPU
    mp = tl.cdiv(M, BLOCK) * BLOCK
    np_ = tl.cdiv(N, BLOCK) * BLOCK
    if ROW:  # 1 x 32 blocks: BLOCK_N / 32 of them per row of the tile
        nb: tl.constexpr = BLOCK_N // BLOCK
        ra = tl.max(tl.reshape(a, (BLOCK, nb, BLOCK)), axis=2)
        rnan = tl.max(tl.reshape(is_nan, (BLOCK, nb, BLOCK)), axis=2) > 0
        k = _mx_exponent(ra, rnan, EMAX, RCEIL)  # (32, nb)
        kx = tl.reshape(tl.broadcast_to(k[:, :, None], (BLOCK, nb, BLOCK)), (BLOCK, BLOCK_N))
        q = _mx_elements(x, kx, FP8_MAX, E4M3, SOFT_CAST)
        tl.store(q_ptr + rm[:, None] * np_ + rn[None, :], q, mask=(rm[:, None] < M) & (rn[None, :] < np_))
        cb = (pid_n * nb + tl.arange(0, nb)).to(tl.int64)
        byte = (tl.minimum(tl.maximum(k, -127), 128) + 127).to(tl.uint8)
        tl.store(
            s_ptr + rm[:, None] * (np_ // BLOCK) + cb[None, :],
            byte,
            mask=(rm[:, None] < M) & (cb[None, :] < np_ // BLOCK),
        )
    if COL:  # 32 x 1 blocks: one per column of the tile, stored transposed
        k = _mx_exponent(tl.max(a, axis=0), tl.max(is_nan, axis=0) > 0, EMAX, RCEIL)  # (BLOCK_N,)
        qt = _mx_elements(x, tl.broadcast_to(k[None, :], (BLOCK, BLOCK_N)), FP8_MAX, E4M3, SOFT_CAST)
        tl.store(qt_ptr + rn[None, :] * mp + rm[:, None], qt, mask=(rn[None, :] < N) & (rm[:, None] < mp))
        byte = (tl.minimum(tl.maximum(k, -127), 128) + 127).to(tl.uint8)
        tl.store(st_ptr + rn * (mp // BLOCK) + pid_m, byte, mask=rn < N)
