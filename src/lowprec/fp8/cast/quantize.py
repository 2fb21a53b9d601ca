"""Scaled casts to FP8 at three granularities, and their inverse: the fused Triton kernels on
CUDA where they run, the torch definitions (:mod:`lowprec.fp8.cast.torch_casts`) elsewhere, with the
same bits. :class:`Float8Data` and the granularities are described there.

All functions here are pure: no module state, no host synchronisation.
"""

from __future__ import annotations

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.cast import block_cast, host_scale
from lowprec.fp8.gemm.capability import is_cuda
from lowprec.fp8.cast.scaling import amax, amax_along, amax_to_scale
from lowprec.fp8.cast.torch_casts import (
    GRANULARITIES,
    Float8Data,
    as_fp32,
    saturate_,
    scaled_by,
    dequantize,
    expand_blocks,
    quantize_blockwise_torch,
    saturated_cast,
)

__all__ = [
    "Float8Data",
    "saturated_cast",
    "quantize",
    "quantize_tensorwise",
    "quantize_axiswise",
    "quantize_blockwise",
    "dequantize",
    "expand_blocks",
]


# --- dispatch hook: fused Triton casts (lowprec.fp8.kernels) -------------------------------
# On CUDA with triton importable (and LOWPREC_DISABLE_TRITON unset), 2-D tensorwise and
# rowwise casts run as one Triton kernel with bit-identical results; everywhere else the torch
# expressions below run.
def _fused_cast(x: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    if not is_cuda(x.device) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if scale is not None and not (
        isinstance(scale, torch.Tensor)
        and scale.dim() == 0
        and scale.dtype == torch.float32
        and scale.device == x.device
    ):
        return False
    return kernels.available(x.device)


# -------------------------------------------------------------------------------------------
def quantize_tensorwise(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    *,
    margin: int = 0,
    power_of_2: bool = False,
    finite: bool = False,
    unsaturated: bool = False,
) -> Float8Data:
    """One scale for the whole tensor; computed from ``amax(x)`` unless ``scale`` is given
    (delayed scaling passes the scale derived from its amax history). What the caller knows of a
    scale handed in (delayed scaling on CPU reads the amax) lets the cast skip passes that change
    no bit: ``finite``, ``x * scale`` holds no inf or NaN (no inf -> NaN pass); ``unsaturated``,
    moreover ``|x| * scale <= fp8_max`` (no clamp either)."""
    given = scale is not None
    if _fused_cast(x, scale):
        if scale is None:  # one read, no abs() tensor
            scale = amax_to_scale(kernels.amax(x), dtype, margin=margin, power_of_2=power_of_2)
        return Float8Data(kernels.cast_amax(x, scale, dtype)[0], scale, "tensor", None, power_of_2)
    x32, owned = as_fp32(x)  # the amax of the float32 copy: one bf16 pass fewer
    if scale is None and host_scale.applies(x32, power_of_2):  # CPU: the scale in Python floats
        value = host_scale.scale_value(host_scale.amax_value(x32), dtype, margin)
        scale = torch.tensor(value, dtype=torch.float32)
        # No clamp pass: with a scale from this tensor's own amax, |x * scale| <= fp8_max times
        # (1 + a few float32 ulps), which torch's round-to-nearest FP8 cast takes to fp8_max
        # (it saturates to NaN only from fp8_max + half a step), so the clamp changes no bit.
        data = (x32.mul_(value) if owned else x32 * value).to(dtype)
        return Float8Data(data, scale, "tensor", None, power_of_2)
    if scale is None:
        scale = amax_to_scale(amax(x32), dtype, margin=margin, power_of_2=power_of_2)
    scaled = scaled_by(x32, owned, scale)
    data = scaled.to(dtype) if unsaturated else saturate_(scaled, dtype, may_hold_inf=given and not finite)
    return Float8Data(data, scale, "tensor", None, power_of_2)


def quantize_axiswise(
    x: torch.Tensor,
    dtype: torch.dtype,
    dim: int,
    *,
    power_of_2: bool = True,
    scale: torch.Tensor | None = None,
) -> Float8Data:
    """One scale per slice along ``dim`` (the GEMM's contraction dim).

    For ``x`` of shape (M, K) and ``dim=1`` this is torchao's "rowwise": scale shape (M, 1).
    ``scale``: the slices' scales, computed elsewhere from amaxes that include ``x``'s (the FSDP2
    FP8 all-gather casts a shard with the whole weight's column scales); the same cast otherwise.
    """
    if scale is not None and not (_fused_cast(x) and dim == 0):
        x32, owned = as_fp32(x)
        return Float8Data(
            saturate_(scaled_by(x32, owned, scale), dtype, may_hold_inf=False), scale, "axis", None, power_of_2
        )
    if _fused_cast(x) and dim in (1, -1):
        data, scale = kernels.cast_rowwise(x, dtype, power_of_2)
        return Float8Data(data, scale, "axis", None, power_of_2)
    if _fused_cast(x) and dim == 0:  # CUDA: written transposed, the layout a GEMM contracting dim 0 reads
        if scale is None:
            scale = amax_to_scale(kernels.amax_cols(x), dtype, power_of_2=power_of_2)
        return Float8Data(kernels.cast_cols_t(x, scale, dtype).t(), scale, "axis", None, power_of_2)
    x32, owned = as_fp32(x)
    scale = amax_to_scale(amax_along(x32, dim), dtype, power_of_2=power_of_2)
    data = saturate_(scaled_by(x32, owned, scale), dtype, may_hold_inf=False)
    return Float8Data(data, scale, "axis", None, power_of_2)


def quantize_blockwise(
    x: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int],
    *,
    power_of_2: bool = True,
    fused: bool = True,
) -> Float8Data:
    """One scale per ``block`` tile of a 2-D tensor (1x128 activations, 128x128 weights).

    Ragged edges are handled by zero padding for the amax only; zeros never raise an amax.
    On CUDA with the Triton kernels one fused pass computes the same values
    (:mod:`lowprec.fp8.cast.block_cast`); a ``(block, 1)`` cast then comes back as a column-major view.
    ``fused=False``: the torch ops below wherever it runs (the definition the fused kernel
    matches; its reference, ``kernels/reference.py``, calls this).
    """
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    if fused and _fused_cast(x) and block_cast.fusable(block):
        return block_cast.quantize_blockwise_fused(x, dtype, block, power_of_2)
    return quantize_blockwise_torch(x, dtype, block, power_of_2)


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    *,
    dim: int = -1,
    block: tuple[int, int] = (1, 128),
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
) -> Float8Data:
    """Dispatch on granularity: ``tensor`` (``scale`` may be given), ``axis`` (over
    ``dim``), ``block`` (``block`` tiles)."""
    if granularity == "tensor":
        return quantize_tensorwise(x, dtype, scale, margin=margin, power_of_2=power_of_2)
    if granularity == "axis":
        return quantize_axiswise(x, dtype, dim, power_of_2=power_of_2)
    if granularity == "block":
        return quantize_blockwise(x, dtype, block, power_of_2=power_of_2)
    raise ValueError(f"granularity={granularity!r}; use one of {GRANULARITIES}")
