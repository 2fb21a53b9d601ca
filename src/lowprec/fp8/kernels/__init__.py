"""Fused FP8 casts: Triton kernels on CUDA, the torch path everywhere else.

    q, q_t, amax = kernels.cast_transpose_amax(x_2d, scale, torch.float8_e4m3fn)

One pass over ``x`` gives the FP8 tensor, its contiguous transpose (for the GEMM contracting
over the other dim) and ``amax(|x|)`` (TransformerEngine's ``cast_transpose``).
``cast_amax`` skips the transpose; ``amax`` is the amax alone (one read, no ``abs()`` tensor);
``cast_rowwise`` computes one scale per row and casts in the same kernel; ``amax_cols`` gives
per-column amaxes, and ``cast_rowwise_dual`` writes both axis casts a rowwise recipe needs (row
scales, and given column scales stored transposed) from one pass; ``cast_cols_t`` the second
alone; ``cast_rowwise_into`` either or both into slices of the caller's buffers (one buffer for
every expert's casts); ``cast_block_1d`` / ``cast_block_2d`` are the blockwise (DeepSeek-V3 tile)
casts, both layouts and the scales from one read; ``cast_mx`` the MXFP8 casts (1 x 32 and 32 x 1 blocks, E8M0
scales) likewise; ``cast_nvfp4`` the NVFP4 casts (1 x 16 blocks, or 16 x 16 tiles with both layouts,
E4M3 scales, given the tensor scale); ``rht_amax`` / ``cast_nvfp4_rht`` the weight-gradient
operands' amax and cast with the random Hadamard transform applied in the kernel;
``nvfp4_dual_amax`` / ``cast_nvfp4_dual`` both NVFP4 operands of one tensor (the plain 1 x 16 one
and the rotated weight-gradient one) from one read per pass. The functions choose at run time (:func:`available`): Triton on CUDA by default when
triton imports and a one-time self-check on the device agrees with the torch path
(:mod:`lowprec.fp8.kernels.selfcheck`; ``LOWPREC_DISABLE_TRITON=1`` always wins), otherwise
:mod:`lowprec.fp8.kernels.reference` (same results; what CPU runs). Importing this package
never imports triton.
"""

from __future__ import annotations

import torch

from lowprec.fp8.kernels import reference
from lowprec.fp8.kernels.classes import INPUT_DTYPES
from lowprec.fp8.kernels.select import DISABLE_ENV, available

# the dispatching form of every torch-path function, by the same name
__all__ = ["available", "DISABLE_ENV", "reference", *reference.__all__]


def _ops():
    from lowprec.fp8.kernels import ops  # imports triton; only reached on CUDA

    return ops


def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale), its transpose (contiguous), amax(|x|))`` for a 2-D ``x``.

    ``scale`` is a float32 scalar tensor on ``x``'s device (read by the kernel, never by the
    host). NaN/inf inputs give NaN outputs; amax is NaN when ``x`` holds a NaN.
    """
    if available(x.device, "cast_transpose_amax", x):
        return _ops().cast_transpose_amax(x, scale, fp8_dtype)
    return reference.cast_transpose_amax(x, scale, fp8_dtype)


def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale), amax(|x|))`` for a 2-D ``x``, in one pass on CUDA."""
    if available(x.device, "cast_amax", x):
        return _ops().cast_amax(x, scale, fp8_dtype)
    return reference.cast_amax(x, scale, fp8_dtype)


