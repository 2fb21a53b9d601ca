"""The torch path of the fused casts: the same results, built from the engine's own pieces.

These functions *define* what the Triton kernels must produce (bit for bit: same float32
product ``x * scale``, same saturation rule, round-to-nearest-even to FP8) and are what runs
on CPU, without triton, or with ``LOWPREC_DISABLE_TRITON=1``. Under ``torch.compile`` Inductor
fuses each of them into one or two generated kernels of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from lowprec.fp8.cast.mx import quantize_mx
from lowprec.fp8.cast.hadamard import rht_rows
from lowprec.fp8.cast.nvfp4 import SRKey, quantize_nvfp4, quantize_nvfp4_2d, transpose_2d
from lowprec.fp8.cast.torch_casts import quantize_blockwise_torch, saturated_cast
from lowprec.fp8.cast.scaling import amax, amax_along, amax_to_scale, delayed_scale_step


__all__ = [
    "cast_transpose_amax",
    "cast_amax",
    "cast_into",
    "cast_rowwise",
    "amax",
    "amax_cols",
    "cast_rowwise_dual",
    "cast_cols_t",
    "cast_rowwise_into",
    "recast_if_changed",
    "delayed_scale_update",
    "cast_block_1d",
    "cast_block_2d",
    "cast_mx",
    "cast_nvfp4",
    "rht_amax",
    "cast_nvfp4_rht",
    "nvfp4_dual_amax",
    "cast_nvfp4_dual",
]


def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale) in fp8_dtype, amax(|x|))``; amax is NaN when x holds a NaN."""
    q = saturated_cast(x.to(torch.float32) * scale, fp8_dtype)
    return q, amax(x)


def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_amax` plus a contiguous copy of the transposed FP8 tensor (for the GEMM
    that contracts over the other dim: Hopper's FP8 GEMM is TN-only)."""
    q, a = cast_amax(x, scale, fp8_dtype)
    return q, q.t().contiguous(), a


def cast_into(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, out: torch.Tensor, transpose: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`cast_amax` written into ``out`` (a slice of a buffer holding several casts):
    returns ``(the contiguous transpose where transpose, else None; amax(|x|))``."""
    q, a = cast_amax(x, scale, fp8_dtype)
    out.copy_(q)
    return (q.t().contiguous() if transpose else None), a


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row from the row's amax (``quantize_axiswise(x, dtype, dim=1)``):
    returns ``(q, scale)`` with scale of shape ``(rows, 1)``."""
    scale = amax_to_scale(amax_along(x, 1), fp8_dtype, power_of_2=power_of_2)
    return saturated_cast(x.to(torch.float32) * scale, fp8_dtype), scale


def amax_cols(x: torch.Tensor) -> torch.Tensor:
    """Per-column ``max |x|``: ``amax_along(x, 0)``, shape ``(1, cols)``."""
    return amax_along(x, 0)


def cast_cols_t(x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast with per-column scales ``(1, cols)``, as a contiguous ``(cols, rows)`` tensor."""
    return saturated_cast(x.to(torch.float32) * col_scale, fp8_dtype).t().contiguous()


def cast_rowwise_dual(
    x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_rowwise` and :func:`cast_cols_t` together: ``(q, row_scale, qt)``."""
    q, scale = cast_rowwise(x, fp8_dtype, power_of_2)
    return q, scale, cast_cols_t(x, col_scale, fp8_dtype)


def cast_rowwise_into(
    x: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype, pow2: bool, out: torch.Tensor, out_t: torch.Tensor
) -> torch.Tensor:
    """:func:`cast_rowwise` written into ``out`` and :func:`cast_cols_t` into ``out_t`` (caller's
    buffers, slices of larger ones; an empty one is not written); returns the row scales
    ((0, 1) where ``out`` is empty)."""
    scale = torch.empty((0, 1), dtype=torch.float32, device=x.device)
    if out.numel():
        rq, scale = cast_rowwise(x, dtype, pow2)
        out.view(torch.uint8).copy_(rq.view(torch.uint8))
    if out_t.numel():
        out_t.view(torch.uint8).copy_(cast_cols_t(x, cols, dtype).view(torch.uint8))
    return scale


def recast_if_changed(
    x: torch.Tensor, scale_used: torch.Tensor, scale_cast: torch.Tensor, q: torch.Tensor, qt: torch.Tensor
) -> None:
    """Where ``scale_used != scale_cast`` (NaN included), overwrite ``q`` and ``qt`` (its
    contiguous transpose; an empty ``qt``: none kept) with ``x`` cast at ``scale_used``; else
    leave them (in place)."""
    redo = scale_used != scale_cast
    new = saturated_cast(x.to(torch.float32) * scale_used, q.dtype).view(torch.uint8)
    q.view(torch.uint8).copy_(torch.where(redo, new, q.view(torch.uint8)))
    if qt.numel() == q.numel():
        qt.view(torch.uint8).copy_(torch.where(redo, new.t(), qt.view(torch.uint8)))


def delayed_scale_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    amax_now: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    power_of_2: bool,
    interval: int,
    algo_max: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scaling.delayed_scale_step`` with the state written back in place; returns
    ``(scale to use now, scale before the update)`` (the definition the kernel must match)."""
    from types import SimpleNamespace

    recipe: Any = SimpleNamespace(
        power_of_2_scales=power_of_2,
        margin=margin,
        interval=interval,
        amax_compute_algo="max" if algo_max else "most_recent",
    )  # the fields it reads
    old = scale.clone()
    used, new_hist, new_scale = delayed_scale_step(history, scale, step, amax_now, fp8_dtype, recipe)
    history.copy_(new_hist)
    scale.copy_(new_scale)
    return used, old


