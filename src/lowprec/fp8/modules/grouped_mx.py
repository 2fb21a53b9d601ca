"""MXFP8's grouped expert GEMMs in one autograd function: every cast read once, every GEMM
writing where its result belongs.

The per-expert loop every kind has (``Kind.grouped_forward``) runs each expert as an MXFP8
Linear: its outputs and input gradients are concatenated, its weight gradients stacked, and
each expert weight is cast twice (along K for the output, along N from the Parameter again in
backward). Here the numbers are the same, bit for bit (the same casts of the same tensors and
the same GEMM path, ``tests/test_fp8_grouped_mx.py``), and what moves around them is what an
ideal implementation moves:

==============  =============================================  ==============================
GEMM, expert e  operands                                       written
==============  =============================================  ==============================
output          x_e along K, W_e along K                       its rows of one (S, N) output
grad_input      dY_e along N, W_e^T along N                    its rows of one (S, K) buffer
grad_weight     dY_e^T along the group's rows, x_e^T likewise  its (N, K) slice of the gradient
==============  =============================================  ==============================

Each operand's two casts come from one read (``Codec.quantize_pair``: on CUDA one
``lowprec::cast_mx`` launch per group gives both layouts and their E8M0 scales): x_e in the
forward (x_e^T kept for grad_weight, 1 + 1/32 bytes per element, as the Linear keeps it), W_e in
the forward (W_e^T kept for grad_input: 1 + 1/32 bytes per weight element until backward, where
the Linear re-reads the float32 Parameter), dY_e in backward. A token group never shares a block
with another expert's tokens: every cast is per group, its blocks along the token dim start at
the group's first row. torch's block-scaled GEMM (sm_100) writes bf16 or float32 straight into
the output's rows and the gradient's slices where a group's rows are whole (multiples of 16);
elsewhere (CPU's exact bf16 upcast, the float32 emulation, a ragged group) each product is
copied in. An expert without tokens runs nothing and its weight gradient is zero.

It runs where the per-expert loop would run every GEMM in FP8 from FP8 activations with no
telemetry rows to fill (:func:`runs`); elsewhere the loop does. Traced bytes:
``benchmarks/grouped_traffic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lowprec.fp8.gemm.mx import mx_mm_into
from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.modules.saved import save_operands, saved_operands

if TYPE_CHECKING:
    from lowprec.fp8.modules.mx_linear import Codec
    from lowprec.fp8.recipes import Recipe

__all__ = ["runs", "grouped_mx_gemms"]


def runs(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, telemetry: bool) -> bool:
    """Whether :func:`grouped_mx_gemms` runs these experts: all three GEMMs in FP8 (no
    ``override_linear_precision``), FP8 activations kept, no telemetry rows, plain tensors (an
    FSDP2 FP8 all-gather's weight takes the loop, which reads its casts)."""
    return (
        not any(recipe.override_linear_precision)
        and recipe.save_fp8_activations
        and not telemetry
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
    )


@dataclass(frozen=True)
class _Config:
    recipe: Recipe
    codec: Codec
    hp_dtype: torch.dtype
    counts: tuple[int, ...]


def _groups(counts: tuple[int, ...]):
    """(expert, first row, rows) of every expert holding tokens."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, n
        start += n


class _GroupedMXFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cfg: _Config):
        recipe, codec = cfg.recipe, cfg.codec
        fwd = recipe.fp8_format.forward_dtype
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts = weight.shape[0]
        x_cols: list = [None] * experts
        w_cols: list = [None] * experts
        with torch_autocast_off(x.device.type):
            x = x.contiguous()
            out = x.new_empty((x.shape[0], weight.shape[1]), dtype=cfg.hp_dtype)
            for e, start, n in _groups(cfg.counts):
                xq, x_cols[e] = codec.quantize_pair(x[start : start + n], recipe, fwd, need_wgrad)
                wq, w_cols[e] = codec.quantize_pair(weight[e], recipe, fwd, need_dgrad)
                mx_mm_into(xq, wq, out[start : start + n], path=recipe.gemm)
        save_operands(ctx, x_cols + w_cols, cfg=cfg, x_dtype=x.dtype, w_dtype=weight.dtype, w_shape=weight.shape)
        return out

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        recipe, codec = cfg.recipe, cfg.codec
        bwd = recipe.fp8_format.backward_dtype
        saved = saved_operands(ctx)
        experts = ctx.w_shape[0]
        x_cols, w_cols = saved[:experts], saved[experts:]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        with torch_autocast_off(dy.device.type):
            dy = dy.contiguous()
            if need_dgrad:
                grad_x = dy.new_empty((dy.shape[0], ctx.w_shape[2]), dtype=cfg.hp_dtype)
            if need_wgrad:
                grad_w = dy.new_empty(ctx.w_shape, dtype=ctx.w_dtype)
                for e, n in enumerate(cfg.counts):
                    if not n:
                        grad_w[e].zero_()
            for e, start, n in _groups(cfg.counts):
                dy_e = dy[start : start + n]
                if need_dgrad:  # dY_e's two casts from one read where both gradients are wanted
                    dyq, dytq = codec.quantize_pair(dy_e, recipe, bwd, need_wgrad)
                    mx_mm_into(dyq, w_cols[e], grad_x[start : start + n], path=recipe.gemm)
                else:
                    dytq = codec.quantize(codec.wgrad_operand(dy_e, recipe), recipe, bwd)
                if need_wgrad:
                    mx_mm_into(dytq, x_cols[e], grad_w[e], path=recipe.gemm)
            if grad_x is not None and grad_x.dtype != ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, grad_w, None


def grouped_mx_gemms(
    x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...], recipe: Recipe, hp: torch.dtype, codec: Codec
) -> torch.Tensor:
    """``(S, N)``: ``x`` (S, K) holds ``counts[e]`` consecutive rows per expert ``e``, each group
    multiplied by ``weight[e].t()`` (``weight`` (E, N, K)), in MXFP8 (see the module docstring)."""
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped GEMM: the group counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    return _GroupedMXFn.apply(x, weight, _Config(recipe, codec, hp, tuple(int(c) for c in counts)))