def cast_into(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, out: torch.Tensor, transpose: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``saturate(x * scale)`` written into ``out`` (``x``'s shape, contiguous, ``fp8_dtype``:
    a slice of a buffer holding several casts); returns ``(its contiguous transpose where
    transpose, else None; amax(|x|))``, one pass on CUDA (the kernel of
    :func:`cast_transpose_amax`)."""
    if available(x.device, "cast_transpose_amax", x):
        qt, a = _ops().cast_into(x, scale, fp8_dtype, transpose, out.view(torch.uint8))
        return (qt if transpose else None), a
    return reference.cast_into(x, scale, fp8_dtype, out, transpose)


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with one scale per row of a 2-D ``x`` (shape ``(rows, 1)``)."""
    if available(x.device, "cast_rowwise", x):
        return _ops().cast_rowwise(x, fp8_dtype, power_of_2)
    return reference.cast_rowwise(x, fp8_dtype, power_of_2)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a float32 scalar; one read of ``x`` on CUDA (2-D bf16/fp16/fp32 ``x``)."""
    if x.dim() == 2 and x.dtype in INPUT_DTYPES and available(x.device, "amax", x):
        return _ops().amax(x.detach())  # a scale statistic: no gradient, as scaling.amax
    return reference.amax(x)


def amax_cols(x: torch.Tensor) -> torch.Tensor:
    """Per-column ``max |x|`` of a 2-D ``x``, shape ``(1, cols)``; one read on CUDA."""
    if available(x.device, "amax_cols", x):
        return _ops().amax_cols(x.detach())
    return reference.amax_cols(x)


def cast_rowwise_dual(
    x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, row_scale, qt)``: the row-scaled cast and, with ``col_scale`` (1, cols), the
    column-scaled cast as a contiguous (cols, rows) tensor; one pass over ``x`` on CUDA."""
    if available(x.device, "cast_rowwise_dual", x):
        return _ops().cast_rowwise_dual(x, col_scale, fp8_dtype, power_of_2)
    return reference.cast_rowwise_dual(x, col_scale, fp8_dtype, power_of_2)


def cast_cols_t(x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast with per-column scales (1, cols), as a contiguous (cols, rows) tensor."""
    if available(x.device, "cast_cols_t", x):
        return _ops().cast_cols_t(x, col_scale, fp8_dtype)
    return reference.cast_cols_t(x, col_scale, fp8_dtype)


def cast_rowwise_into(
    x: torch.Tensor,
    col_scale: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    power_of_2: bool,
    q: torch.Tensor | None = None,
    qt: torch.Tensor | None = None,
) -> torch.Tensor:
    """The axis casts written into the caller's buffers (contiguous ``fp8_dtype`` tensors: slices
    of one buffer holding several casts): the row-scaled cast of a 2-D ``x`` into ``q`` (``x``'s
    shape) and, with ``col_scale`` (1, cols), the column-scaled one stored transposed into ``qt``
    (cols, rows); either may be None. Returns the row scales (rows, 1) ((0, 1) without ``q``).
    One pass over ``x`` on CUDA; the bits of :func:`cast_rowwise` / :func:`cast_cols_t`."""
    empty = x.new_empty(0, dtype=torch.uint8)
    qb = empty if q is None else q.view(torch.uint8)
    qtb = empty if qt is None else qt.view(torch.uint8)
    cs = x.new_empty(0, dtype=torch.float32) if col_scale is None else col_scale
    if available(x.device, "cast_rowwise_into", x):
        scale = _ops().cast_rowwise_into(x, cs, fp8_dtype, power_of_2, qb, qtb)
    else:
        scale = reference.cast_rowwise_into(x, cs, fp8_dtype, power_of_2, qb, qtb)
    return scale


def recast_if_changed(
    x: torch.Tensor, scale_used: torch.Tensor, scale_cast: torch.Tensor, q: torch.Tensor, qt: torch.Tensor
) -> None:
    """Delayed scaling: re-cast ``x`` into ``q``/``qt`` in place when ``scale_used`` differs
    from ``scale_cast`` (an empty amax history; an empty ``qt``: no transposed copy kept); on
    CUDA a kernel that returns at once otherwise."""
    if available(x.device, "recast_if_changed", x):
        return _ops().recast_if_changed(x, scale_used, scale_cast, q, qt)
    return reference.recast_if_changed(x, scale_used, scale_cast, q, qt)


def delayed_scale_update(history, scale, step, amax_now, fp8_dtype, recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of delayed scaling for one operand (``linear.delayed_scale_step``), the state
    updated in place; returns ``(scale to use now, scale before the update)``. One kernel on CUDA."""
    args = (
        history,
        scale,
        step,
        amax_now,
        fp8_dtype,
        recipe.margin,
        recipe.power_of_2_scales,
        recipe.interval,
        recipe.amax_compute_algo == "max",
    )
    if available(history.device, "delayed_scale_update") and history.dtype == torch.float32 and history.dim() == 1:
        return _ops().delayed_scale_update(*args)
    return reference.delayed_scale_update(*args)


def cast_block_1d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool = True, cols: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, row_scale, qt, col_scale)``: ``x`` (M, N) cast with 1 x ``block`` tiles, scales
    (M, N/block); and cast with ``block`` x 1 tiles, stored transposed as a contiguous (N, M)
    ``qt``, scales (M/block, N). One read of ``x`` on CUDA; unrequested outputs are empty."""
    if available(x.device, "cast_block_1d", x):
        return _ops().cast_block_1d(x, fp8_dtype, block, power_of_2, rows, cols)
    return reference.cast_block_1d(x, fp8_dtype, block, power_of_2, rows, cols)


def cast_block_2d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool = True, cols: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)``: ``x`` cast with ``block`` x ``block`` tiles (``rows``) and
    its contiguous transpose with the same scales (``cols``); one read on CUDA."""
    if available(x.device, "cast_block_2d", x):
        return _ops().cast_block_2d(x, fp8_dtype, block, power_of_2, rows, cols)
    return reference.cast_block_2d(x, fp8_dtype, block, power_of_2, rows, cols)