def cast_block_1d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, row_scale, qt, col_scale)``: ``x`` cast with 1 x block tiles (``rows``) and with
    block x 1 tiles stored transposed, contiguous (``cols``); empty tensors for what is not asked."""

    none = torch.empty(0, dtype=fp8_dtype, device=x.device), torch.empty(0, device=x.device)
    r = quantize_blockwise_torch(x, fp8_dtype, (1, block), power_of_2) if rows else None
    c = quantize_blockwise_torch(x, fp8_dtype, (block, 1), power_of_2) if cols else None
    q, rs = (r.data, r.scale) if r is not None else none
    qt, cs = (c.data.t().contiguous(), c.scale) if c is not None else none
    return q, rs, qt, cs


def cast_block_2d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)``: ``x`` cast with block x block tiles (``rows``), its
    transpose (contiguous) with the same scales as ``scale_t`` (``cols``); empty where not asked."""

    b = quantize_blockwise_torch(x, fp8_dtype, (block, block), power_of_2)
    empty = torch.empty(0, dtype=fp8_dtype, device=x.device), torch.empty(0, device=x.device)
    q = b.data if rows else empty[0]
    qt, st = (b.data.t().contiguous(), b.scale) if cols else empty
    return q, b.scale, qt, st


def cast_mx(
    x: torch.Tensor, fp8_dtype: torch.dtype, rceil: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)``: ``quantize_mx(x)`` (``rows``) and ``quantize_mx(x.t())``
    (``cols``), data and E8M0 scale bytes (uint8); empty tensors for what is not asked."""
    rounding = "rceil" if rceil else "floor"
    none = torch.empty(0, dtype=fp8_dtype, device=x.device), torch.empty(0, dtype=torch.uint8, device=x.device)
    r = quantize_mx(x, fp8_dtype, rounding) if rows else None
    c = quantize_mx(x.t(), fp8_dtype, rounding) if cols else None
    q, s = (r.data, r.scale.view(torch.uint8)) if r is not None else none
    qt, st = (c.data, c.scale.view(torch.uint8)) if c is not None else none
    return q, s, qt, st


def cast_nvfp4(
    x: torch.Tensor, s: torch.Tensor, tile2d: bool, rows: bool, cols: bool, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)`` as uint8: ``quantize_nvfp4(x)`` (or ``quantize_nvfp4_2d`` with
    ``tile2d``) with the tensor encode factor ``s`` (``rows``), and ``transpose_2d`` of the 2-D
    one (``cols``); empty tensors for what is not asked. ``key`` >= 0: stochastic rounding with
    the stream of that key (1x16 only)."""
    if cols and not tile2d:
        raise ValueError("cast_nvfp4: the transposed layout is the 16x16 tiles' (tile2d=True)")
    if key >= 0 and tile2d:
        raise ValueError("cast_nvfp4: stochastic rounding is for 1x16 blocks (tile2d=False)")
    scales = (s, s.reciprocal())
    sr = SRKey(key) if key >= 0 else None
    q = quantize_nvfp4_2d(x, scales=scales) if tile2d else quantize_nvfp4(x, sr, scales=scales)
    empty = torch.empty(0, dtype=torch.uint8, device=x.device)
    t = transpose_2d(q) if cols else None
    out = (q.data.view(torch.uint8), q.scale.view(torch.uint8)) if rows else (empty, empty)
    out_t = (t.data.view(torch.uint8), t.scale.view(torch.uint8)) if t is not None else (empty, empty)
    return (*out, *out_t)


def rht_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``max |rht(t)|`` (the random Hadamard transform with the signs ``sign_bits``), float32."""
    return amax(rht_rows(t, sign_bits))


def cast_nvfp4_rht(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_nvfp4(rht(t).t())`` given the tensor encode factor ``s`` (``key`` >= 0:
    stochastic rounding with that stream): data and E4M3 scale bytes as uint8."""
    q = quantize_nvfp4(rht_rows(t, sign_bits).t(), SRKey(key) if key >= 0 else None, scales=(s, s.reciprocal()))
    return q.data.view(torch.uint8), q.scale.view(torch.uint8)


def nvfp4_dual_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``(amax(t), rht_amax(t, sign_bits))`` as a float32 (2,) tensor."""
    return torch.stack([amax(t), rht_amax(t, sign_bits)])


def cast_nvfp4_dual(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1, key_t: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both operands of ``t`` given their tensor encode factors ``s`` (2,): the 1x16 cast
    ``cast_nvfp4(t, s[0], ..., key)``'s data and scales, then ``cast_nvfp4_rht(t, s[1], sign_bits,
    key_t)``'s."""
    q, sc, _, _ = cast_nvfp4(t, s[0], False, True, False, key)
    return (q, sc, *cast_nvfp4_rht(t, s[1], sign_bits, key_t))
