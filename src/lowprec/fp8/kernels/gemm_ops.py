"""``torch.library`` operators around the Triton GEMM kernels: the blockwise-scaled GEMM, the
grouped (mixture-of-experts) GEMM and the grouped weight gradient (imports triton: load lazily).

The operator wrapper, the launch guard under a fake implementation and the interpreter switch are
:mod:`.ops`'s, shared with the cast operators.
"""

from __future__ import annotations

import torch
import triton

from lowprec.fp8.kernels.ops import _kernel, _operator, _skip, interpreting
from lowprec.fp8.kernels.triton_block_gemm import block_scaled_mm_kernel
from lowprec.fp8.kernels.triton_grouped_gemm import grouped_scaled_mm_kernel
from lowprec.fp8.kernels.triton_grouped_wgrad import TABLE_COLUMNS, grouped_block_wgrad_kernel, grouped_wgrad_kernel

__all__ = [
    "block_scaled_mm",
    "grouped_block_scaled_mm",
    "grouped_scaled_mm",
    "grouped_tile",
    "grouped_wgrad_scaled_mm",
    "grouped_block_wgrad_scaled_mm",
    "GEMM_TILE",
    "GROUPED_TILE",
    "WGRAD_TILE",
]

# blockwise GEMM: (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M); BLOCK_K is the scale block.
# Three stages of 128x128 FP8 A and B tiles are 96 KiB of shared memory: sm_90/sm_100 hold it,
# Ada (sm_89, 100 KiB per SM) gets two (tests/test_fp8_kernels_compile.py checks both).
GEMM_TILE = {"default": (128, 128, 8, 3, 8), "sm89": (128, 128, 8, 2, 8), "interpreter": (64, 64, 4, 1, 2)}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _gemm_launch(a: torch.Tensor, b: torch.Tensor, tile: tuple[int, ...]) -> dict:
    """What every FP8 GEMM launch passes besides its arguments: the operands' formats, the
    software FP8 decode under the interpreter, ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M)``."""
    bm, bn, bk, warps, stages, group_m = tile
    return dict(
        A_E4M3=a.dtype == torch.float8_e4m3fn,
        B_E4M3=b.dtype == torch.float8_e4m3fn,
        SOFT_FP8=interpreting(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )


def _gemm_tile(device: torch.device) -> tuple[int, int, int, int, int]:
    if interpreting():
        return GEMM_TILE["interpreter"]
    return GEMM_TILE["sm89"] if torch.cuda.get_device_capability(device) < (9, 0) else GEMM_TILE["default"]


@_operator("lowprec::block_scaled_mm", ())
def block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv_scale: torch.Tensor,
    b_inv_scale: torch.Tensor,
    block: int,
    group_n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)``: FP8 ``a`` (M, K) with dequantization scales (M, ceil(K/block)),
    FP8 ``b`` (K, N) with (ceil(K/block), ceil(N/group_n)); ``group_n`` is ``block`` for square
    B blocks, 1 for block x 1 tiles. Any strides; float32 accumulation; ``out_dtype`` written."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"block_scaled_mm needs (M, K) x (K, N), got {tuple(a.shape)} x {tuple(b.shape)}")
    if block not in (32, 64, 128) or group_n not in (1, block):
        raise ValueError(f"block_scaled_mm takes block 32/64/128 and group_n 1 or block, got {block}, {group_n}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"block_scaled_mm writes bfloat16/float16/float32, got {out_dtype}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if _skip(a):
        return c
    bm, bn, warps, stages, group_m = _gemm_tile(a.device)
    au, bu = a.view(torch.uint8), b.view(torch.uint8)
    _kernel(block_scaled_mm_kernel)[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        au,
        bu,
        a_inv_scale,
        b_inv_scale,
        c,
        m,
        n,
        k,
        au.stride(0),
        au.stride(1),
        bu.stride(0),
        bu.stride(1),
        a_inv_scale.stride(0),
        a_inv_scale.stride(1),
        b_inv_scale.stride(0),
        b_inv_scale.stride(1),
        c.stride(0),
        c.stride(1),
        GROUP_N=group_n,
        **_gemm_launch(a, b, (bm, bn, block, warps, stages, group_m)),
    )
    return c


# The grouped GEMMs' tiles: 64 rows (an expert's token group is often a few dozen to a few hundred
# rows, and a row tile never spans two groups), 128 x 128 N x K. Three stages of 64x128 + 128x128
# FP8 tiles are 72 KiB of shared memory: sm_89 takes them too (tests/test_fp8_kernels_compile.py).
# The blockwise grouped GEMM takes BLOCK_K from the recipe's block size (32/64/128) instead.
GROUPED_TILE = {"default": (64, 128, 128, 4, 3, 8), "interpreter": (16, 32, 32, 4, 1, 2)}


def grouped_tile(device: torch.device) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M)`` of the grouped GEMM here."""
    return GROUPED_TILE["interpreter" if interpreting() else "default"]


def _grouped_launch(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scales_offs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tiles_m: int,
    out_dtype: torch.dtype,
    scale_strides: tuple[int, int, int, int, int, int],
    block: int | None,
) -> torch.Tensor:
    """The grouped kernel's launch for both operators: the shape checks, the output, the grid.
    ``scale_strides``: ``(sam, sae, sak, sbe, sbk, sbn)``; ``block``: the block size where the
    scales are blockwise (``BLOCK_SCALES``; BLOCK_K is the block), else None."""
    sa, sb, offs = scales_offs
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1] or offs.shape != (b.shape[0],):
        raise ValueError(
            f"{name} needs (S, K) x (E, K, N) and offs (E,), got {tuple(a.shape)} x "
            f"{tuple(b.shape)}, offs {tuple(offs.shape)}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{name} writes bfloat16/float16/float32, got {out_dtype}")
    s, k = a.shape
    e, n = b.shape[0], b.shape[2]
    c = torch.empty((s, n), dtype=out_dtype, device=a.device)
    if _skip(a) or s == 0 or tiles_m <= 0:
        return c
    bm, bn, bk, warps, stages, group_m = grouped_tile(a.device)
    au, bu = a.view(torch.uint8), b.view(torch.uint8)
    _kernel(grouped_scaled_mm_kernel)[(tiles_m * triton.cdiv(n, bn),)](
        au,
        bu,
        sa,
        sb,
        offs,
        c,
        n,
        k,
        e,
        tiles_m,
        au.stride(0),
        au.stride(1),
        bu.stride(0),
        bu.stride(1),
        bu.stride(2),
        *scale_strides,
        c.stride(0),
        c.stride(1),
        BLOCK_SCALES=block is not None,
        **_gemm_launch(a, b, (bm, bn, block or bk, warps, stages, group_m)),
    )
    return c


@_operator("lowprec::grouped_scaled_mm", ())
def grouped_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv_scale: torch.Tensor,
    b_inv_scale: torch.Tensor,
    offs: torch.Tensor,
    a_row_scales: bool,
    tiles_m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Every group's ``dequant(a[rows of g]) @ dequant(b[g])`` in one launch (see
    :mod:`.triton_grouped_gemm`): FP8 ``a`` (S, K), FP8 ``b`` (E, K, N), int32 cumulative group
    ends ``offs`` (E,); dequantization scales ``a_inv_scale`` (S,) per row when ``a_row_scales``,
    else (E,) one per group, ``b_inv_scale`` (E, N) per column or (E,) per expert. ``tiles_m``:
    the row tiles of all groups (``sum ceil(c_g / BLOCK_M)`` for ``grouped_tile``'s BLOCK_M; an
    upper bound is fine). Any strides; float32 accumulation; ``out_dtype`` written."""
    sa_m, sa_e = (a_inv_scale.stride(0), 0) if a_row_scales else (0, a_inv_scale.stride(0))
    sb_n = b_inv_scale.stride(1) if b_inv_scale.dim() == 2 else 0
    return _grouped_launch(
        "grouped_scaled_mm",
        a,
        b,
        (a_inv_scale, b_inv_scale, offs),
        tiles_m,
        out_dtype,
        (sa_m, sa_e, 0, b_inv_scale.stride(0), 0, sb_n),
        None,
    )


