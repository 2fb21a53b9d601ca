"""Triton kernel: the NVFP4 cast (E2M1 elements, an E4M3 scale per 16, a float32 tensor scale),
1 x 16 blocks along the rows (activations) or 16 x 16 tiles (weights) with both layouts from one
read.

One program loads a ``BLOCK_M x BLOCK_N`` tile of ``x`` (R, C) as float32 and, given the tensor
encode factor ``S`` (``nvfp4.tensor_scales`` of the tensor's amax, read from a device scalar),
writes what :mod:`lowprec.fp8.cast.nvfp4` gives:

* ``TILE2D=False`` (``quantize_nvfp4(x)``): data (R, C padded to 16 / 2) two E2M1 codes per byte
  (the even column in the low nibble) and E4M3 scale bytes (R, C padded / 16);
* ``TILE2D=True`` (``quantize_nvfp4_2d(x)``, ``BLOCK_M`` = 16): one scale per 16 x 16 tile, on
  each of its rows; with ``COL`` also ``transpose_2d`` of it: the same codes transposed, (C, R
  padded / 2), and the tile scales per column, (C, R padded / 16).

Numerics are the torch path's bit for bit (checked under the Triton interpreter): a block's amax
of the float32 values (masked lanes, the zero padding, never raise it; NaN tracked apart, as
``tl.max`` may drop it on the GPU); the scale ``e4m3(min(amax / 6 * S, 448))`` with a correctly
rounded division (``tl.div_rn``, as torch divides), NaN kept; its float32 value decoded from the
E4M3 bits; the element factor ``S / scale`` (0 for a flushed block or a NaN scale); elements
``x * factor`` rounded to nearest even by counting the RNE boundaries below ``|y|``
(``nvfp4.RNE_POSITIVE_BOUNDS``; NaN gives code 0, +-inf saturates), the sign set for a non-zero
code only (no negative zero).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.cast.nvfp4 import RNE_POSITIVE_BOUNDS
from lowprec.fp8.kernels.triton_cast import _fp8_bits

__all__ = ["cast_nvfp4_kernel", "NV_TILE_M", "NV_TILE_N"]

NV_TILE_M = 32  # rows per program for 1 x 16 blocks (16 x 16 tiles: 16)
NV_TILE_N = 128  # columns per program: eight 16-column blocks

_B0 = tl.constexpr(RNE_POSITIVE_BOUNDS[0])
_B1 = tl.constexpr(RNE_POSITIVE_BOUNDS[1])
_B2 = tl.constexpr(RNE_POSITIVE_BOUNDS[2])
_B3 = tl.constexpr(RNE_POSITIVE_BOUNDS[3])
_B4 = tl.constexpr(RNE_POSITIVE_BOUNDS[4])
_B5 = tl.constexpr(RNE_POSITIVE_BOUNDS[5])
_B6 = tl.constexpr(RNE_POSITIVE_BOUNDS[6])


@triton.jit
def _e2m1_rne(y):
    """Scaled float32 ``y`` -> E2M1 codes (int32 0..15), round to nearest even, saturating."""
    a = tl.abs(y)
    code = (
        (a > _B0).to(tl.int32)
        + (a > _B1).to(tl.int32)
        + (a > _B2).to(tl.int32)
        + (a > _B3).to(tl.int32)
        + (a > _B4).to(tl.int32)
        + (a > _B5).to(tl.int32)
        + (a > _B6).to(tl.int32)
    )
    return tl.where((y < 0) & (code > 0), code | 8, code)


@triton.jit
def _mix32(x):
    """``nvfp4.mix32`` (lowbias32) on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _e2m1_sr(y, idx, key):
    """Scaled float32 ``y`` -> E2M1 codes (int32), stochastic rounding with ``nvfp4.sr_uniform``'s
    noise at the int64 element indices ``idx`` of the stream ``key``: up with probability
    (|y| - lo) / step, as ``nvfp4.e2m1_encode`` (NaN -> 0, saturating at 6)."""
    h = _mix32(((idx ^ key) & 0xFFFFFFFF).to(tl.uint32))
    u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    a = tl.abs(y)
    a = tl.where(a != a, 0.0, tl.minimum(a, 6.0))
    lo = (
        (a >= 0.5).to(tl.int32)
        + (a >= 1.0).to(tl.int32)
        + (a >= 1.5).to(tl.int32)
        + (a >= 2.0).to(tl.int32)
        + (a >= 3.0).to(tl.int32)
        + (a >= 4.0).to(tl.int32)
        + (a >= 6.0).to(tl.int32)
    )
    g = tl.where(
        lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo == 4, 2.0, tl.where(lo == 5, 3.0, tl.where(lo == 6, 4.0, 6.0)))
    )
    inv = tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, tl.where(lo == 6, 0.5, 0.0)))
    p = (a - g) * inv
    code = lo + (u < p).to(tl.int32)
    return tl.where((y < 0) & (code > 0), code | 8, code)