def cast_mx(
    x: torch.Tensor, fp8_dtype: torch.dtype, rceil: bool, rows: bool = True, cols: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)``: ``quantize_mx(x)``'s data and E8M0 scale bytes (``rows``)
    and ``quantize_mx(x.t())``'s (``cols``); one read on CUDA (``rceil``: the scale rule)."""
    if available(x.device, "cast_mx", x):
        return _ops().cast_mx(x, fp8_dtype, rceil, rows, cols)
    return reference.cast_mx(x, fp8_dtype, rceil, rows, cols)


def cast_nvfp4(
    x: torch.Tensor, s: torch.Tensor, tile2d: bool = False, rows: bool = True, cols: bool = False, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)`` as uint8: ``quantize_nvfp4(x)``'s packed E2M1 data and E4M3
    scale bytes given the tensor encode factor ``s`` (``rows``; ``tile2d``: 16x16 tiles), and
    ``transpose_2d`` of the tiles' (``cols``); ``key`` >= 0 (``nvfp4.sr_key`` of a seed, 1x16
    only): stochastic rounding with that stream. One read on CUDA."""
    if available(x.device, "cast_nvfp4", x):
        return _ops().cast_nvfp4(x, s, tile2d, rows, cols, key)
    return reference.cast_nvfp4(x, s, tile2d, rows, cols, key)


def rht_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``max |hadamard.rht_rows(t, sign_bits)|``, float32; one read of ``t`` on CUDA."""
    if available(t.device, "cast_nvfp4_rht", t):
        return _ops().rht_amax(t, sign_bits)
    return reference.rht_amax(t, sign_bits)


def cast_nvfp4_rht(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_nvfp4(rht_rows(t, sign_bits).t())``'s data and E4M3 scale bytes (uint8) given
    the tensor encode factor ``s`` (``key`` >= 0: stochastic rounding); one read on CUDA."""
    if available(t.device, "cast_nvfp4_rht", t):
        return _ops().cast_nvfp4_rht(t, s, sign_bits, key)
    return reference.cast_nvfp4_rht(t, s, sign_bits, key)


def nvfp4_dual_amax(t: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``(max |t|, max |hadamard.rht_rows(t, sign_bits)|)``, float32 (2,); one read of ``t`` on CUDA."""
    if available(t.device, "cast_nvfp4_dual", t):
        return _ops().nvfp4_dual_amax(t, sign_bits)
    return reference.nvfp4_dual_amax(t, sign_bits)


def cast_nvfp4_dual(
    t: torch.Tensor, s: torch.Tensor, sign_bits: int, key: int = -1, key_t: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, qt, scale_t)`` as uint8: :func:`cast_nvfp4`'s 1x16 cast of ``t`` with the encode
    factor ``s[0]`` (``key`` >= 0: stochastic rounding) and :func:`cast_nvfp4_rht`'s with ``s[1]``
    (``key_t``); one read of ``t`` on CUDA."""
    if available(t.device, "cast_nvfp4_dual", t):
        return _ops().cast_nvfp4_dual(t, s, sign_bits, key, key_t)
    return reference.cast_nvfp4_dual(t, s, sign_bits, key, key_t)
