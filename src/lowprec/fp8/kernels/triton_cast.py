"""Triton kernels: FP8 cast + transpose + amax in one pass (TransformerEngine's cast_transpose).

Imported only by :mod:`lowprec.fp8.kernels.ops`, which is imported only when a CUDA tensor
asks for a fused cast (or by a test running the Triton interpreter). Everything below is a
pure function of its inputs; the only side effects are the stores to the output buffers.

Numerics (all checked against :mod:`lowprec.fp8.kernels.reference`):

* ``y = float32(x) * scale``: one float32 multiply, as in ``quantize_tensorwise``.
* finite ``y`` is clamped to +-fp8_max; ``y`` that is NaN or +-inf (a NaN/inf input, or an
  overflow of the product) becomes NaN (``saturated_cast``'s ``nan_to_num`` + ``clamp``);
  -0.0 stays -0.0. NaN is built from its bit pattern, never from
  ``y - y``: with FMA contraction ``x*s - y`` is the product's rounding error, not 0 or NaN.
* float32 -> FP8 rounds to nearest, ties to even. On the GPU that is the hardware convert
  (``cvt.rn.satfinite`` on sm_89+; inputs are in range by then, so "satfinite" never acts).
  ``SOFT_CAST`` replaces it by integer arithmetic on the float32 bits (c10's
  ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``): the Triton interpreter's own
  FP8 convert rounds ties up, mishandles subnormals and turns NaN into 384, so the
  interpreter tests use this path, and a GPU test checks it equals the hardware convert.
* amax: ``max |x|`` of the *input*, per tile, then one ``atomic_max`` per tile on the
  float32's bits viewed as int32. For x >= 0 the int32 order of the bits is the float order,
  and a positive NaN (0x7FC00000) sorts above +inf (0x7F800000), so a tile holding a NaN
  publishes 0x7FC00000 and the result is NaN, as ``torch.amax`` gives. Tiles reduce their
  NaN flag separately (``tl.max`` may drop NaNs on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "cast_transpose_amax_kernel",
    "cast_rowwise_kernel",
    "amax_cols_kernel",
    "recast_if_changed_kernel",
    "delayed_scale_kernel",
]

_NAN_BITS = tl.constexpr(0x7FC00000)  # positive quiet NaN, float32
_EXP_MASK_F64 = tl.constexpr(0x7FF0000000000000)  # sign (0) and exponent: floor to a power of 2


@triton.jit
def _soft_fp8_bits(y, E4M3: tl.constexpr):
    """float32 -> FP8 bit pattern (int32 in 0..255), round to nearest even.

    ``y`` must already be in [-fp8_max, fp8_max] or NaN (the caller saturates).
    """
    if E4M3:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        DENORM_F: tl.constexpr = 16384.0  # 2**14: float32 bits ((127-7) + (23-3) + 1) << 23
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        DENORM_F: tl.constexpr = 128.0  # 2**7: float32 bits ((127-15) + (23-2) + 1) << 23
    SHIFT: tl.constexpr = 23 - MANT
    MIN_NORMAL: tl.constexpr = (127 - BIAS + 1) << 23
    DENORM_BITS: tl.constexpr = ((127 - BIAS) + SHIFT + 1) << 23
    REBIAS: tl.constexpr = (BIAS - 127) << 23
    HALF_MINUS_1: tl.constexpr = (1 << (SHIFT - 1)) - 1

    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # FP8 subnormals: adding 2**k aligns the mantissa so the float32 adder rounds (RNE) at
    # the FP8 subnormal's last bit; subtracting 2**k's bits leaves the FP8 code.
    af = a.to(tl.float32, bitcast=True)
    sub = (af + DENORM_F).to(tl.int32, bitcast=True) - DENORM_BITS
    # normals: rebias the exponent, round half to even on the dropped mantissa bits
    odd = (a >> SHIFT) & 1
    nrm = (a + REBIAS + HALF_MINUS_1 + odd) >> SHIFT
    code = tl.where(a < MIN_NORMAL, sub, nrm)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN (E4M3FN and E5M2 both use 0x7F)
    return code | sign


@triton.jit
def _saturate_to_fp8_bits(y, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, SOFT_CAST: tl.constexpr):
    """Saturate finite values to +-fp8_max, keep NaN/inf non-finite (as NaN), cast; uint8."""
    bad = (y != y) | (tl.abs(y) == float("inf"))
    nan = tl.full(y.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return _fp8_bits(tl.where(bad, nan, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)), E4M3, SOFT_CAST)


@triton.jit
def _fp8_bits(y, E4M3: tl.constexpr, SOFT_CAST: tl.constexpr):
    """Saturated float32 ``y`` (in range, or NaN) -> FP8 bits (uint8), round to nearest even:
    the hardware convert, or the software one under the interpreter."""
    if SOFT_CAST:
        return _soft_fp8_bits(y, E4M3).to(tl.uint8)
    elif E4M3:
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _amax_bits(x, mask):
    """max |x| over a tile as float32 bits (int32); 0x7FC00000 if the tile holds a NaN."""
    a = tl.where(mask, tl.abs(x), 0.0)
    is_nan = a != a
    tile = tl.max(tl.max(tl.where(is_nan, 0.0, a), axis=1), axis=0)
    has_nan = tl.max(tl.max(is_nan.to(tl.int32), axis=1), axis=0)
    return tl.where(has_nan > 0, _NAN_BITS, tile.to(tl.int32, bitcast=True))


@triton.jit
def cast_transpose_amax_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    qt_ptr,
    amax_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    WRITE_T: tl.constexpr,
    WRITE_AMAX: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_Q: tl.constexpr = True,
):
    """One BLOCK_M x BLOCK_N tile: (WRITE_Q) q[m, n] and (WRITE_T) qt[n, m] as uint8 bits, and
    (WRITE_AMAX) atomic max of the tile's amax bits into ``*amax_ptr`` (int32, starts at 0).
    With neither store it is the amax alone (one read of ``x``, no abs() tensor)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if WRITE_Q or WRITE_T:
        scale = tl.load(scale_ptr)
        q = _saturate_to_fp8_bits(x * scale, FP8_MAX, E4M3, SOFT_CAST)
        if WRITE_Q:
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            # Same registers, transposed addresses: Triton routes them through shared memory so
            # that both stores are coalesced.
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
    if WRITE_AMAX:
        tl.atomic_max(amax_ptr, _amax_bits(x, mask))


