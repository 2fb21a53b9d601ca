"""The row-scaled (``axis``) casts of the grouped expert GEMMs written into one buffer per operand.

Where the fused casts run (CUDA), :class:`~lowprec.fp8.modules.grouped_fn.GroupedScaledFn`
writes every token group's and every expert's axis casts (``rowwise``) into the buffers the
grouped GEMMs read, as the per-tensor recipes do (``grouped_fn._cast_into``):

==========  =====================================  ==========================================
operand     buffer (the grouped GEMM reading it)   the second layout (grad_weight, grad_input)
==========  =====================================  ==========================================
x           (S, K) row-scaled (output)             each group's column-scaled cast, (K, c_g)
W           (E, N, K) row-scaled (output)          (E, K, N) column-scaled: grad_input's
                                                   column-major ``mat_b``, kept for backward
dY          (S, N) row-scaled (grad_input)         each group's column-scaled cast, (N, c_g)
==========  =====================================  ==========================================

Each part is read once for its column amaxes and once for both casts
(``kernels.cast_rowwise_into``): no concatenation of the groups' rows, no stack of the
experts' casts. The weight's grad_input cast is made in the forward from the same read as its
output cast and kept for backward (1 byte per weight element, as the per-tensor recipes keep
their one weight cast; the per-expert loop re-casts each expert's weight from the Parameter in
backward instead: one more read of the float32 weight). The values are those of the per-group
casts (``AxisCast``) bit for bit: the same amaxes, scales and kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.cast.scaling import amax_to_scale
from lowprec.fp8.gemm.capability import is_cuda
from lowprec.fp8.kinds.plan import LinearPlan, OperandCast

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["axis_plan_packs", "cast_axis_parts", "cast_axis_weights", "hp_weight_grads"]


def axis_plan_packs(plan: LinearPlan) -> bool:
    """The output and grad_input GEMMs cast every operand with axis scales, the weight's two
    casts in one dtype (one kernel writes both), and grad_weight reads x's and dY's casts from
    the same pass (``x_dual``, ``dy_dual``: rowwise); or grad_input's weight cast has one tensor
    scale and grad_weight runs in high precision (rowwise_with_gw_hp)."""
    return (plan.axis_fdgrad and plan.x_dual and plan.dy_dual) or (plan.axis_tensor_w and plan.wgrad.high_precision)


def _col_scale(t: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> torch.Tensor:
    """Per-column scales (1, cols) from one read of ``t``: ``quantize_axiswise(dim=0)``'s."""
    return amax_to_scale(kernels.amax_cols(t), dtype, power_of_2=recipe.power_of_2_scales)


def cast_axis_parts(
    parts: Sequence[Optional[torch.Tensor]], spec: OperandCast, recipe: Recipe, transposed: bool = True
) -> tuple[torch.Tensor, list[Optional[Float8Data]], list[Optional[Float8Data]]]:
    """``(buffer, row-scaled casts, column-scaled casts)``: each 2-D part (a token group; None
    for an empty one) cast with one scale per row, its rows written one after another into one
    buffer, and where ``transposed`` with one scale per column, stored transposed (the layout
    grad_weight reads; else None)."""
    live = [t for t in parts if t is not None]
    pow2 = recipe.power_of_2_scales
    buf = torch.empty(sum(t.shape[0] for t in live), live[0].shape[1], dtype=spec.dtype, device=live[0].device)
    casts: list[Optional[Float8Data]] = []
    cols: list[Optional[Float8Data]] = []
    start = 0
    for t in parts:
        if t is None:
            casts.append(None)
            cols.append(None)
            continue
        q = buf[start : start + t.shape[0]]
        if transposed:
            col_scale = _col_scale(t, spec.dtype, recipe)
            qt = torch.empty(t.shape[1], t.shape[0], dtype=spec.dtype, device=t.device)
            row_scale = kernels.cast_rowwise_into(t, col_scale, spec.dtype, pow2, q, qt)
            cols.append(Float8Data(qt.t(), col_scale, "axis", None, pow2))
        else:
            row_scale = kernels.cast_rowwise_into(t, None, spec.dtype, pow2, q)
            cols.append(None)
        casts.append(Float8Data(q, row_scale, "axis", None, pow2))
        start += t.shape[0]
    return buf, casts, cols


def cast_axis_weights(
    weight: torch.Tensor, spec: OperandCast, recipe: Recipe, tensor_dgrad: bool = False
) -> tuple[torch.Tensor, list[Float8Data], torch.Tensor, list[Float8Data]]:
    """``(wbuf, casts, wtbuf, dgrad casts)`` of an (E, N, K) expert weight: each expert's
    row-scaled cast (along K, the output GEMM's) into ``wbuf`` (E, N, K) and its grad_input cast
    (along N: column scales, or where ``tensor_dgrad`` one tensor scale, each column cast with
    it) stored transposed into ``wtbuf`` (E, K, N), both from one read after the amaxes."""
    experts, n, k = weight.shape
    pow2 = recipe.power_of_2_scales
    wbuf = torch.empty(experts, n, k, dtype=spec.dtype, device=weight.device)
    wtbuf = torch.empty(experts, k, n, dtype=spec.dtype, device=weight.device)
    casts: list[Float8Data] = []
    dgrad_casts: list[Float8Data] = []
    for e in range(experts):
        if tensor_dgrad:  # TensorCast's scale
            scale = amax_to_scale(kernels.amax(weight[e]), spec.dtype, margin=recipe.margin, power_of_2=pow2)
            col_scale = scale.expand(1, k).contiguous()
        else:
            col_scale = scale = _col_scale(weight[e], spec.dtype, recipe)
        row_scale = kernels.cast_rowwise_into(weight[e], col_scale, spec.dtype, pow2, wbuf[e], wtbuf[e])
        casts.append(Float8Data(wbuf[e], row_scale, "axis", None, pow2))
        dgrad_casts.append(Float8Data(wtbuf[e].t(), scale, "tensor" if tensor_dgrad else "axis", None, pow2))
    return wbuf, casts, wtbuf, dgrad_casts


def hp_weight_grads(
    dy: torch.Tensor, x: torch.Tensor, counts: Sequence[int], hp: torch.dtype, grad_w: torch.Tensor
) -> None:
    """``grad_w[e] = dY_e^T x_e`` (float32, (E, N, K), written in place; zero for an expert
    without tokens) from high-precision GEMMs in ``hp`` (rowwise_with_gw_hp's grad_weight, as
    its Linear's): on CUDA each GEMM writes its float32 slice itself (``torch.mm``'s
    ``out_dtype``, float32 accumulation not rounded to ``hp``); elsewhere the ``hp`` product is
    copied in, the Linear's numbers bit for bit."""
    start = 0
    for e, n in enumerate(counts):
        if not n:
            grad_w[e].zero_()
            continue
        a, b = dy[start : start + n].t().to(hp), x[start : start + n].to(hp)
        if is_cuda(grad_w.device) and hp in (torch.bfloat16, torch.float16):
            torch.mm(a, b, out_dtype=torch.float32, out=grad_w[e])
        else:
            grad_w[e].copy_(torch.mm(a, b))
        start += n
