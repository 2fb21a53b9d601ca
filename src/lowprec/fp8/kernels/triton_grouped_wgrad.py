"""Triton kernel: the grouped expert weight gradient, every expert's FP8 ``dY_e^T @ x_e`` in one launch.

``C[e] (N, K) = dequant(dY_e)^T @ dequant(x_e)`` for every expert ``e`` at once, the contraction
over the ``c_e`` token rows of its group:

=========  ============================================  ==========================================
dY_e       (c_e, N) FP8, any strides                     one row per token of the group
x_e        (c_e, K) FP8, any strides                     the same tokens' inputs
tables     int64 (E, 4) per operand: ``(address,         each group where its cast wrote it (no
           c_e, token stride, feature stride)``          copy of the groups into one buffer);
                                                         address 0 and c_e 0 for an empty expert
sa         dequantization scale (``1 / scale``) of        ``sa[e * stride_sae + n * stride_san]``:
           column n of dY_e                              per column (rowwise) or per group
                                                         (stride_san 0: tensorwise)
sb         dequantization scale of column k of x_e        ``sb[e * stride_sbe + k * stride_sbk]``
C          (E, N, K) float32, written in place            every element once; an empty expert's
                                                         zeros too (no separate zero fill)
=========  ============================================  ==========================================

The tiles are named as the GEMM's ``(M, N, K)``: BLOCK_M over the gradient's rows (W's N),
BLOCK_N over its columns (W's K), BLOCK_K over the contraction (the group's tokens). One program
per (expert, BLOCK_M x BLOCK_N output tile): ``E * ceil(N / BLOCK_M) * ceil(K / BLOCK_N)``
programs. Each reads its group's row count from the table and loops over the rows in BLOCK_K
steps, the last one masked, so groups need not be multiples of 16 (nothing is padded);
an empty group runs no step and stores zeros. ``DY_TOKEN_UNIT`` / ``X_TOKEN_UNIT``: the operand's
token stride is 1 (the transposed copies the fused casts write on CUDA, ``(N, c_e)``
contiguous: the layout an FP8 MMA wants, contiguous along the contraction), a constant the
compiler can use; else it is the table's.

Numerics: the FP8 products summed in a float32 accumulator (``triton_block_gemm.fp8_dot``: the
tensor cores' FP8 MMA on hardware, the exact software decode under the interpreter), then
``acc * (sa[n] * sb[k])`` stored as float32: the per-expert scaled GEMM's order (the scale as an
epilogue on the float32 accumulator), without the bf16 output torch's row-scaled ``_scaled_mm``
writes.

Block scales (the blockwise recipe, :func:`grouped_block_wgrad_kernel`): each group's dY and x
are cast in ``b x 1`` tiles along its tokens, the tiles starting at the group's first row (a scale
tile never crosses a group), so the contraction runs in steps of exactly one tile (BLOCK_K = b):
per step one FP8 dot from zero, times ``sa[t, n] * sb[t, k]`` (the tile's dequantization scales),
added to the float32 accumulator: the dense blockwise kernel's order (``block_scaled_acc``), with
the scale tiles of all groups stacked in group order, ``(T, N)`` and ``(T, K)``, ``T = sum_e
ceil(c_e / b)``, and each group's first tile ``t`` read from ``first_tile_ptr``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_block_gemm import fp8_dot, load_k_tile, tile_order

__all__ = ["grouped_wgrad_kernel", "grouped_block_wgrad_kernel", "TABLE_COLUMNS"]

TABLE_COLUMNS = 4  # address, rows, token stride, feature stride


@triton.jit
def _group(table_ptr, e, TOKEN_UNIT: tl.constexpr):
    """``(base pointer, rows, token stride, feature stride)`` of expert ``e``'s operand."""
    row = table_ptr + e * 4
    base = tl.load(row).to(tl.pointer_type(tl.uint8))
    rows = tl.load(row + 1)
    tok = 1 if TOKEN_UNIT else tl.load(row + 2)
    return base, rows, tok, tl.load(row + 3)