@triton.jit
def _block_scale(amax, has_nan, s, SOFT_CAST: tl.constexpr):
    """Blocks' E4M3 scale bits (uint8) and the element factor ``S / scale`` (float32)."""
    v = tl.div_rn(amax, 6.0) * s
    v = tl.where(has_nan, float("nan"), v)
    v = tl.where(v != v, v, tl.minimum(v, 448.0))  # NaN kept (tl.minimum may drop it)
    byte = _fp8_bits(v, True, SOFT_CAST)
    b = byte.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sf = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    sf = tl.where(v != v, v, sf)
    enc = tl.where(sf > 0, tl.div_rn(s, tl.where(sf > 0, sf, 1.0)), 0.0)
    return byte, enc


@triton.jit
def _pack(codes, R: tl.constexpr, C: tl.constexpr):
    """(R, C) codes -> (R, C / 2) bytes, the even column in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _row_block_amax(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each 1 x 16 block's amax of a (BLOCK_M, BLOCK_N) float32 tile, (BLOCK_M, BLOCK_N / 16), NaN
    dropped, and whether the block holds a NaN (int32)."""
    NB: tl.constexpr = BLOCK_N // 16
    a = tl.abs(x)
    is_nan = (a != a).to(tl.int32)
    a = tl.where(is_nan > 0, 0.0, a)
    ra = tl.max(tl.reshape(a, (BLOCK_M, NB, 16)), axis=2)
    return ra, tl.max(tl.reshape(is_nan, (BLOCK_M, NB, 16)), axis=2)


@triton.jit
def _row_codes(x, enc, rm, rn, N, key, SR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's E2M1 codes given each row block's element factor ``enc`` (BLOCK_M, BLOCK_N / 16);
    ``SR``: the element index on the quantized layout (M, NP) is row * NP + column."""
    NB: tl.constexpr = BLOCK_N // 16
    ex = tl.reshape(tl.broadcast_to(enc[:, :, None], (BLOCK_M, NB, 16)), (BLOCK_M, BLOCK_N))
    if SR:
        return _e2m1_sr(x * ex, rm[:, None] * (tl.cdiv(N, 16) * 16) + rn[None, :], key)
    return _e2m1_rne(x * ex)


@triton.jit
def _store_rows(q_ptr, sc_ptr, codes, byte, rm, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 1 x 16 layout's packed codes into ``q`` (M, NP / 2) and scale bytes into ``sc`` (M, NP / 16)."""
    NB: tl.constexpr = BLOCK_N // 16
    np_ = tl.cdiv(N, 16) * 16
    rh = (pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)).to(tl.int64)
    tl.store(
        q_ptr + rm[:, None] * (np_ // 2) + rh[None, :],
        _pack(codes, BLOCK_M, BLOCK_N),
        mask=(rm[:, None] < M) & (rh[None, :] < np_ // 2),
    )
    cb = (pid_n * NB + tl.arange(0, NB)).to(tl.int64)
    tl.store(sc_ptr + rm[:, None] * (np_ // 16) + cb[None, :], byte, mask=(rm[:, None] < M) & (cb[None, :] < np_ // 16))


@triton.jit
def cast_nvfp4_kernel(
    x_ptr,
    s_ptr,
    q_ptr,
    sc_ptr,
    qt_ptr,
    st_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    key,
    SOFT_CAST: tl.constexpr,
    SR: tl.constexpr,
    TILE2D: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tile (program_id(0): ``BLOCK_M`` rows, program_id(1): ``BLOCK_N`` columns). ``s_ptr``:
    the tensor encode factor S (float32 scalar). ``q`` (M, NP/2) and ``sc`` (M, NP/16) for ROW;
    ``qt`` (N, MP/2) and ``st`` (N, MP/16) for COL (``TILE2D`` only); NP / MP the sizes padded
    to 16. The pointers not written may be any tensor. ``SR`` (1 x 16 only): stochastic rounding
    with the stream ``key`` (``nvfp4.sr_key``; an int in [0, 2**32))."""
    B: tl.constexpr = 16
    NB: tl.constexpr = BLOCK_N // B
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr)
    ra, rnan = _row_block_amax(x, BLOCK_M, BLOCK_N)
    if TILE2D:  # one amax per 16 x 16 tile (BLOCK_M == 16), on each of its rows
        ta = tl.max(ra, axis=0)
        tnan = tl.max(rnan, axis=0)
        ra = tl.broadcast_to(ta[None, :], (BLOCK_M, NB))
        rnan = tl.broadcast_to(tnan[None, :], (BLOCK_M, NB))
    byte, enc = _block_scale(ra, rnan > 0, s, SOFT_CAST)
    codes = _row_codes(x, enc, rm, rn, N, key, SR, BLOCK_M, BLOCK_N)
    if ROW:
        _store_rows(q_ptr, sc_ptr, codes, byte, rm, pid_n, M, N, BLOCK_M, BLOCK_N)
    if COL:  # transpose_2d: the same codes along the rows, stored transposed; the tile scales per column
        mp = tl.cdiv(M, B) * B
        rt = (pid_m * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)).to(tl.int64)
        tl.store(
            qt_ptr + rn[:, None] * (mp // 2) + rt[None, :],
            _pack(tl.trans(codes), BLOCK_N, BLOCK_M),
            mask=(rn[:, None] < N) & (rt[None, :] < mp // 2),
        )
        tb = tl.reshape(tl.broadcast_to(tl.max(byte, axis=0)[:, None], (NB, B)), (BLOCK_N,))
        tl.store(st_ptr + rn * (mp // B) + pid_m, tb, mask=rn < N)
