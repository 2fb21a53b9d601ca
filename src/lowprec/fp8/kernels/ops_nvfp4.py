"""The NVFP4 cast operator (``lowprec::cast_nvfp4``) around ``triton_nvfp4`` (imports triton:
load lazily; :mod:`.ops` re-exports it). Registered as the other casts are (``_operator``:
opaque, with a fake that runs the body without launching, so a trace on meta tensors counts its
bytes)."""

from __future__ import annotations

import torch
import triton

from lowprec.fp8.kernels.op_support import _check, _kernel, _operator, _skip, interpreting, two_pass
from lowprec.fp8.kernels.triton_nvfp4 import NV_TILE_M, NV_TILE_N, cast_nvfp4_kernel

__all__ = ["cast_nvfp4"]


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
    dummy, dummy_s = (q, sc) if q is not None else (qt, st)
    _kernel(cast_nvfp4_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, NV_TILE_N))](
        x,
        s,
        dummy if q is None else q,
        dummy_s if q is None else sc,
        dummy if qt is None else qt,
        dummy_s if qt is None else st,
        m,
        n,
        x.stride(0),
        x.stride(1),
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
