"""Triton kernel: blockwise-scaled FP8 GEMM (DeepSeek-V3 scaling), float32 accumulation.

For GPUs and torch builds without torch's blockwise ``scaled_mm`` (Ada sm_89, Blackwell sm_100,
or a shape cuBLAS refuses). ``C = dequant(A) @ dequant(B)`` with ``A`` (M, K) in 1 x BLOCK_K
tiles (one dequantization scale per row and K-block, ``sa`` (M, K/BLOCK_K)) and ``B`` (K, N)
either in BLOCK_K x BLOCK_K blocks (``GROUP_N = BLOCK_K``: ``sb`` (K/BLOCK_K, N/BLOCK_K)) or in
BLOCK_K x 1 tiles (``GROUP_N = 1``: ``sb`` (K/BLOCK_K, N)). The scales passed are the
*dequantization* scales (``1 / scale``, as torch's kernel takes them).

Per K-block, one FP8 ``tl.dot`` (tensor cores, exact FP8 products summed in float32) gives the
block's partial sums, which are scaled by ``sa[m] * sb[n]`` and added to a float32 accumulator:
the scales change every BLOCK_K along K, so they cannot be applied after the loop (DeepSeek-V3's
"promotion" every 128 elements, which also bounds the tensor cores' limited-precision
accumulation to one K-block). Against the float32 emulation (dequantize, then one matmul) the
result differs only in summation order and where the scale multiplies: within the bound
``cpu_gemm.py`` documents (``K * eps32 * (|A| @ |B|)`` plus the output rounding), checked under
the Triton interpreter. ``SOFT_FP8``: decode FP8 bits with integer arithmetic and ``tl.dot`` in
float32 (the interpreter, whose FP8 conversions are not exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_scaled_mm_kernel", "block_scaled_acc", "fp8_dot", "load_k_tile", "tile_order"]


@triton.jit
def _fp8_bits_to_f32(bits, E4M3: tl.constexpr):
    """FP8 code (int32 0..255) -> float32, exactly: subnormals, +-0, NaN (E4M3FN 0x7F/0xFF;
    E5M2 exponent 31: inf or NaN)."""
    if E4M3:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        EXP_MAX: tl.constexpr = 15
        SUB: tl.constexpr = 0.001953125  # 2**-9: E4M3 subnormal step
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        EXP_MAX: tl.constexpr = 31
        SUB: tl.constexpr = 0.0000152587890625  # 2**-16: E5M2 subnormal step
    sign = (bits >> 7) & 1
    e = (bits >> MANT) & EXP_MAX
    m = bits & ((1 << MANT) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * SUB, normal)
    if E4M3:
        special = (e == EXP_MAX) & (m == (1 << MANT) - 1)  # 0x7F / 0xFF: NaN; other e == 15 are normal
        v = tl.where(special, float("nan"), v)
    else:
        v = tl.where(e == EXP_MAX, tl.where(m == 0, float("inf"), float("nan")), v)
    return tl.where(sign == 1, -v, v)


@triton.jit
def tile_order(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """``(row tile, column tile)`` of program ``pid`` in a grouped launch order: GROUP_M row
    tiles share their B tiles while those are in L2."""
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def fp8_dot(a, b, acc, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr):
    """``acc + a @ b`` in float32 for FP8 tiles held as uint8: the FP8 tensor-core MMA
    accumulating into ``acc``, or under the interpreter (``SOFT_FP8``) the exact software decode
    and a float32 dot."""
    if SOFT_FP8:
        return tl.dot(
            _fp8_bits_to_f32(a.to(tl.int32), A_E4M3),
            _fp8_bits_to_f32(b.to(tl.int32), B_E4M3),
            acc,
            input_precision="ieee",
        )
    fa = a.to(tl.float8e4nv, bitcast=True) if A_E4M3 else a.to(tl.float8e5, bitcast=True)
    fb = b.to(tl.float8e4nv, bitcast=True) if B_E4M3 else b.to(tl.float8e5, bitcast=True)
    return tl.dot(fa, fb, acc, out_dtype=tl.float32)


@triton.jit
def load_k_tile(a_ptr, b_ptr, rm, rn, m_ok, n_ok, k, K, stride_am, stride_ak, stride_bk, stride_bn):
    """The A tile (rows ``rm``, columns ``k``) and B tile (rows ``k``, columns ``rn``) of one K
    step, zero outside the matrices."""
    k_ok = k < K
    a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0)
    b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0)
    return a, b


@triton.jit
def block_scaled_acc(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    rm,
    rn,
    m_ok,
    n_ok,
    K,
    k_tiles,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_sam,
    stride_sak,
    stride_sbk,
    stride_sbn,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    GROUP_N: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The float32 accumulator of rows ``rm`` x columns ``rn`` over the first ``k_tiles`` K
    tiles: per K tile one FP8 dot from zero, scaled by ``sa[m, kb] * sb[kb, n // GROUP_N]`` and
    added (the scale epilogue per K tile; shared with the grouped blockwise kernel)."""
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k_tiles):
        a, b = load_k_tile(
            a_ptr, b_ptr, rm, rn, m_ok, n_ok, kb * BLOCK_K + rk, K, stride_am, stride_ak, stride_bk, stride_bn
        )
        part = fp8_dot(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), A_E4M3, B_E4M3, SOFT_FP8)
        sa = tl.load(sa_ptr + rm * stride_sam + kb * stride_sak, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + kb * stride_sbk + (rn // GROUP_N) * stride_sbn, mask=n_ok, other=0.0)
        acc += part * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def block_scaled_mm_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_sam,
    stride_sak,
    stride_sbk,
    stride_sbn,
    stride_cm,
    stride_cn,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    GROUP_N: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of C. ``a_ptr``/``b_ptr`` are the FP8 tensors viewed as uint8."""
    pid_m, pid_n = tile_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    acc = block_scaled_acc(
        a_ptr,
        b_ptr,
        sa_ptr,
        sb_ptr,
        rm,
        rn,
        m_ok,
        n_ok,
        K,
        tl.cdiv(K, BLOCK_K),
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_sam,
        stride_sak,
        stride_sbk,
        stride_sbn,
        A_E4M3,
        B_E4M3,
        GROUP_N,
        SOFT_FP8,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=m_ok[:, None] & n_ok[None, :])
