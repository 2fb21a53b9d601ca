"""The three GEMMs of a Linear for the block-scaled recipes (``mxfp8``, ``nvfp4``).

``Float8Linear.forward`` hands a layer whose recipe is block-scaled to :func:`mx_linear`. GEMMs
(``x``: input (M, K), ``W``: weight (N, K), ``dY``: grad of output (M, N)); every operand is
quantized along its GEMM's contraction dim, from the high-precision tensor:

============  ===========================  ===========================  ==================
GEMM          A (contract)                 B^T (contract)               output
============  ===========================  ===========================  ==================
output        x (K)                        W (K)                        hp
grad_input    dY (N)                       W^T (N)                      hp
grad_weight   dY^T (M)                     x^T (M)                      float32
============  ===========================  ===========================  ==================

mxfp8: 1x32 E8M0 blocks everywhere; E4M3 elements (E5M2 for dY with ``fp8_format=HYBRID``).
W^T is cast from the Parameter in backward (its blocks run along N, not K: other numbers).
nvfp4: 1x16 blocks; W in 16x16 tiles, so grad_input reads the forward's FP4 weight transposed;
dY rounded stochastically (seeded: ``recipe.seed``, the layer's index, its step); the grad_weight
operands pass through the random Hadamard transform along M first (``hadamard.py``).
``override_linear_precision`` runs a GEMM in hp instead.

What backward keeps: x^T quantized for grad_weight (mxfp8 1 + 1/32 bytes per element, nvfp4
0.5 + 1/16: against 2 for bf16), and the weight: a reference to the Parameter (mxfp8) or the FP4
tiles of the forward (nvfp4, 0.5 + 1/16 bytes per weight element). ``benchmarks/memory.py``
measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.cast.formats import saturation_threshold
from lowprec.fp8.modules.gathered import as_mx_weight
from lowprec.fp8.cast.mx import BlockScaledData, e8m0_decode
from lowprec.fp8.gemm.mx import mx_mm
from lowprec.fp8.modules.saved import save_operands, saved_operands
from lowprec.fp8.modules.sharding import SavedWeight, recast_weight_in_backward

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.recipes import Recipe

__all__ = ["mx_linear", "Codec", "block_stats"]

_NV_SATURATION = 7.0  # E2M1: values up to 6 + half the top step (2) round to 6 anyway


class Codec:
    """How a microscaling kind quantizes (``fp8/kinds/mxfp8.py``, ``nvfp4.py``): every operand
    along its last dim from the high-precision tensor (``seed``: stochastic rounding of dY)."""

    # the forward's quantized weight serves grad_input too (transposed), so backward keeps it
    reuses_weight: ClassVar[bool] = False

    def quantize(self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seed: int | None = None) -> BlockScaledData:
        raise NotImplementedError

    def quantize_weight(self, w: torch.Tensor, recipe: Recipe, dtype: torch.dtype) -> BlockScaledData:
        """The forward GEMM's weight operand, (N, K) along K."""
        return self.quantize(w, recipe, dtype)

    def transpose_weight(self, wq: BlockScaledData) -> BlockScaledData:
        """The forward's weight as grad_input's operand (``reuses_weight`` kinds only)."""
        raise NotImplementedError

    def wgrad_operand(self, t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        """(M, C) -> (C, M) high precision, ready to quantize along M."""
        return t.t()

    def quantize_wgrad(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seed: int | None = None
    ) -> BlockScaledData:
        """The weight-gradient GEMM's operand of ``t`` (M, C): ``quantize(wgrad_operand(t))``
        (a kind may fuse the two)."""
        return self.quantize(self.wgrad_operand(t, recipe), recipe, dtype, seed)

    def quantize_pair(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, both: bool
    ) -> tuple[BlockScaledData, BlockScaledData | None]:
        """``(quantize(t), quantize_wgrad(t))``, the second only where ``both``: an operand's casts
        for its two GEMMs (a kind may make both from one read)."""
        q = self.quantize(t, recipe, dtype)
        return q, (self.quantize_wgrad(t, recipe, dtype) if both else None)

    def quantize_pair_seeded(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seeds: tuple[int | None, int | None]
    ) -> tuple[BlockScaledData, BlockScaledData]:
        """``(quantize(t, seeds[0]), quantize_wgrad(t, seeds[1]))``: dY's casts for grad_input and
        grad_weight, each with its own stochastic-rounding seed (None: round to nearest); a kind
        may make both from one read. Without seeds, :meth:`quantize_pair`'s."""
        if seeds == (None, None):
            q, qt = self.quantize_pair(t, recipe, dtype, True)
            assert qt is not None
            return q, qt
        return self.quantize(t, recipe, dtype, seeds[0]), self.quantize_wgrad(t, recipe, dtype, seeds[1])


@dataclass(frozen=True)
class _MXConfig:
    recipe: Recipe
    codec: Codec
    hp_dtype: torch.dtype
    stats: bool
    seeds: tuple[int, int] | None  # stochastic rounding seeds for dgrad's and wgrad's dY, or None
    recast_weight: bool = False  # keep the weight, not its quantized tiles (fp8/modules/sharding.py)


def _decode_scales(q: BlockScaledData) -> torch.Tensor:
    if q.tensor_scale is None:
        return e8m0_decode(q.scale)
    return q.scale.to(torch.float32) * q.tensor_scale


def block_stats(x: torch.Tensor, q: BlockScaledData) -> torch.Tensor:
    """(amax, smallest encode scale, saturated fraction, underflow fraction) of one cast.

    Judged per block: an element saturated when its magnitude over its own block's decode scale
    is beyond what rounding to the format's max covers (E4M3 464, E5M2 61440, E2M1 7: with
    ``floor`` MX scales or NVFP4's rounded E4M3 scales); underflowed when it is non-zero and
    decodes to 0 (an NVFP4 block whose E4M3 scale rounded to 0 counts whole).
    """
    x32 = x.detach().to(torch.float32)
    dec = _decode_scales(q)
    per_elem = dec.repeat_interleave(q.block, dim=1)[:, : q.cols]
    thr = _NV_SATURATION if q.tensor_scale is not None else saturation_threshold(q.data.dtype)
    ratio = x32.abs() / per_elem
    saturated = (ratio > thr).float().mean()
    underflow = ((x32 != 0) & (q.dequantize() == 0)).float().mean()
    # the largest positive finite decode scale, 0 if none; masked, not indexed (no host sync)
    largest = torch.where(torch.isfinite(dec) & (dec > 0), dec, 0.0).amax()
    smallest = torch.where(largest > 0, largest.reciprocal(), 0.0)
    return torch.stack([x32.abs().amax(), smallest.to(torch.float32), saturated, underflow])


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cfg: _MXConfig, stats):
        recipe, codec, hp = cfg.recipe, cfg.codec, cfg.hp_dtype
        fwd = recipe.fp8_format.forward_dtype
        olp = recipe.override_linear_precision
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch_autocast_off(x.device.type):
            wq = None
            if olp[0]:
                out = torch.matmul(x.to(hp), weight.to(hp).t())
            else:
                # x^T cast along M for grad_weight, from the high-precision x (not from xq)
                x_col_now = need_wgrad and not olp[2] and recipe.save_fp8_activations
                xq, x_col = codec.quantize_pair(x, recipe, fwd, x_col_now)
                wq = as_mx_weight(weight, 1)  # the FSDP2 FP8 all-gather delivered it cast
                if wq is None:
                    wq = codec.quantize_weight(weight, recipe, fwd)
                out = mx_mm(xq, wq, hp, path=recipe.gemm)
                if cfg.stats:
                    stats[0].copy_(block_stats(x, xq))
                    stats[1].copy_(block_stats(weight, wq))
            w_saved: BlockScaledData | SavedWeight | torch.Tensor | None = None
            if need_dgrad:
                # nvfp4: the forward's 16x16 tiles serve grad_input too (one weight both ways)
                w_saved = weight
                if codec.reuses_weight and not olp[1]:
                    w_saved = wq if wq is not None else codec.quantize_weight(weight, recipe, fwd)
                    if cfg.recast_weight:  # FSDP / ZeRO-3: the tiles again in backward
                        w_saved = SavedWeight(weight)
            x_saved = None
            if need_wgrad:
                if olp[2] or not recipe.save_fp8_activations:
                    x_saved = x.to(hp)
                elif olp[0]:  # the forward GEMM in high precision cast nothing: x^T along M now
                    x_saved = codec.quantize_wgrad(x, recipe, fwd)
                else:
                    x_saved = x_col
        save_operands(ctx, (w_saved, x_saved), cfg=cfg, stats=stats, x_dtype=x.dtype, w_dtype=weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dy):
        w_saved, x_saved = saved_operands(ctx)
        cfg = ctx.cfg
        recipe, codec, hp = cfg.recipe, cfg.codec, cfg.hp_dtype
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        olp = recipe.override_linear_precision
        seeds = cfg.seeds or (None, None)
        grad_x = grad_w = None
        first = None
        with torch_autocast_off(dy.device.type):
            dyq = dytq = None
            if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not (olp[1] or olp[2]):
                dyq, dytq = codec.quantize_pair_seeded(dy, recipe, bwd, seeds)  # dY's two casts, one read where it can
            if ctx.needs_input_grad[0]:
                if olp[1]:
                    grad_x = torch.matmul(dy.to(hp), w_saved.to(hp))
                else:
                    dyq = dyq if dyq is not None else codec.quantize(dy, recipe, bwd, seeds[0])
                    first = dyq
                    if isinstance(w_saved, SavedWeight):  # the forward's tiles: a function of the weight
                        wtq = codec.transpose_weight(codec.quantize_weight(w_saved.weight, recipe, fwd))
                    elif isinstance(w_saved, BlockScaledData):
                        wtq = codec.transpose_weight(w_saved)
                    else:  # W^T along N, from the Parameter (or as the FSDP2 FP8 re-gather cast it)
                        wtq = as_mx_weight(w_saved, 0)
                        if wtq is None:
                            wtq = codec.quantize(w_saved.t(), recipe, fwd)
                    grad_x = mx_mm(dyq, wtq, hp, path=recipe.gemm)
                grad_x = grad_x.to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                if olp[2]:
                    grad_w = torch.matmul(dy.t().to(hp), x_saved.to(hp))
                else:
                    if dytq is None:
                        dytq = codec.quantize_wgrad(dy, recipe, bwd, seeds[1])
                    xq = x_saved if isinstance(x_saved, BlockScaledData) else codec.quantize_wgrad(x_saved, recipe, fwd)
                    grad_w = mx_mm(dytq, xq, torch.float32, path=recipe.gemm)
                grad_w = grad_w.to(ctx.w_dtype)
            if cfg.stats and first is not None:
                ctx.stats[2].copy_(block_stats(dy, first))
        return grad_x, grad_w, None, None


def mx_linear(
    module: Float8Linear,
    x2: torch.Tensor,
    recipe: Recipe,
    hp: torch.dtype,
    codec: Codec,
    seeds: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The output of a Float8Linear with a microscaling recipe (bias not added), for 2-D ``x2``."""
    recast = recast_weight_in_backward(module, module.weight, recipe)
    cfg = _MXConfig(recipe, codec, hp, bool(module.fp8_telemetry), seeds, recast)
    return _MXLinearFn.apply(x2, module.gemm_weight(), cfg, module.fp8_stats)
