"""MXFP8 (OCP MX v1.0): E4M3 elements (E5M2 gradients with ``HYBRID``), one E8M0 power-of-two
scale per 32 elements along each GEMM's contraction dim, every operand cast from its
high-precision source for each GEMM orientation (TransformerEngine's ``MXFP8BlockScaling``).

The GEMMs are those of ``fp8/modules/mx_linear.py`` with this module's :class:`MXCodec`; the E8M0 rule
(``scale_rounding``) and the casts are in ``fp8/cast/mx.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.kinds import base
from lowprec.fp8.cast.mx import E8M0, MX_BLOCK, BlockScaledData, quantize_mx
from lowprec.fp8.gemm.mx import native_block_scaled_available
from lowprec.fp8.modules import grouped_mx
from lowprec.fp8.modules.mx_linear import Codec, mx_linear
from lowprec.fp8.modules.sharding import recast_weight_in_backward
from lowprec.fp8.kinds.plan import GemmCast, OperandCast

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.cast.quantize import Float8Data
    from lowprec.fp8.recipes import Recipe

__all__ = ["MXCodec", "Microscaled", "MXFP8"]


def cast_mx(t: torch.Tensor, dtype: torch.dtype, rounding: str) -> BlockScaledData:
    """``quantize_mx(t, dtype, rounding)``, bit for bit; on CUDA one Triton kernel
    (``kernels.cast_mx``, where its first-use check passed), reading a transposed view (the
    operands of the backward GEMMs, ``x.t()``, ``dY.t()``, ``W.t()``) as the column cast of the
    contiguous tensor under it, with no copy."""
    if t.dim() != 2 or not kernels.available(t.device, "cast_mx", t.t() if t.stride(0) == 1 else t):
        return quantize_mx(t, dtype, rounding)
    rceil = rounding == "rceil"
    src = t.detach()
    if src.stride(0) == 1 and src.stride(1) != 1:  # a transposed view: its base's column cast
        _, _, q, s = kernels.cast_mx(src.t(), dtype, rceil, rows=False, cols=True)
    else:
        q, s, _, _ = kernels.cast_mx(src, dtype, rceil, rows=True, cols=False)
    return BlockScaledData(q, s.view(E8M0), t.shape[1], MX_BLOCK)


class MXCodec(Codec):
    def quantize(self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seed: int | None = None) -> BlockScaledData:
        return cast_mx(t, dtype, recipe.scale_rounding)

    def quantize_pair(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, both: bool
    ) -> tuple[BlockScaledData, BlockScaledData | None]:
        """On CUDA both casts of ``t`` (1 x 32 along its rows, 32 x 1 for ``t.t()``) from one read."""
        if not both or t.dim() != 2 or not kernels.available(t.device, "cast_mx", t):
            return super().quantize_pair(t, recipe, dtype, both)
        q, s, qt, st = kernels.cast_mx(t.detach(), dtype, recipe.scale_rounding == "rceil", rows=True, cols=True)
        return BlockScaledData(q, s.view(E8M0), t.shape[1], MX_BLOCK), BlockScaledData(
            qt, st.view(E8M0), t.shape[0], MX_BLOCK
        )


class Microscaled(base.Kind):
    """What the microscaling kinds share: their GEMMs (``mx_linear``) and their report line."""

    codec: ClassVar[Codec]
    # the dtype of its casts that torch.compile's CPU code generator lacks (compile_break)
    packed_dtype: ClassVar[str] = "torch.float8_e8m0fnu"
    # how the CPU path folds the scales, for the conversion report
    cpu_scales: ClassVar[str] = "block scales folded in"

    def forward(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe, hp: torch.dtype) -> torch.Tensor:
        return mx_linear(layer, x2, recipe, hp, self.codec)

    def forward_weight_cast(self, layer: Float8Linear, recipe: Recipe) -> Float8Data | BlockScaledData:
        """The forward GEMM's weight operand, (out, in) along ``in``: ``codec.quantize_weight``,
        as ``mx_linear`` calls it (MXFP8 1x32; NVFP4 16x16 tiles)."""
        if recipe.override_linear_precision[0]:
            return super().forward_weight_cast(layer, recipe)  # the refusal: the forward GEMM is hp
        with torch.no_grad():
            return self.codec.quantize_weight(layer.gemm_weight(), recipe, recipe.fp8_format.forward_dtype)

    def grouped_forward(self, call: base.GroupedCall) -> torch.Tensor:
        """All experts in one autograd function (``fp8/modules/grouped_mx.py``: each cast read
        once, every GEMM writing its rows or slice in place) where it runs; else the loop."""
        recipe, x, weight = call.recipe, call.x, call.weight
        if grouped_mx.runs(recipe, x, weight, call.gemm.fp8_telemetry, self.codec):
            seeds = self.grouped_seeds(call)
            recast = recast_weight_in_backward(call.gemm, weight, recipe)
            return grouped_mx.grouped_mx_gemms(x, weight, call.counts, recipe, call.hp, self.codec, seeds, recast)
        return super().grouped_forward(call)

    def grouped_seeds(self, call: base.GroupedCall) -> list[tuple[int, int] | None] | None:
        """Each expert's stochastic-rounding seeds for dY's two casts, as its ``forward`` takes
        them (None: round to nearest)."""
        return None

    def grouped_note(self, recipe: Recipe, device: torch.device) -> str:
        return (
            "all experts in one autograd function, each operand's casts from one read, each GEMM per expert "
            f"writing its rows or gradient slice in place: {self.gemm_note(recipe, device)} (the per-expert "
            "loop with telemetry or override_linear_precision)"
        )

    def compile_break(self, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None
        return (
            f"{self.name} on {device.type}: its casts hold {self.packed_dtype} tensors, which inductor's "
            f"{device.type} code generator has no type for"
        )

    def gemm_note(self, recipe: Recipe, device: torch.device) -> str:
        if native_block_scaled_available(device):
            return f"torch block-scaled scaled_mm on {device.type} ({recipe.scaling}, swizzled scales)"
        if device.type == "cpu":  # the CPU path by design, as the bf16 upcast is for the other recipes
            return f"bf16 GEMM over exact bf16 {recipe.scaling} operands on cpu ({self.cpu_scales}; mx_gemm.py)"
        why = f"exact {recipe.scaling} dequantization + float32 matmul on {device.type}"
        return f"emulated: {why} (torch's block-scaled scaled_mm needs CUDA sm_100+)"


class MXFP8(Microscaled):
    name = "mxfp8"
    codec = MXCodec()

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        mx = lambda dt: OperandCast(dt, "mx32")  # noqa: E731  1x32 along each GEMM's contraction dim
        return GemmCast(mx(fwd), mx(fwd)), GemmCast(mx(bwd), mx(fwd)), GemmCast(mx(bwd), mx(fwd))

    def describe_operand(self, o: OperandCast) -> str:
        return f"{str(o.dtype).replace('torch.float8_', '')}/1x32"


base.register(MXFP8())