@_operator("lowprec::grouped_block_scaled_mm", ())
def grouped_block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv_scale: torch.Tensor,
    b_inv_scale: torch.Tensor,
    offs: torch.Tensor,
    block: int,
    tiles_m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Every group's ``dequant(a[rows of g]) @ dequant(b[g])`` in one launch, blockwise scales (see
    :mod:`.triton_grouped_gemm`): FP8 ``a`` (S, K) with dequantization scales (S, ceil(K/block))
    (1 x block tiles), FP8 ``b`` (E, K, N) with (E, ceil(K/block), ceil(N/block)) (block x block),
    int32 cumulative group ends ``offs`` (E,). ``tiles_m`` as :func:`grouped_scaled_mm` takes it.
    Any strides; float32 accumulation, scales per K tile; ``out_dtype`` written."""
    if block not in (32, 64, 128):
        raise ValueError(f"grouped_block_scaled_mm takes block 32/64/128, got {block}")
    sa, sb = a_inv_scale, b_inv_scale
    strides = (sa.stride(0), 0, sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2))
    return _grouped_launch("grouped_block_scaled_mm", a, b, (sa, sb, offs), tiles_m, out_dtype, strides, block)


# The grouped weight gradient's tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M), a
# 128 x 128 output tile (W's N x K) per program and 64 token rows per contraction step (a group's
# rows are often a few hundred).
# Three stages of 128x64 + 64x128 FP8 tiles are 48 KiB of shared memory: sm_89 takes them too.
WGRAD_TILE = {"default": (128, 128, 64, 8, 3, 8), "interpreter": (32, 32, 16, 4, 1, 2)}


def _group_table(groups: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, bool]:
    """``(table, token_unit)``: each group's ``(address, rows, token stride, feature stride)``,
    int64 (E, 4) on ``device``, and whether every group's token stride is 1 (empty groups: address
    0, no rows). Read on the host from the tensors' metadata: no device value is read."""
    rows = []
    for g in groups:
        rows += [g.data_ptr() if g.numel() else 0, g.shape[0], g.stride(0), g.stride(1)]
    unit = all(g.stride(0) == 1 for g in groups if g.shape[0] > 1)
    return _to_device(torch.tensor(rows, dtype=torch.int64).view(len(groups), TABLE_COLUMNS), device), unit


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on ``device``: from pinned memory, not waiting (a copy from pageable memory
    would wait for the stream)."""
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)


def _wgrad_launch(kernel, dy, x, tables: tuple, scales: tuple, out: torch.Tensor, tile: tuple) -> None:
    """One launch of a grouped weight-gradient kernel: one program per (expert, output tile);
    its arguments in the kernels' order (the groups' tables, ``tables``, ``scales`` (pointers,
    then strides), ``out`` and its sizes, tile counts and strides); ``tile`` as ``_gemm_launch``."""
    e, n, k = out.shape
    dy_table, dy_unit = _group_table(dy, out.device)
    x_table, x_unit = _group_table(x, out.device)
    tiles_n, tiles_k = triton.cdiv(n, tile[0]), triton.cdiv(k, tile[1])  # W's N and K
    sa, sb, *strides = scales
    kernel[(e * tiles_n * tiles_k,)](  # opaque: its own launch, never wrap_triton
        dy_table,
        x_table,
        *tables,
        sa,
        sb,
        out,
        n,
        k,
        tiles_n,
        tiles_k,
        *strides,
        *out.stride(),
        DY_TOKEN_UNIT=dy_unit,
        X_TOKEN_UNIT=x_unit,
        **_gemm_launch(dy[0], x[0], tile),  # GEMM (N, K) += (N, c) @ (c, K)
    )


def _wgrad_shape(name: str, dy: list[torch.Tensor], x: list[torch.Tensor], out: torch.Tensor) -> tuple[int, int, int]:
    """``(E, N, K)`` of a grouped weight gradient's arguments, checked: E groups of dY (c_e, N)
    and x (c_e, K), ``out`` (E, N, K) float32."""
    if len(dy) != len(x) or out.dim() != 3 or out.shape[0] != len(dy):
        raise ValueError(
            f"{name} needs E groups of dY and x and out (E, N, K), got {len(dy)}, {len(x)} and {tuple(out.shape)}"
        )
    e, n, k = out.shape
    if any(d.shape[0] != g.shape[0] or d.shape[1] != n or g.shape[1] != k for d, g in zip(dy, x)):
        raise ValueError(f"{name}: each dy[e] (c_e, {n}) and x[e] (c_e, {k}) share their rows")
    if out.dtype != torch.float32:
        raise TypeError(f"{name} writes float32, got {out.dtype}")
    return e, n, k


@_operator("lowprec::grouped_wgrad_scaled_mm", ("out",), opaque=True)  # reads the groups' addresses
def grouped_wgrad_scaled_mm(
    dy: list[torch.Tensor],
    x: list[torch.Tensor],
    dy_inv_scale: torch.Tensor,
    x_inv_scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Every expert's weight gradient ``out[e] = dequant(dy[e])^T @ dequant(x[e])`` written into
    ``out`` (E, N, K) float32 in one launch (see :mod:`.triton_grouped_wgrad`): FP8 ``dy[e]``
    (c_e, N) and ``x[e]`` (c_e, K), any strides, c_e >= 0 (an empty expert's slice gets zeros);
    dequantization scales ``dy_inv_scale`` (E, N) per column or (E,) per group, ``x_inv_scale``
    (E, K) or (E,). One FP8 dtype across ``dy`` and one across ``x``; float32 accumulation."""
    e, n, k = _wgrad_shape("grouped_wgrad_scaled_mm", dy, x, out)
    if _skip(out) or e == 0:
        return
    sa, sb = dy_inv_scale, x_inv_scale
    strides = (sa.stride(0), sa.stride(1) if sa.dim() == 2 else 0, sb.stride(0), sb.stride(1) if sb.dim() == 2 else 0)
    tile = WGRAD_TILE["interpreter" if interpreting() else "default"]
    _wgrad_launch(grouped_wgrad_kernel, dy, x, (), (sa, sb, *strides), out, tile)


