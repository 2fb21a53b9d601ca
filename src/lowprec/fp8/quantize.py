"""Scaled casts to FP8 at three granularities, and their inverse.

A quantized operand is a :class:`Float8Data`: FP8 ``data`` plus a float32 ``scale`` with
``data ~= saturate(x * scale)``. The scale's shape says the granularity:

========== ============================== =============================================
tensor     ``()``                         one scale (tensorwise, delayed)
axis       ``(rows, 1)`` or ``(1, cols)`` one scale per slice across the contraction dim
block      ``(ceil(rows/br), ceil(cols/bc))`` one scale per ``br x bc`` tile (DeepSeek-V3)
========== ============================== =============================================

All functions here are pure: no module state, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowprec.fp8 import host_scale
from lowprec.fp8.capability import is_cuda
from lowprec.fp8.formats import fp8_max
from lowprec.fp8.scaling import amax, amax_along, amax_to_scale, block_amax, no_grad_view

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
    # cast feeds two GEMMs (dY in backward); never saved for backward (fp8/saved.py)
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
    return _saturate_(x_scaled.to(torch.float32, copy=True), dtype)


def _saturate_(y: torch.Tensor, dtype: torch.dtype, *, may_hold_inf: bool = True) -> torch.Tensor:
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


def _as_fp32(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` in float32, detached, and whether that is a fresh copy the caller may overwrite."""
    x = no_grad_view(x)
    return (x, False) if x.dtype == torch.float32 else (x.to(torch.float32), True)


def _scaled(x32: torch.Tensor, owned: bool, scale: torch.Tensor) -> torch.Tensor:
    """``x32 * scale`` in float32, in place on a copy we own (one pass fewer)."""
    return x32.mul_(scale) if owned else x32 * scale


# --- dispatch hook: fused Triton casts (lowprec.fp8.kernels) -------------------------------
# On CUDA with triton importable (and LOWPREC_DISABLE_TRITON unset), 2-D tensorwise and
# rowwise casts run as one Triton kernel with bit-identical results; everywhere else the torch
# expressions below run. The import is local: kernels.reference imports this module.
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
    from lowprec.fp8 import kernels

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
        from lowprec.fp8 import kernels

        if scale is None:  # one read, no abs() tensor
            scale = amax_to_scale(kernels.amax(x), dtype, margin=margin, power_of_2=power_of_2)
        return Float8Data(kernels.cast_amax(x, scale, dtype)[0], scale, "tensor", None, power_of_2)
    x32, owned = _as_fp32(x)  # the amax of the float32 copy: one bf16 pass fewer
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
    scaled = _scaled(x32, owned, scale)
    data = scaled.to(dtype) if unsaturated else _saturate_(scaled, dtype, may_hold_inf=given and not finite)
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
        x32, owned = _as_fp32(x)
        return Float8Data(
            _saturate_(_scaled(x32, owned, scale), dtype, may_hold_inf=False), scale, "axis", None, power_of_2
        )
    if _fused_cast(x) and dim in (1, -1):
        from lowprec.fp8 import kernels

        data, scale = kernels.cast_rowwise(x, dtype, power_of_2)
        return Float8Data(data, scale, "axis", None, power_of_2)
    if _fused_cast(x) and dim == 0:  # CUDA: written transposed, the layout a GEMM contracting dim 0 reads
        from lowprec.fp8 import kernels

        if scale is None:
            scale = amax_to_scale(kernels.amax_cols(x), dtype, power_of_2=power_of_2)
        return Float8Data(kernels.cast_cols_t(x, scale, dtype).t(), scale, "axis", None, power_of_2)
    x32, owned = _as_fp32(x)
    scale = amax_to_scale(amax_along(x32, dim), dtype, power_of_2=power_of_2)
    data = _saturate_(_scaled(x32, owned, scale), dtype, may_hold_inf=False)
    return Float8Data(data, scale, "axis", None, power_of_2)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-tile ``scale`` repeated to every element of a ``shape`` tensor (ragged edges cut)."""
    rows, cols = scale.shape
    full = (
        scale.reshape(rows, 1, cols, 1).expand(rows, block[0], cols, block[1]).reshape(rows * block[0], cols * block[1])
    )
    return full[: shape[0], : shape[1]]


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
    (:mod:`lowprec.fp8.block_cast`); a ``(block, 1)`` cast then comes back as a column-major view.
    ``fused=False``: the torch ops below wherever it runs (the definition the fused kernel
    matches; its reference, ``kernels/reference.py``, calls this).
    """
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    if fused and _fused_cast(x):
        from lowprec.fp8 import block_cast

        if block_cast.fusable(block):
            return block_cast.quantize_blockwise_fused(x, dtype, block, power_of_2)
    r, c = x.shape
    br, bc = block
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:  # ragged: zero-pad for the amax, expand the scales to the ragged shape
        xp = torch.nn.functional.pad(x.detach(), (0, pc, 0, pr))
        scale = amax_to_scale(block_amax(xp, block), dtype, power_of_2=power_of_2)
        x32, owned = _as_fp32(x)
        data = _saturate_(_scaled(x32, owned, expand_blocks(scale, block, x.shape)), dtype, may_hold_inf=False)
        return Float8Data(data, scale, "block", (br, bc), power_of_2)
    # whole tiles: the scales broadcast over a tiled view, never expanded to x's size
    x32, owned = _as_fp32(x)
    scale = amax_to_scale(block_amax(x32, block), dtype, power_of_2=power_of_2)
    tiles = x32.reshape(r // br, br, c // bc, bc)
    tile_scale = scale.reshape(r // br, 1, c // bc, 1)
    scaled = tiles.mul_(tile_scale) if owned else tiles * tile_scale
    data = _saturate_(scaled.reshape(r, c), dtype, may_hold_inf=False)
    return Float8Data(data, scale, "block", (br, bc), power_of_2)


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


def dequantize(q: Float8Data, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * (1 / scale)`` in ``dtype`` (float32 arithmetic).

    Multiplying by the reciprocal, not dividing, is what ``torch._scaled_mm`` does with its
    dequantization scales; doing the same here is what makes emulation bit-exact on CPU.
    """
    inv = q.scale.reciprocal()
    if q.granularity == "block":
        inv = expand_blocks(inv, q.tiles, q.data.shape)
    return (q.data.to(torch.float32) * inv).to(dtype)