@triton.jit
def recast_if_changed_kernel(
    x_ptr,
    used_ptr,
    cast_ptr,
    q_ptr,
    qt_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_Q: tl.constexpr = True,
    WRITE_T: tl.constexpr = True,
):
    """Delayed scaling's second chance: when the scale to use (``*used_ptr``) differs from
    the one ``q``/``qt`` were cast with (``*cast_ptr``: the history was empty, so the scale
    comes from this step's amax), cast the tile again into both; otherwise return before
    touching ``x``. NaN compares unequal, so a NaN scale re-casts (to NaN), as the torch path."""
    used = tl.load(used_ptr)
    cast = tl.load(cast_ptr)
    if used != cast:
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
        q = _saturate_to_fp8_bits(x.to(tl.float32) * used, FP8_MAX, E4M3, SOFT_CAST)
        if WRITE_Q:
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)


@triton.jit
def amax_cols_kernel(
    x_ptr,
    amax_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per-column ``max |x|`` (``amax_along(x, 0)``): each tile's column maxima, as float32
    bits, atomically maxed into ``amax_ptr[n]`` (int32, zero-initialised); NaN wins as in
    :func:`_amax_bits`."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
    a = tl.where(mask, tl.abs(x.to(tl.float32)), 0.0)
    is_nan = a != a
    col = tl.max(tl.where(is_nan, 0.0, a), axis=0).to(tl.int32, bitcast=True)
    has_nan = tl.max(is_nan.to(tl.int32), axis=0)
    tl.atomic_max(amax_ptr + rn, tl.where(has_nan > 0, _NAN_BITS, col), mask=rn < N)


@triton.jit
def cast_rowwise_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    EPS_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    col_scale_ptr=None,
    qt_ptr=None,
    ROW: tl.constexpr = True,
    COL: tl.constexpr = False,
):
    """BLOCK_M rows. ROW: the rows' amax (pass 1), scale = fp8_max / max(amax, eps) in float64
    (``amax_to_scale``), optionally floored to a power of two, then the row-scaled cast into
    ``q`` (pass 2, the rows are re-read from L2). COL: in the same pass 2, the cast with the
    given per-column scales (``col_scale_ptr``, from the column amaxes) stored transposed into
    ``qt`` (N, M): both axis casts a rowwise recipe needs, from one pass over ``x``."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rm < M
    if ROW:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        nan_seen = tl.zeros([BLOCK_M], dtype=tl.int32)
        for start in range(0, N, BLOCK_N):
            rn = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
            mask = row_ok[:, None] & (rn[None, :] < N)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
            a = tl.abs(x.to(tl.float32))
            is_nan = a != a
            amax = tl.maximum(amax, tl.max(tl.where(is_nan, 0.0, a), axis=1))
            nan_seen = tl.maximum(nan_seen, tl.max(is_nan.to(tl.int32), axis=1))
        eps = tl.full([BLOCK_M], EPS_BITS, tl.int64).to(tl.float64, bitcast=True)
        scale64 = FP8_MAX / tl.maximum(amax.to(tl.float64), eps)
        if POW2:
            # floor(log2(s)) as a bit mask: exact for the positive normal (or zero) s here
            scale64 = (scale64.to(tl.int64, bitcast=True) & _EXP_MASK_F64).to(tl.float64, bitcast=True)
        nan = tl.full([BLOCK_M], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        scale = tl.where(nan_seen > 0, nan, scale64.to(tl.float32))
        tl.store(scale_ptr + rm, scale, mask=row_ok)
    for start in range(0, N, BLOCK_N):
        rn = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = row_ok[:, None] & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if ROW:
            q = _saturate_to_fp8_bits(x * scale[:, None], FP8_MAX, E4M3, SOFT_CAST)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if COL:
            cs = tl.load(col_scale_ptr + rn, mask=rn < N, other=1.0)
            qt = _saturate_to_fp8_bits(x * cs[None, :], FP8_MAX, E4M3, SOFT_CAST)
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], qt, mask=mask)


@triton.jit
def _amax_to_scale64(a, FP8_MAX: tl.constexpr, EPS_BITS: tl.constexpr, MARGIN: tl.constexpr, POW2: tl.constexpr):
    """``amax_to_scale`` in float64, float32 result: fp8_max / max(amax, eps) / 2**margin,
    optionally floored to a power of two; NaN stays NaN (``torch.clamp`` keeps it)."""
    a64 = a.to(tl.float64)
    eps = tl.full(a64.shape, EPS_BITS, tl.int64).to(tl.float64, bitcast=True)
    safe = tl.where(a64 != a64, a64, tl.maximum(a64, eps))
    s = FP8_MAX / safe
    if MARGIN > 0:
        s = s / (2.0**MARGIN)
    if POW2:  # the exponent, from the bits (``scaling.floor_pow2``); NaN stays NaN
        s = tl.where(s != s, s, (s.to(tl.int64, bitcast=True) & _EXP_MASK_F64).to(tl.float64, bitcast=True))
    return s.to(tl.float32)


@triton.jit
def delayed_scale_kernel(
    hist_ptr,
    scale_ptr,
    step_ptr,
    amax_ptr,
    used_ptr,
    old_ptr,
    L,
    FP8_MAX: tl.constexpr,
    EPS_BITS: tl.constexpr,
    MARGIN: tl.constexpr,
    POW2: tl.constexpr,
    INTERVAL: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: ``delayed_scale_step`` for one operand, in place. Reads the history (all
    of it, into registers, before any store), this step's amax, the scale and the step;
    writes the scale to use now, the scale as it was (``old_ptr``: what a cast made before this
    update used), the history with the amax pushed (unless non-finite), and the next scale.
    Replaces ~24 tiny torch ops per operand and step."""
    idx = tl.arange(0, BLOCK)
    ok = idx < L
    hist = tl.load(hist_ptr + idx, mask=ok, other=0.0)
    prev = tl.load(hist_ptr + idx - 1, mask=ok & (idx > 0), other=0.0)
    scale = tl.load(scale_ptr)
    step = tl.load(step_ptr)
    amax_now = tl.load(amax_ptr)
    have = tl.max(tl.where(ok, hist, -float("inf")), axis=0) > 0
    used = tl.where(have, scale, _amax_to_scale64(amax_now, FP8_MAX, EPS_BITS, MARGIN, POW2))
    finite = tl.abs(amax_now) < float("inf")  # False for +-inf and NaN
    # a non-finite tensor casts with a NaN scale (linear.delayed_scale_step)
    used = tl.where(finite, used, tl.full(used.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True))
    pushed = tl.where(idx == 0, amax_now, prev)
    new_hist = tl.where(finite, pushed, hist)
    if ALGO_MAX:
        a = tl.max(tl.where(ok, new_hist, -float("inf")), axis=0)
    else:
        a = tl.sum(tl.where(idx == 0, new_hist, 0.0), axis=0)
    refresh = ((step + 1) % INTERVAL == 0) | (not have)
    new_scale = tl.where(refresh, _amax_to_scale64(a, FP8_MAX, EPS_BITS, MARGIN, POW2), used)
    tl.debug_barrier()  # every load above is done before the in-place stores
    tl.store(hist_ptr + idx, new_hist, mask=ok)
    tl.store(scale_ptr, new_scale)
    tl.store(used_ptr, used)
    tl.store(old_ptr, scale)
