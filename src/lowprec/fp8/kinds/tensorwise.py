"""Tensorwise scaling: one scale per tensor, from that tensor's own amax at cast time (torchao's
default). Every operand is E4M3 in the forward GEMM; gradients are E5M2 with ``HYBRID``.

One tensor scale serves both orientations of an operand, so the forward's cast of ``W`` is kept
for grad_input and the cast of ``x`` (its column-major copy) for grad_weight. This module also
holds the ``tensor`` granularity's casts, which delayed scaling and ``rowwise_with_gw_hp`` use too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.gemm.cpu import cpu_gemm_choice
from lowprec.fp8.gemm.dispatch import native_scaled_mm_available
from lowprec.fp8.modules.grouped_fn import SingleCallGrouped
from lowprec.fp8.kinds import base
from lowprec.fp8.modules.linear_fn import Caster, ScaledGemmKind, register_caster
from lowprec.fp8.kinds.plan import GemmCast, OperandCast
from lowprec.fp8.cast.quantize import Float8Data, quantize_tensorwise
from lowprec.fp8.cast.scaling import amax_to_scale

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["TensorCast", "Tensorwise", "fused_cast_ok", "cpu_or_native_note", "UNSATURATED", "FINITE"]

_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# set on a scale handed in (delayed scaling, CPU) when its tensor is finite and no element of it
# times the scale passes the format's max: the cast then skips its inf and clamp passes
UNSATURATED = "_lowprec_unsaturated"
# set where the tensor times the scale holds no inf or NaN (the inf pass is skipped; the clamp stays)
FINITE = "_lowprec_finite"


def fused_cast_ok(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can cast ``t`` in one pass (CUDA, 2-D, a float dtype)."""
    return t.dtype in _HP_DTYPES and t.dim() == 2 and kernels.available(t.device)


class TensorCast(Caster):
    """One scale for the whole tensor; a scale handed in (delayed scaling) is used as it is."""

    granularity = "tensor"

    def one(self, t, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
        return quantize_tensorwise(
            t,
            spec.dtype,
            scale,
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
            finite=getattr(scale, FINITE, False),
            unsaturated=getattr(scale, UNSATURATED, False),
        )

    def both(self, t, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
        """On CUDA with the Triton kernels the FP8 tensor and its transpose in one pass
        (TransformerEngine's cast_transpose); elsewhere one cast serves both orientations."""
        if not fused_cast_ok(t):
            rows = self.one(t, spec, 1, recipe, scale)
            return rows, rows
        pow2 = recipe.power_of_2_scales
        if scale is None:
            scale = amax_to_scale(kernels.amax(t), spec.dtype, margin=recipe.margin, power_of_2=pow2)
        q, qt, _ = kernels.cast_transpose_amax(t, scale, spec.dtype)
        return Float8Data(q, scale, "tensor", None, pow2), Float8Data(qt.t(), scale, "tensor", None, pow2)

    def takes_scale(self) -> bool:
        return True


register_caster(TensorCast())


def cpu_or_native_note(recipe: Recipe, device: torch.device, granularity: str) -> str:
    """The GEMM path of a tensor- or axis-scaled recipe (``torch._scaled_mm`` or the CPU paths)."""
    if device.type == "cpu":
        path = "upcast" if recipe.gemm == "upcast" else cpu_gemm_choice().path
        if path == "upcast":
            return "bf16 GEMM over exactly upcast FP8 operands on cpu (scales on the output)"
        return "torch._scaled_mm on cpu (measured faster than the bf16-upcast GEMM here)"
    if native_scaled_mm_available(device, granularity):
        return f"torch._scaled_mm on {device.type}"
    return f"emulated: torch._scaled_mm cannot run {recipe.scaling} scales on {device}"


class Tensorwise(SingleCallGrouped, ScaledGemmKind):
    """Current per-tensor scaling (see the module docstring)."""

    name = "tensorwise"
    per_tensor = True

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        t = lambda dt: OperandCast(dt, "tensor")  # noqa: E731
        return GemmCast(t(fwd), t(fwd)), GemmCast(t(bwd), t(fwd)), GemmCast(t(bwd), t(fwd))

    def gemm_note(self, recipe: Recipe, device: torch.device) -> str:
        return cpu_or_native_note(recipe, device, "tensor")


base.register(Tensorwise())
