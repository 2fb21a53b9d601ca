"""The block-scaled kinds' grouped expert GEMMs (MXFP8, NVFP4) in one autograd function: every
cast read once, every GEMM writing where its result belongs.

The per-expert loop every kind has (``Kind.grouped_forward``) runs each expert as a block-scaled
Linear (``mx_linear``): its outputs and input gradients are concatenated and its weight gradients
stacked (MXFP8 also casts each expert weight twice: along K for the output, along N from the
Parameter again in backward). Here the numbers are the same, bit for bit (the same casts of the
same tensors in the same order, NVFP4's stochastic-rounding streams advanced per expert as the
loop advances them, the same GEMM path: ``tests/test_fp8_grouped_mx.py``), and what moves around
them is what an ideal implementation moves:

==============  =============================================  ==============================
GEMM, expert e  operands                                       written
==============  =============================================  ==============================
output          x_e along K, W_e along K                       its rows of one (S, N) output
grad_input      dY_e along N, W_e^T along N                    its rows of one (S, K) buffer
grad_weight     dY_e^T along the group's rows, x_e^T likewise  its (N, K) slice of the gradient
==============  =============================================  ==============================

Each operand's casts are the codec's (``Codec.quantize_pair``, ``quantize_pair_seeded`` for dY_e
with its two rounding seeds: on CUDA one read per pass gives both of x_e's, and both of dY_e's;
NVFP4's weight-gradient operands go through the random Hadamard transform as the codec's
``quantize_wgrad`` does). x_e^T is kept for grad_weight, as the Linear keeps it. grad_input's weight: MXFP8 casts W_e^T in the same
read as W_e and keeps it (1 + 1/32 bytes per weight element until backward, where the Linear
re-reads the float32 Parameter); NVFP4 keeps the forward's 16x16 tiles, as the Linear does. Where
FSDP or ZeRO-3 shards the weight (``sharding.recast_weight_in_backward``), backward keeps a
reference instead and casts again, as the Linear does. A token group never shares a block with
another expert's tokens: every cast is per group, its blocks along the token dim start at the
group's first row. torch's block-scaled GEMM (sm_100) writes bf16 or float32 straight into the
output's rows and the gradient's slices where a group's rows are whole (multiples of 16);
elsewhere (CPU's exact bf16 upcast, the float32 emulation, a ragged group) each product is copied
in. An expert without tokens runs nothing and its weight gradient is zero.

It runs where the per-expert loop would run every GEMM block-scaled from quantized activations
with no telemetry rows to fill (:func:`runs`); elsewhere the loop does. Traced bytes:
``benchmarks/grouped_traffic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lowprec.fp8.gemm.mx import mx_mm_into
from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.modules.mx_linear import Codec
from lowprec.fp8.modules.saved import save_operands, saved_operands

if TYPE_CHECKING:
    from lowprec.fp8.cast.mx import BlockScaledData
    from lowprec.fp8.recipes import Recipe

__all__ = ["runs", "grouped_mx_gemms", "expert_groups"]


def runs(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, telemetry: bool, codec: Codec) -> bool:
    """Whether :func:`grouped_mx_gemms` runs these experts: all three GEMMs in block-scaled
    formats (no ``override_linear_precision``), quantized activations kept, no telemetry rows,
    plain tensors (an FSDP2 FP8 all-gather's weight takes the loop, which reads its casts), and a
    codec whose grad_input weight is either the forward's tiles (NVFP4) or W^T cast as it is
    (MXFP8: ``quantize_pair`` of the weight gives both layouts)."""
    return (
        not any(recipe.override_linear_precision)
        and recipe.save_fp8_activations
        and not telemetry
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and (codec.reuses_weight or type(codec).wgrad_operand is Codec.wgrad_operand)
    )


@dataclass(frozen=True)
class _Config:
    recipe: Recipe
    codec: Codec
    hp_dtype: torch.dtype
    counts: tuple[int, ...]
    seeds: Optional[tuple[Optional[tuple[int, int]], ...]]  # per expert: dY's stochastic-rounding seeds
    recast: bool  # keep the weight, not its casts (FSDP / ZeRO-3 sharding: fp8/modules/sharding.py)


def expert_groups(counts: tuple[int, ...]):
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
        keep_w = need_dgrad and not cfg.recast
        experts = weight.shape[0]
        x_cols: list = [None] * experts
        w_kept: list = [None] * experts
        with torch_autocast_off(x.device.type):
            x = x.contiguous()
            out = x.new_empty((x.shape[0], weight.shape[1]), dtype=cfg.hp_dtype)
            for e, start, n in expert_groups(cfg.counts):
                xq, x_cols[e] = codec.quantize_pair(x[start : start + n], recipe, fwd, need_wgrad)
                if codec.reuses_weight:  # NVFP4: the forward's 16x16 tiles serve grad_input transposed
                    wq = codec.quantize_weight(weight[e], recipe, fwd)
                    w_kept[e] = wq if keep_w else None
                else:  # MXFP8: W_e along K and W_e^T along N from one read
                    wq, w_kept[e] = codec.quantize_pair(weight[e], recipe, fwd, keep_w)
                mx_mm_into(xq, wq, out[start : start + n], path=recipe.gemm)
        kept_weight = weight if need_dgrad and cfg.recast else None  # a reference, cast again in backward
        save_operands(
            ctx, [*x_cols, *w_kept, kept_weight], cfg=cfg, x_dtype=x.dtype, w_dtype=weight.dtype, w_shape=weight.shape
        )
        return out

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        recipe, codec = cfg.recipe, cfg.codec
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        saved = saved_operands(ctx)
        experts = ctx.w_shape[0]
        x_cols, w_kept, weight = saved[:experts], saved[experts : 2 * experts], saved[-1]
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
            for e, start, n in expert_groups(cfg.counts):
                s_dgrad, s_wgrad = (cfg.seeds[e] or (None, None)) if cfg.seeds else (None, None)
                dy_e, dytq = dy[start : start + n], None
                if need_dgrad:
                    if need_wgrad:  # both casts, each with its own seed, from one read where the codec can
                        dyq, dytq = codec.quantize_pair_seeded(dy_e, recipe, bwd, (s_dgrad, s_wgrad))
                    else:
                        dyq = codec.quantize(dy_e, recipe, bwd, s_dgrad)
                    mx_mm_into(
                        dyq,
                        _weight_t(codec, recipe, fwd, w_kept[e], weight, e),
                        grad_x[start : start + n],
                        path=recipe.gemm,
                    )
                if need_wgrad:
                    if dytq is None:
                        dytq = codec.quantize_wgrad(dy_e, recipe, bwd, s_wgrad)
                    mx_mm_into(dytq, x_cols[e], grad_w[e], path=recipe.gemm)
            if grad_x is not None and grad_x.dtype != ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, grad_w, None


def _weight_t(codec: Codec, recipe: Recipe, fwd: torch.dtype, kept: Any, weight: Any, e: int) -> BlockScaledData:
    """grad_input's weight operand of expert ``e``, W_e^T along N: the forward's (kept), or cast
    again from the weight (``recast``) as the forward cast it."""
    if codec.reuses_weight:
        return codec.transpose_weight(kept if kept is not None else codec.quantize_weight(weight[e], recipe, fwd))
    return kept if kept is not None else codec.quantize(weight[e].t(), recipe, fwd)


def grouped_mx_gemms(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: tuple[int, ...],
    recipe: Recipe,
    hp: torch.dtype,
    codec: Codec,
    seeds: Optional[list[Optional[tuple[int, int]]]] = None,
    recast: bool = False,
) -> torch.Tensor:
    """``(S, N)``: ``x`` (S, K) holds ``counts[e]`` consecutive rows per expert ``e``, each group
    multiplied by ``weight[e].t()`` (``weight`` (E, N, K)), block-scaled (see the module
    docstring). ``seeds``: each expert's stochastic-rounding seeds for dY (NVFP4); ``recast``:
    backward casts each expert's W^T again from the weight instead of keeping it."""
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped GEMM: the group counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    cfg = _Config(recipe, codec, hp, tuple(int(c) for c in counts), tuple(seeds) if seeds else None, recast)
    return _GroupedMXFn.apply(x, weight, cfg)
