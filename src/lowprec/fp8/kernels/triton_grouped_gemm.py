"""Triton kernel: grouped FP8 GEMM (mixture-of-experts), tensor, row/column or block scales, one launch.

``C[rows of g] = dequant(A[rows of g]) @ dequant(B[g])`` for every group (expert) ``g`` at once:

========  ==============================================  ===========================================
A         (S, K) FP8, any strides                         group g: rows ``offs[g-1] .. offs[g]``
B         (E, K, N) FP8, any strides                      a stacked (E, N, K) weight transposed, or
                                                          (E, K, N) itself
sa        dequantization scale (``1 / scale``) of row m   ``sa[m * stride_sam + g * stride_sae]``:
          of group g                                      per row (stride_sae 0) or per group
                                                          (stride_sam 0: a per-tensor group scale)
sb        dequantization scale of column n of expert g    ``sb[g * stride_sbe + n * stride_sbn]``:
                                                          per column or per expert (stride_sbn 0)
offs      (E,) int32 cumulative group ends                ragged, empty groups allowed, no padding
C         (S, N) bfloat16 / float16 / float32             written in A's row order
========  ==============================================  ===========================================

The launch is one program per (row tile of a group, N tile): ``TILES_M`` row tiles in all
(``sum ceil(c_g / BLOCK_M)``, at most ``ceil(S / BLOCK_M) + E``; a larger count is harmless, the
extra programs find no group and do nothing). Each program finds its group by walking ``offs``
(E scalar loads; no host-side table, no device-to-host read), so a tile never spans two groups
and an empty group owns no tile. A GROUP_M launch order makes neighbouring programs share B tiles
in L2, as ``triton_block_gemm.py`` does.

Numerics: the FP8 products are summed in a float32 accumulator (``tl.dot``: the tensor cores'
FP8 MMA on hardware; under the interpreter the exact software decode of ``triton_block_gemm`` and
a float32 dot, ``triton_block_gemm.fp8_dot``), then ``acc * (sa[m] * sb[n])`` is rounded once to C's dtype. That is the order of
the per-expert path's scaled GEMM (the scale as an epilogue on the float32 accumulator), so the
two differ only in the summation order inside the accumulator (``cpu_gemm.py``'s bound) and, for
row scales on CPU, in the per-expert path's bf16 rounding of the accumulator before its scales.

``BLOCK_SCALES``: the blockwise recipe's output and grad_input GEMMs, the same launch and group
walk with DeepSeek-V3 block scales: ``sa[m * stride_sam + kb * stride_sak]`` per row and K tile
(A cast in 1 x BLOCK_K tiles: (S, K/BLOCK_K)), ``sb[g * stride_sbe + kb * stride_sbk + (n //
BLOCK_K) * stride_sbn]`` per expert and BLOCK_K x BLOCK_K block of B ((E, K/BLOCK_K, N/BLOCK_K)),
BLOCK_K the recipe's block size. Its K loop is the dense blockwise kernel's
(``triton_block_gemm.block_scaled_acc``: each K tile's FP8 dot from zero, scaled by ``sa * sb``,
added to the float32 accumulator), so a group's rows are what that kernel gives for its expert,
up to the summation order inside one K tile's dot (the tile shapes differ).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_block_gemm import block_scaled_acc, fp8_dot, load_k_tile, tile_order

__all__ = ["grouped_scaled_mm_kernel", "group_of"]


@triton.jit
def group_of(tile_m, offs_ptr, E, BLOCK_M: tl.constexpr):
    """``(group, first row, group end)`` of row tile ``tile_m``: walk the cumulative ends,
    counting each group's tiles; group -1 (and an empty row range) past the last tile."""
    group = -1
    m_start = 0
    m_end = 0
    seen = 0  # row tiles of the groups before g
    prev = 0  # offs[g - 1]
    for g in range(0, E):
        end = tl.load(offs_ptr + g)
        n_tiles = tl.cdiv(end - prev, BLOCK_M)
        hit = (tile_m >= seen) & (tile_m < seen + n_tiles)
        group = tl.where(hit, g, group)
        m_start = tl.where(hit, prev + (tile_m - seen) * BLOCK_M, m_start)
        m_end = tl.where(hit, end, m_end)
        seen += n_tiles
        prev = end
    return group, m_start, m_end


@triton.jit
def grouped_scaled_mm_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    offs_ptr,
    c_ptr,
    N,
    K,
    E,
    TILES_M,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_sam,
    stride_sae,
    stride_sak,
    stride_sbe,
    stride_sbk,
    stride_sbn,
    stride_cm,
    stride_cn,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of C inside one group. ``a_ptr``/``b_ptr``: FP8 viewed as uint8."""
    tile_m, pid_n = tile_order(tl.program_id(0), TILES_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    group, m_start, m_end = group_of(tile_m, offs_ptr, E, BLOCK_M)
    k_tiles = tl.where(group >= 0, tl.cdiv(K, BLOCK_K), 0)  # no group: no work, every store masked
    g64 = tl.maximum(group, 0).to(tl.int64)

    rm = tl.arange(0, BLOCK_M).to(tl.int64) + m_start  # int64 offsets: S * K may pass 2**31
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < m_end
    n_ok = rn < N
    b_base = b_ptr + g64 * stride_be
    if BLOCK_SCALES:  # the dense blockwise kernel's K loop: the scales applied per K tile
        acc = block_scaled_acc(
            a_ptr,
            b_base,
            sa_ptr,
            sb_ptr + g64 * stride_sbe,
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
            A_E4M3,
            B_E4M3,
            BLOCK_K,  # GROUP_N: square B blocks
            SOFT_FP8,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    else:  # one scale per row and column: an epilogue on the float32 accumulator
        rk = tl.arange(0, BLOCK_K).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_tiles):
            k = kb * BLOCK_K + rk
            a, b = load_k_tile(a_ptr, b_base, rm, rn, m_ok, n_ok, k, K, stride_am, stride_ak, stride_bk, stride_bn)
            acc = fp8_dot(a, b, acc, A_E4M3, B_E4M3, SOFT_FP8)
        sa = tl.load(sa_ptr + rm * stride_sam + g64 * stride_sae, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + g64 * stride_sbe + rn * stride_sbn, mask=n_ok, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=m_ok[:, None] & n_ok[None, :])
