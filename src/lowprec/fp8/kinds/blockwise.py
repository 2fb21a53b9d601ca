"""Blockwise scaling (DeepSeek-V3): 1x128 tiles along the contraction dim for activations and
gradients, 128x128 blocks for weights, power-of-two scales, E4M3 everywhere.

Square weight blocks would serve both orientations, but the weight is re-cast from the
Parameter in backward (same values: the cast is deterministic), so that backward keeps no FP8
copy per layer (1 byte/param at the memory peak). Grouped experts keep theirs instead: all
experts' weights cast in one pass, both layouts (``BlockCast.experts_both``), for one read of the
float32 weights per step (``modules/grouped_fn.py``). Activations and gradients are cast in 1x128
and 128x1 tiles in one pass where the kernels run (``fp8/cast/block_cast.py``). This module holds the
``block`` granularity's casts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowprec.fp8.gemm import block_triton as block_gemm_triton, grouped_block_triton, grouped_wgrad
from lowprec.fp8.cast.block_cast import cast_block_both, cast_experts_square, quantize_square_transposed
from lowprec.fp8.kinds import base
from lowprec.fp8.modules.grouped_fn import SingleCallGrouped
from lowprec.fp8.modules.linear_fn import Caster, ScaledGemmKind, register_caster
from lowprec.fp8.kinds.plan import GemmCast, OperandCast
from lowprec.fp8.cast.quantize import Float8Data, quantize

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["BlockCast", "Blockwise"]


class BlockCast(Caster):
    """``1 x b`` tiles (``b x 1`` for ``contract=0``), or ``b x b`` blocks for ``block_2d``
    operands (the weight); ``b`` is ``recipe.block_size``."""

    granularity = "block"

    def one(self, t, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
        bs, pow2 = recipe.block_size, recipe.power_of_2_scales
        if spec.block_2d and contract == 0:  # W for grad_input: written transposed on CUDA
            return quantize_square_transposed(t, spec.dtype, bs, pow2)
        block = (bs, bs) if spec.block_2d else ((1, bs) if contract == 1 else (bs, 1))
        return quantize(t, spec.dtype, "block", block=block, power_of_2=pow2)

    def both(self, t, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
        """1x128 and 128x1 tiles, or square blocks and their transpose, in one pass."""
        return cast_block_both(t, spec.dtype, recipe.block_size, recipe.power_of_2_scales, square=spec.block_2d)

    def experts_both(self, w, spec: OperandCast, recipe: Recipe):
        """Square blocks: every expert in one pass (``cast_experts_square``)."""
        if not spec.block_2d:
            return None
        return cast_experts_square(w, spec.dtype, recipe.block_size, recipe.power_of_2_scales)


register_caster(BlockCast())


class Blockwise(SingleCallGrouped, ScaledGemmKind):
    """Tile scaling (see the module docstring). Grouped expert GEMMs: output and grad_input on
    lowprec's Triton blockwise grouped GEMM (one launch each) where it runs, else per expert;
    grad_weight of all experts in one launch of the Triton grouped grad_weight GEMM's block mode
    where that runs."""

    name = "blockwise"

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        tile = lambda dt: OperandCast(dt, "block")  # noqa: E731
        sq = OperandCast(fwd, "block", block_2d=True)
        return GemmCast(tile(fwd), sq), GemmCast(tile(bwd), sq), GemmCast(tile(bwd), tile(fwd))

    def gemm_note(self, recipe: Recipe, device: torch.device) -> str:
        if device.type == "cpu":
            if not recipe.power_of_2_scales:
                return "emulated: block scales that are not powers of two cannot fold exactly into bf16 operands"
            return "bf16 GEMM over exactly upcast FP8 operands on cpu (block scales folded into the operands)"
        if device.type == "cuda":
            return block_gemm_triton.describe_cuda(device, recipe.block_size)
        return f"emulated: no blockwise FP8 GEMM on {device.type}"

    def grouped_kernel_ready(self, device: torch.device) -> bool:
        return grouped_block_triton.ready(device)  # torch has no blockwise grouped kernel

    def grouped_note(self, recipe: Recipe, device: torch.device) -> str:
        if self._grouped_eligible(recipe, False) and grouped_block_triton.may_run(device):  # no kernel runs
            wgrad = f"grad_weight per expert: {self.gemm_note(recipe, device)}"
            if grouped_wgrad.may_run(device) and grouped_wgrad.takes_granularities(recipe.plan.wgrad.casts):
                wgrad = f"grad_weight of all experts in one launch of the {grouped_wgrad.KERNEL} (self-checked at first use)"
            return (
                f"{grouped_block_triton.KERNEL} on {device.type}: the output and grad_input GEMMs of all experts in "
                f"one launch each (self-checked at first use; per expert where the check fails); {wgrad}"
            )
        return base.Kind.grouped_note(self, recipe, device)


base.register(Blockwise())
