"""FP8 casts in torch ops: the definitions, on any device, with no dispatch.

A quantized operand is a :class:`Float8Data`: FP8 ``data`` plus a float32 ``scale`` with
``data ~= saturate(x * scale)``. The scale's shape says the granularity:

========== ============================== =============================================
tensor     ``()``                         one scale (tensorwise, delayed)
axis       ``(rows, 1)`` or ``(1, cols)`` one scale per slice across the contraction dim
block      ``(ceil(rows/br), ceil(cols/bc))`` one scale per ``br x bc`` tile (DeepSeek-V3)
========== ============================== =============================================

:mod:`lowprec.fp8.cast.quantize` casts through the fused Triton kernels where they run and through
these functions elsewhere; the kernels' reference (:mod:`lowprec.fp8.kernels.reference`) is
built from them, so neither the kernels nor the block casts import the dispatching module.
All functions here are pure: no module state, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.cast.scaling import amax_to_scale, block_amax, no_grad_view

__all__ = [
    "Float8Data",
    "GRANULARITIES",
    "saturated_cast",
    "saturate_",
    "as_fp32",
    "scaled_by",
    "expand_blocks",
    "quantize_blockwise_torch",
    "dequantize",
]

GRANULARITIES = ("tensor", "axis", "block")


@dataclass
class Float8Data:
    """FP8 values and the scale that produced them (``x ~= data / scale``).

    ``block`` is the tile shape for block granularity, in the same orientation as ``data``.
    ``pow2_scale`` says the scales were rounded to powers of two (known when casting, so that
    kernels can rely on it without inspecting the scale tensor: the CPU path folds such block
    scales into bf16 operands exactly).
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str = "tensor"
    block: tuple[int, int] | None = None
    pow2_scale: bool = False
    # the exact bf16 upcast of ``data``, made once by the CPU GEMM path and reused when the same
    # cast feeds two GEMMs (dY in backward); never saved for backward (fp8/modules/saved.py)
    bf16_cache: torch.Tensor | None = field(default=None, repr=False, compare=False, metadata={"saved": False})

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def tiles(self) -> tuple[int, int]:
        """``block`` of a block-granularity operand, where it is always set."""
        if self.block is None:
            raise ValueError(f"a {self.granularity}-granularity FP8 tensor has no block shape")
        return self.block

    def t(self) -> "Float8Data":
        """Transposed view (no copy): data, scale and block are all transposed."""
        scale = self.scale if self.scale.dim() == 0 else self.scale.t()
        block = None if self.block is None else (self.block[1], self.block[0])
        cache = None if self.bf16_cache is None else self.bf16_cache.t()
        return Float8Data(self.data.t(), scale, self.granularity, block, self.pow2_scale, cache)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def saturated_cast(x_scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast already-scaled values to FP8, saturating finite values at +-fp8_max.

    ``clamp`` alone would turn +-inf into +-fp8_max (and torch's own E4M3 cast does the
    same), silently making an overflow finite. Mapping +-inf to NaN first (``nan_to_num`` with
    NaN for every non-finite value) keeps every non-finite input non-finite; NaN survives
    ``clamp``. Two in-place passes over a float32 temporary, fused by ``torch.compile``.
    """
    return saturate_(x_scaled.to(torch.float32, copy=True), dtype)


def saturate_(y: torch.Tensor, dtype: torch.dtype, *, may_hold_inf: bool = True) -> torch.Tensor:
    """``saturated_cast`` on a float32 temporary the caller owns (modified in place).

    ``may_hold_inf=False`` skips the inf -> NaN pass where it cannot change anything: when the
    scale was computed from this tensor's own amax, an inf anywhere made the scale 0 (``inf *
    0 = NaN``) and finite values times ``fp8_max / amax`` stay finite (scaling.py).
    """
    m = fp8_max(dtype)
    if may_hold_inf:
        nan = float("nan")
        torch.nan_to_num_(y, nan=nan, posinf=nan, neginf=nan)
    return y.clamp_(-m, m).to(dtype)


def as_fp32(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` in float32, detached, and whether that is a fresh copy the caller may overwrite."""
    x = no_grad_view(x)
    return (x, False) if x.dtype == torch.float32 else (x.to(torch.float32), True)


def scaled_by(x32: torch.Tensor, owned: bool, scale: torch.Tensor) -> torch.Tensor:
    """``x32 * scale`` in float32, in place on a copy we own (one pass fewer)."""
    return x32.mul_(scale) if owned else x32 * scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-tile ``scale`` repeated to every element of a ``shape`` tensor (ragged edges cut)."""
    rows, cols = scale.shape
    full = (
        scale.reshape(rows, 1, cols, 1).expand(rows, block[0], cols, block[1]).reshape(rows * block[0], cols * block[1])
    )
    return full[: shape[0], : shape[1]]


def quantize_blockwise_torch(
    x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], power_of_2: bool = True
) -> Float8Data:
    """``quantize.quantize_blockwise`` in torch ops (the definition the fused kernel matches).

    Ragged edges are handled by zero padding for the amax only; zeros never raise an amax."""
    r, c = x.shape
    br, bc = block
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:  # ragged: zero-pad for the amax, expand the scales to the ragged shape
        xp = torch.nn.functional.pad(x.detach(), (0, pc, 0, pr))
        scale = amax_to_scale(block_amax(xp, block), dtype, power_of_2=power_of_2)
        x32, owned = as_fp32(x)
        data = saturate_(scaled_by(x32, owned, expand_blocks(scale, block, x.shape)), dtype, may_hold_inf=False)
        return Float8Data(data, scale, "block", (br, bc), power_of_2)
    # whole tiles: the scales broadcast over a tiled view, never expanded to x's size
    x32, owned = as_fp32(x)
    scale = amax_to_scale(block_amax(x32, block), dtype, power_of_2=power_of_2)
    tiles = x32.reshape(r // br, br, c // bc, bc)
    tile_scale = scale.reshape(r // br, 1, c // bc, 1)
    scaled = tiles.mul_(tile_scale) if owned else tiles * tile_scale
    data = saturate_(scaled.reshape(r, c), dtype, may_hold_inf=False)
    return Float8Data(data, scale, "block", (br, bc), power_of_2)


def dequantize(q: Float8Data, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * (1 / scale)`` in ``dtype`` (float32 arithmetic).

    Multiplying by the reciprocal, not dividing, is what ``torch._scaled_mm`` does with its
    dequantization scales; doing the same here is what makes emulation bit-exact on CPU.
    """
    inv = q.scale.reciprocal()
    if q.granularity == "block":
        inv = expand_blocks(inv, q.tiles, q.data.shape)
    return (q.data.to(torch.float32) * inv).to(dtype)