@_operator("lowprec::grouped_block_wgrad_scaled_mm", ("out",), opaque=True)  # reads the groups' addresses
def grouped_block_wgrad_scaled_mm(
    dy: list[torch.Tensor],
    x: list[torch.Tensor],
    dy_inv_scale: torch.Tensor,
    x_inv_scale: torch.Tensor,
    block: int,
    out: torch.Tensor,
) -> None:
    """Every expert's weight gradient ``out[e] = dequant(dy[e])^T @ dequant(x[e])`` written into
    ``out`` (E, N, K) float32 in one launch, block scales along the tokens (see
    :mod:`.triton_grouped_wgrad`): FP8 ``dy[e]`` (c_e, N) and ``x[e]`` (c_e, K), any strides, c_e
    >= 0; dequantization scales of each group's ``block`` x 1 tiles (starting at its first row)
    stacked in group order, ``dy_inv_scale`` (T, N) and ``x_inv_scale`` (T, K), ``T = sum_e
    ceil(c_e / block)``. One FP8 dtype across ``dy`` and one across ``x``; float32 accumulation."""
    e, n, k = _wgrad_shape("grouped_block_wgrad_scaled_mm", dy, x, out)
    if block not in (32, 64, 128):
        raise ValueError(f"grouped_block_wgrad_scaled_mm takes block 32/64/128, got {block}")
    tiles = [triton.cdiv(d.shape[0], block) for d in dy]
    if dy_inv_scale.shape != (sum(tiles), n) or x_inv_scale.shape != (sum(tiles), k):
        raise ValueError(
            f"grouped_block_wgrad_scaled_mm: scales ({sum(tiles)}, {n}) and ({sum(tiles)}, {k}) for {block}-row "
            f"tiles, got {tuple(dy_inv_scale.shape)} and {tuple(x_inv_scale.shape)}"
        )
    if _skip(out) or e == 0:
        return
    first = _to_device(torch.tensor([0, *tiles[:-1]], dtype=torch.int64).cumsum(0), out.device)
    bm, bn, warps, stages, group_m = _gemm_tile(out.device)  # the contraction step is the scale tile
    sa, sb = dy_inv_scale, x_inv_scale
    scales = (sa, sb, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    _wgrad_launch(grouped_block_wgrad_kernel, dy, x, (first,), scales, out, (bm, bn, block, warps, stages, group_m))
