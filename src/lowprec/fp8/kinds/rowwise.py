"""Rowwise scaling: one power-of-two scale per row of each operand, taken across the GEMM's
contraction dim (torchao's ``rowwise``), E4M3 everywhere.

A GEMM contracting over the other dim needs scales along the other axis, so each operand is
cast once per GEMM that reads it: the weight is re-cast from the Parameter in backward (a
reference, no extra memory). ``dgrad_weight_tensorwise`` (torchao's ``rowwise_with_gw_hp``)
casts the weight tensorwise for grad_input instead. This module holds the ``axis`` granularity's
casts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.modules.grouped_fn import SingleCallGrouped
from lowprec.fp8.kinds import base
from lowprec.fp8.modules.linear_fn import Caster, ScaledGemmKind, register_caster
from lowprec.fp8.kinds.tensorwise import cpu_or_native_note, fused_cast_ok
from lowprec.fp8.kinds.plan import GemmCast, OperandCast
from lowprec.fp8.cast.quantize import Float8Data, quantize
from lowprec.fp8.cast.scaling import amax_to_scale

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["AxisCast", "Rowwise"]


class AxisCast(Caster):
    """One scale per slice across the contraction dim: (M, 1) for ``contract=1``, (1, K) for 0."""

    granularity = "axis"

    def one(self, t, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
        return quantize(t, spec.dtype, "axis", dim=contract, power_of_2=recipe.power_of_2_scales)

    def both(self, t, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
        """On CUDA with the Triton kernels the row-scaled cast and the column-scaled one,
        transposed, after one read for the column amaxes; elsewhere two casts."""
        if not fused_cast_ok(t):
            return super().both(t, spec, recipe, scale)
        pow2 = recipe.power_of_2_scales
        col_scale = amax_to_scale(kernels.amax_cols(t), spec.dtype, power_of_2=pow2)
        q, row_scale, qt = kernels.cast_rowwise_dual(t, col_scale, spec.dtype, pow2)
        return Float8Data(q, row_scale, "axis", None, pow2), Float8Data(qt.t(), col_scale, "axis", None, pow2)


register_caster(AxisCast())


class Rowwise(SingleCallGrouped, ScaledGemmKind):
    """Per-row scaling (see the module docstring)."""

    name = "rowwise"
    own_flags = ("dgrad_weight_tensorwise",)

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        ax = lambda dt: OperandCast(dt, "axis")  # noqa: E731
        w_dgrad = OperandCast(fwd, "tensor") if recipe.dgrad_weight_tensorwise else ax(fwd)
        return GemmCast(ax(fwd), ax(fwd)), GemmCast(ax(bwd), w_dgrad), GemmCast(ax(bwd), ax(fwd))

    def gemm_note(self, recipe: Recipe, device: torch.device) -> str:
        return cpu_or_native_note(recipe, device, "axis")


base.register(Rowwise())
