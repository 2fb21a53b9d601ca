"""The NVFP4 cast operators (``lowprec::cast_nvfp4``, the Hadamard-rotated weight-gradient operand's
``rht_amax`` / ``cast_nvfp4_rht``, and both operands of one tensor from one read each:
``nvfp4_dual_amax`` / ``cast_nvfp4_dual``) around ``triton_nvfp4*`` (imports triton:
load lazily; :mod:`.ops` re-exports it). Registered as the other casts are (``_operator``:
opaque, with a fake that runs the body without launching, so a trace on meta tensors counts its
bytes)."""

from __future__ import annotations

import torch
import triton

from lowprec.fp8.kernels.op_support import (
    _check,
    _dims,
    _kernel,
    _operator,
    _row_col_outputs,
    _skip,
    interpreting,
    two_pass,
)
from lowprec.fp8.kernels.triton_nvfp4 import NV_TILE_M, NV_TILE_N, cast_nvfp4_kernel
from lowprec.fp8.kernels.triton_nvfp4_dual import cast_nvfp4_dual_kernel, nvfp4_dual_amax_kernel

__all__ = ["cast_nvfp4", "rht_amax", "cast_nvfp4_rht", "nvfp4_dual_amax", "cast_nvfp4_dual"]


@_operator("lowprec::cast_nvfp4", ())
def cast_nvfp4(
    x: torch.Tensor, s: torch.Tensor, tile2d: bool, rows: bool, cols: bool, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 casts of a 2-D ``x`` given the tensor encode factor ``s`` (float32 scalar,
    ``nvfp4.tensor_scales(amax)[0]``): ``(q, scale, qt, scale_t)`` as uint8 (packed E2M1
    pairs, E4M3 scale bytes). ``rows``: ``quantize_nvfp4(x)``'s data (M, N padded to 16 / 2) and
    scales (M, N/16), or with ``tile2d`` ``quantize_nvfp4_2d(x)``'s; ``cols`` (``tile2d`` only):
    ``transpose_2d`` of it, (N, M padded / 2) and (N, M/16), from the same read. Outputs not
    asked for are empty. ``key`` >= 0 (``nvfp4.sr_key`` of a seed; 1x16 only): stochastic
    rounding with that stream, as ``quantize_nvfp4(x, seed)``."""
    _check(x, torch.float8_e4m3fn)
    if cols and not tile2d:
        raise ValueError("cast_nvfp4: the transposed layout is the 16x16 tiles' (tile2d=True)")
    if key >= 0 and tile2d:
        raise ValueError("cast_nvfp4: stochastic rounding is for 1x16 blocks (tile2d=False)")
    m, n = x.shape
    mp, np_ = triton.cdiv(m, 16) * 16, triton.cdiv(n, 16) * 16
    dev = x.device
    q = torch.empty((m, np_ // 2) if rows else (0,), dtype=torch.uint8, device=dev)
    sc = torch.empty((m, np_ // 16) if rows else (0,), dtype=torch.uint8, device=dev)
    qt = torch.empty((n, mp // 2) if cols else (0,), dtype=torch.uint8, device=dev)
    st = torch.empty((n, mp // 16) if cols else (0,), dtype=torch.uint8, device=dev)
    if m and n:
        if rows and cols and two_pass("cast_nvfp4", x):
            _launch(x, s, tile2d, key, q, sc, None, None)
            _launch(x, s, tile2d, key, None, None, qt, st)
        else:
            _launch(x, s, tile2d, key, q if rows else None, sc, qt if cols else None, st)
    return q, sc, qt, st


def _launch(x, s, tile2d, key, q, sc, qt, st) -> None:
    if _skip(x) or (q is None and qt is None):
        return
    m, n = x.shape
    bm = 16 if tile2d else NV_TILE_M
    _kernel(cast_nvfp4_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, NV_TILE_N))](
        x,
        s,
        *_row_col_outputs(q, sc, qt, st),
        *_dims(x),
        max(key, 0),
        SOFT_CAST=interpreting(),
        SR=key >= 0,
        TILE2D=tile2d,
        ROW=q is not None,
        COL=qt is not None,
        BLOCK_M=bm,
        BLOCK_N=NV_TILE_N,
        num_warps=4,
    )


# weight-gradient operands: 16 rows (one Hadamard block) by 64 columns per program
_RHT_TILE_N = 64


@_operator("lowprec::rht_amax", ())
def rht_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``max |hadamard.rht(t, seed)|`` (``sign_bits``: ``rht_sign_bits(seed)``) as a float32
    scalar, one read of ``t`` (NaN where the transform holds one)."""
    return _amax_bits(t, sign_bits, ())


def _amax_bits(t: torch.Tensor, sign_bits: int, shape: tuple) -> torch.Tensor:
    """The dual amax kernel's atomic maxes over 16 x 64 tiles of ``t`` into int32 slots of ``shape``
    (``(2,)``: the plain and the rotated amax; ``()``: the rotated one), as float32."""
    _check(t, torch.float8_e4m3fn)
    bits = torch.zeros(shape, dtype=torch.int32, device=t.device)
    _launch16(nvfp4_dual_amax_kernel, t, (bits,), sign_bits, (), PLAIN=shape == (2,))
    return bits.view(torch.float32)


def _launch16(kernel, t: torch.Tensor, outputs: tuple, sign_bits: int, keys: tuple, **flags) -> None:
    """``kernel`` over 16 x 64 tiles of ``t`` (none where ``t`` is empty or a trace's): its
    arguments ``t``, ``outputs``, ``sign_bits``, ``t``'s sizes and strides, ``keys``, ``flags``."""
    m, n = t.shape
    if m and n and not _skip(t):
        _kernel(kernel)[(triton.cdiv(m, 16), triton.cdiv(n, _RHT_TILE_N))](
            t, *outputs, sign_bits, *_dims(t), *keys, BLOCK_N=_RHT_TILE_N, num_warps=4, **flags
        )


def _rotated_outputs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight-gradient operand's data (N, M padded to 16 / 2) and scale bytes (N, M padded / 16)."""
    m, n = t.shape
    mp = triton.cdiv(m, 16) * 16
    return (
        torch.empty((n, mp // 2), dtype=torch.uint8, device=t.device),
        torch.empty((n, mp // 16), dtype=torch.uint8, device=t.device),
    )


@_operator("lowprec::cast_nvfp4_rht", ())
def cast_nvfp4_rht(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_nvfp4(hadamard.rht(t, seed).t())`` given the tensor encode factor ``s``: data
    (N, M padded to 16 / 2) and E4M3 scale bytes (N, M padded / 16) as uint8, from one read of
    ``t`` (M, N); ``key`` >= 0: stochastic rounding with that stream."""
    _check(t, torch.float8_e4m3fn)
    qt, st = _rotated_outputs(t)
    # the dual kernel's rotated half alone (ROW off: its plain outputs are never written), s at 0
    flags = dict(SOFT_CAST=interpreting(), SR=False, SR_T=key >= 0, ROW=False, RHT=True, S_T=0)
    _launch16(cast_nvfp4_dual_kernel, t, (s, qt, st, qt, st), sign_bits, (0, max(key, 0)), **flags)
    return qt, st


@_operator("lowprec::nvfp4_dual_amax", ())
def nvfp4_dual_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``(max |t|, max |hadamard.rht(t, seed)|)`` as a float32 (2,) tensor (``sign_bits``:
    ``rht_sign_bits(seed)``), one read of ``t``; NaN where the tensor holds one."""
    return _amax_bits(t, sign_bits, (2,))


@_operator("lowprec::cast_nvfp4_dual", ())
def cast_nvfp4_dual(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1, key_t: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both operands of ``t`` (M, N) from one read, given their tensor encode factors ``s`` (float32
    (2,)): ``cast_nvfp4(t, s[0], False, True, False, key)``'s data and scales, and
    ``cast_nvfp4_rht(t, s[1], sign_bits, key_t)``'s (``key`` / ``key_t`` >= 0: stochastic rounding
    with that stream)."""
    _check(t, torch.float8_e4m3fn)
    if s.shape != (2,) or s.dtype != torch.float32:
        raise ValueError(
            f"cast_nvfp4_dual: s holds the two operands' encode factors (float32 (2,)), got {s.dtype} {tuple(s.shape)}"
        )
    s = s.contiguous()
    m, n = t.shape
    np_ = triton.cdiv(n, 16) * 16
    q = torch.empty((m, np_ // 2), dtype=torch.uint8, device=t.device)
    sc = torch.empty((m, np_ // 16), dtype=torch.uint8, device=t.device)
    qt, st = _rotated_outputs(t)
    if m and n and not _skip(t):
        # where the one-pass kernel failed the device check: the plain layout, then the rotated one
        passes = ((True, False), (False, True)) if two_pass("cast_nvfp4_dual", t) else ((True, True),)
        for row, rot in passes:
            flags = dict(SOFT_CAST=interpreting(), SR=key >= 0, SR_T=key_t >= 0, ROW=row, RHT=rot, S_T=1)
            _launch16(cast_nvfp4_dual_kernel, t, (s, q, sc, qt, st), sign_bits, (max(key, 0), max(key_t, 0)), **flags)
    return q, sc, qt, st
