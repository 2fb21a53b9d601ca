"""Triton helpers: the random Hadamard transform fused into NVFP4's weight-gradient casts (the
kernels that use them: ``triton_nvfp4_dual.py``).

The weight-gradient GEMM contracts over the token dim M, so its operands are ``t^T`` (C, M) for
``t`` = x or dY (M, C), quantized along M after ``Q^T`` is applied to each block of 16 rows
(``fp8/cast/hadamard.py``). One program loads a ``16 x BLOCK_N`` tile of ``t`` (rows past M are the
zero padding), applies ``Q^T = diag(signs) H16 / 4`` in registers, as :func:`~lowprec.fp8.cast.hadamard.apply_rht`
does: the fast Walsh-Hadamard butterfly, stages of pairs 8, 4, 2 and 1 rows apart (``a + b``,
``a - b``), then the exact factor ``+-1/4`` of each row. The same float32 operations in the same
order as the torch path: bit for bit. Then either the amax of the transformed tensor
(:func:`_amax_bits`, for an atomic max of float32 bits; NaN tracked apart) or the cast
(:func:`_cast_rht_store`): each column of the tile is one 1 x 16 block of the operand row
``c``, written transposed, as ``quantize_nvfp4(apply_rht(t, Q).t())`` holds it, rounding to
nearest or stochastically (the element index on the operand's layout: ``c * MP + m``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_nvfp4 import _block_scale, _e2m1_rne, _e2m1_sr, _pack

__all__: list[str] = []  # helpers only, imported by name


@triton.jit
def _pairs(x, G: tl.constexpr, H: tl.constexpr, BN: tl.constexpr):
    """One butterfly stage on the rows of a (16, BN) tile: rows ``i`` and ``i + H`` (within
    groups of ``2 H``) become their sum and difference."""
    y = tl.permute(tl.reshape(x, (G, 2, H, BN)), (0, 2, 3, 1))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 3, 1, 2))
    return tl.reshape(y, (16, BN))


@triton.jit
def _load16(t_ptr, pid_m, pid_n, M, N, stride_m, stride_n, BN: tl.constexpr):
    """A (16, BN) tile of ``t`` as float32 (zeros outside it), its rows and columns (int64)."""
    rm = (pid_m * 16 + tl.arange(0, 16)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(t_ptr + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
    return x, rm, rn


@triton.jit
def _rht(x, sign_bits, BN: tl.constexpr):
    """``Q^T`` applied to the rows of a (16, BN) float32 tile: the butterfly, then +-1/4 per row."""
    x = _pairs(x, 1, 8, BN)
    x = _pairs(x, 2, 4, BN)
    x = _pairs(x, 4, 2, BN)
    x = _pairs(x, 8, 1, BN)
    row_sign = tl.where(((sign_bits >> tl.arange(0, 16)) & 1) > 0, -0.25, 0.25)
    return x * row_sign[:, None]


@triton.jit
def _amax_bits(y):
    """``max |y|`` of a 2-D tile as float32 bits (int32), 0x7FC00000 where it holds a NaN."""
    a = tl.abs(y)
    is_nan = a != a
    top = tl.max(tl.max(tl.where(is_nan, 0.0, a), axis=1), axis=0)
    has_nan = tl.max(tl.max(is_nan.to(tl.int32), axis=1), axis=0)
    return tl.where(has_nan > 0, 0x7FC00000, top.to(tl.int32, bitcast=True))


@triton.jit
def _cast_rht_store(
    y, s, rm, rn, pid_m, M, N, qt_ptr, st_ptr, key, SR: tl.constexpr, SOFT_CAST: tl.constexpr, BN: tl.constexpr
):
    """The transformed (16, BN) tile ``y`` cast with the tensor encode factor ``s``: each column one
    1 x 16 block of the operand row ``c``, stored transposed into ``qt`` (N, MP/2) and ``st`` (N, MP/16)."""
    a = tl.abs(y)
    is_nan = (a != a).to(tl.int32)
    ca = tl.max(tl.where(is_nan > 0, 0.0, a), axis=0)  # (BN,): one block per column
    byte, enc = _block_scale(ca, tl.max(is_nan, axis=0) > 0, s, SOFT_CAST)
    mp = tl.cdiv(M, 16) * 16
    if SR:
        codes = _e2m1_sr(y * enc[None, :], rn[None, :] * mp + rm[:, None], key)
    else:
        codes = _e2m1_rne(y * enc[None, :])
    rt = (pid_m * 8 + tl.arange(0, 8)).to(tl.int64)
    tl.store(
        qt_ptr + rn[:, None] * (mp // 2) + rt[None, :],
        _pack(tl.trans(codes), BN, 16),
        mask=(rn[:, None] < N) & (rt[None, :] < mp // 2),
    )
    tl.store(st_ptr + rn * (mp // 16) + pid_m, byte, mask=rn < N)