@triton.jit
def _tile(N, K, TILES_N, TILES_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(e, rn, rk, n_ok, k_ok)``: this program's expert, its output tile's rows (W's N) and
    columns (W's K) and which of them lie inside the gradient."""
    per_expert = TILES_N * TILES_K
    pid = tl.program_id(0)
    pid_n, pid_k = tile_order(pid % per_expert, TILES_N, TILES_K, GROUP_M)
    rn = (pid_n * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rk = (pid_k * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return pid // per_expert, rn, rk, rn < N, rk < K


@triton.jit
def _store(c_ptr, e, rn, rk, n_ok, k_ok, acc, stride_ce, stride_cn, stride_ck):
    """The float32 tile into expert ``e``'s slice of the gradient."""
    c = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None] * stride_cn + rk[None, :] * stride_ck
    tl.store(c, acc, mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def grouped_wgrad_kernel(
    dy_table_ptr,
    x_table_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    N,
    K,
    TILES_N,
    TILES_K,
    stride_sae,
    stride_san,
    stride_sbe,
    stride_sbk,
    stride_ce,
    stride_cn,
    stride_ck,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    DY_TOKEN_UNIT: tl.constexpr,
    X_TOKEN_UNIT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of expert ``e``'s weight gradient."""
    e, rn, rk, n_ok, k_ok = _tile(N, K, TILES_N, TILES_K, BLOCK_M, BLOCK_N, GROUP_M)
    a_base, rows, a_tok, a_feat = _group(dy_table_ptr, e, DY_TOKEN_UNIT)
    b_base, _, b_tok, b_feat = _group(x_table_ptr, e, X_TOKEN_UNIT)
    rr = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.cdiv(rows, BLOCK_K)):
        # A = dY_e^T (N x tokens), B = x_e (tokens x K); the last step's rows past c_e masked to 0
        a, b = load_k_tile(a_base, b_base, rn, rk, n_ok, k_ok, r0 * BLOCK_K + rr, rows, a_feat, a_tok, b_tok, b_feat)
        acc = fp8_dot(a, b, acc, A_E4M3, B_E4M3, SOFT_FP8)
    e64 = e.to(tl.int64)
    sa = tl.load(sa_ptr + e64 * stride_sae + rn * stride_san, mask=n_ok, other=0.0)
    sb = tl.load(sb_ptr + e64 * stride_sbe + rk * stride_sbk, mask=k_ok, other=0.0)
    acc = acc * (sa[:, None] * sb[None, :])
    _store(c_ptr, e, rn, rk, n_ok, k_ok, acc, stride_ce, stride_cn, stride_ck)


@triton.jit
def grouped_block_wgrad_kernel(
    dy_table_ptr,
    x_table_ptr,
    first_tile_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    N,
    K,
    TILES_N,
    TILES_K,
    stride_sat,
    stride_san,
    stride_sbt,
    stride_sbk,
    stride_ce,
    stride_cn,
    stride_ck,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    DY_TOKEN_UNIT: tl.constexpr,
    X_TOKEN_UNIT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of expert ``e``'s weight gradient, block scales along the
    tokens (BLOCK_K = the scale tile ``b``; see the module docstring)."""
    e, rn, rk, n_ok, k_ok = _tile(N, K, TILES_N, TILES_K, BLOCK_M, BLOCK_N, GROUP_M)
    a_base, rows, a_tok, a_feat = _group(dy_table_ptr, e, DY_TOKEN_UNIT)
    b_base, _, b_tok, b_feat = _group(x_table_ptr, e, X_TOKEN_UNIT)
    first = tl.load(first_tile_ptr + e)
    rr = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, tl.cdiv(rows, BLOCK_K)):
        a, b = load_k_tile(a_base, b_base, rn, rk, n_ok, k_ok, r0 * BLOCK_K + rr, rows, a_feat, a_tok, b_tok, b_feat)
        part = fp8_dot(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), A_E4M3, B_E4M3, SOFT_FP8)
        t = first + r0  # this step's scale tile, shared by dY_e and x_e
        sa = tl.load(sa_ptr + t * stride_sat + rn * stride_san, mask=n_ok, other=0.0)
        sb = tl.load(sb_ptr + t * stride_sbt + rk * stride_sbk, mask=k_ok, other=0.0)
        acc += part * (sa[:, None] * sb[None, :])
    _store(c_ptr, e, rn, rk, n_ok, k_ok, acc, stride_ce, stride_cn, stride_ck)
