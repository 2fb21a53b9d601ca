"""Fused FP8 casts: Triton kernels on CUDA, the torch path everywhere else.

    q, q_t, amax = kernels.cast_transpose_amax(x_2d, scale, torch.float8_e4m3fn)

One pass over ``x`` gives the FP8 tensor, its contiguous transpose (for the GEMM contracting
over the other dim) and ``amax(|x|)`` (TransformerEngine's ``cast_transpose``). The amax is
meant for the delayed-scaling history; Float8Linear does not feed it back yet (docs/LOG.md).
``cast_amax`` skips the transpose; ``cast_rowwise`` computes one scale per row and casts in the
same kernel. The functions choose at run time (:func:`available`):
Triton on CUDA when triton imports and ``LOWPREC_TRITON_KERNELS=1`` (opt-in until the kernels
have run on a GPU; ``LOWPREC_DISABLE_TRITON=1`` always wins), otherwise
:mod:`lowprec.fp8.kernels.reference` (same results; what CPU and CI run). Importing this
package never imports triton.
"""

from __future__ import annotations

import torch

from lowprec.fp8.kernels import reference
from lowprec.fp8.kernels.select import DISABLE_ENV, available

__all__ = ["available", "DISABLE_ENV", "cast_transpose_amax", "cast_amax", "cast_rowwise", "reference"]


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
    if available(x.device):
        return _ops().cast_transpose_amax(x, scale, fp8_dtype)
    return reference.cast_transpose_amax(x, scale, fp8_dtype)


def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale), amax(|x|))`` for a 2-D ``x``, in one pass on CUDA."""
    if available(x.device):
        return _ops().cast_amax(x, scale, fp8_dtype)
    return reference.cast_amax(x, scale, fp8_dtype)


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with one scale per row of a 2-D ``x`` (shape ``(rows, 1)``)."""
    if available(x.device):
        return _ops().cast_rowwise(x, fp8_dtype, power_of_2)
    return reference.cast_rowwise(x, fp8_dtype, power_of_2)
