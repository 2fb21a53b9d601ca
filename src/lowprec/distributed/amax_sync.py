"""Amax agreement for delayed scaling: one MAX all-reduce per optimizer step for all layers.

Why: under data parallelism each rank sees other data, so each rank's amax histories (and the
scales built from them) drift apart; the ranks then cast the same weight with different scales
and their FP8 models are no longer replicas. TransformerEngine reduces the amaxes over the
data-parallel group (``DelayedScaling.reduce_amax=True``, ``amax_reduction_group``) in one
fused kernel at the end of the FP8 region; this module does the same once per optimizer step.

What one call does (:func:`reduce_delayed_amaxes`):

1. every delayed :class:`~lowprec.fp8.Float8Linear` contributes the entries of its three
   histories (input, weight, grad_output) recorded since the last call: ``K`` newest entries,
   ``K`` = the forwards (backwards) run since then, capped at the history length (gradient
   accumulation records several per optimizer step);
2. they are stacked into one ``(3 * layers, K)`` float32 tensor and MAX all-reduced: **one
   collective** for the whole model, ``12 * layers * K`` bytes;
3. the reduced entries replace the local ones and each scale is rebuilt from its history
   (``fp8_max / amax / 2**margin``, as :func:`lowprec.fp8.modules.linear.delayed_scale_step` builds it)
   wherever the layer refreshed its scale since the last call (``interval``), so the next step
   casts with the same scale on every rank.

Weights under FSDP2 / ZeRO-3: the forward sees the unsharded (all-gathered) weight, so the
weight amax recorded is already the amax of the whole weight, identical on every rank.

Scope: scales agree from the step after the first optimizer step (step 0 casts with each
rank's own current amax, as an empty history does on one process). Within one gradient-
accumulation window the micro-batches after the first use scales refreshed from local amaxes;
the window's amaxes are all reduced at its optimizer step. The call is collective: every rank
must run it, with the same layers (all layers run each step, TE's rule too).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.cast.scaling import amax_to_scale, history_to_amax

__all__ = ["reduce_delayed_amaxes", "delayed_layers"]

# (operand, the counter that advances when its history records an entry)
_OPERANDS = (("input", "fp8_step"), ("weight", "fp8_step"), ("grad_output", "fp8_step_grad"))
_SYNCED = "_lowprec_amax_synced"  # per layer: the counters at the last reduction (not saved)


def delayed_layers(model: nn.Module) -> list[Float8Linear]:
    return [
        m
        for m in model.modules()
        if isinstance(m, Float8Linear) and m.recipe.kind.keeps_history and hasattr(m, "fp8_amax_history_input")
    ]


def _new_entries(now: int, before: int, length: int) -> int:
    # a counter that went back (a checkpoint was loaded) counts from 0
    return min(now - before if now >= before else now, length)


@torch.no_grad()
def reduce_delayed_amaxes(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> int:
    """MAX-reduce the new amax history entries of every delayed layer over ``group`` in one
    all-reduce and rebuild the scales; returns the number of collectives issued (0 or 1)."""
    layers = delayed_layers(model)
    if not layers or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    # one device-to-host read for all counters (one sync on CUDA, not two per layer)
    counters = [tuple(c) for c in torch.stack([torch.stack([m.fp8_step, m.fp8_step_grad]) for m in layers]).tolist()]
    before = [getattr(m, _SYNCED, (0, 0)) for m in layers]
    k = 0
    for m, now, old in zip(layers, counters, before):
        length = m.fp8_amax_history_input.numel()
        k = max(k, _new_entries(now[0], old[0], length), _new_entries(now[1], old[1], length))
    if k == 0:
        return 0
    hists = [getattr(m, f"fp8_amax_history_{op}") for m in layers for op, _ in _OPERANDS]
    stacked = torch.stack([h[:k] for h in hists])  # (3 * layers, K), newest first
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    for h, reduced in zip(hists, stacked):
        h[:k].copy_(reduced)
    for m, now, old in zip(layers, counters, before):
        _rebuild_scales(m, now, old, k)
        setattr(m, _SYNCED, now)
    return 1


def _rebuild_scales(m: Float8Linear, now: tuple[int, int], old: tuple[int, int], k: int) -> None:
    recipe = m.recipe
    for op, counter in _OPERANDS:
        step_now, step_old = (now[0], old[0]) if counter == "fp8_step" else (now[1], old[1])
        hist = getattr(m, f"fp8_amax_history_{op}")
        # the layer refreshed its scale in this window: an interval boundary was crossed, or the
        # history was empty before the window (delayed_scale_step's two refresh rules)
        crossed = step_now // recipe.interval > step_old // recipe.interval or step_now < step_old
        older = hist[k:]
        refresh = (older.amax() <= 0) if older.numel() else torch.ones((), dtype=torch.bool, device=hist.device)
        refresh = refresh | crossed
        dtype = recipe.fp8_format.backward_dtype if op == "grad_output" else recipe.fp8_format.forward_dtype
        amax = history_to_amax(hist, recipe.amax_compute_algo)
        scale = getattr(m, f"fp8_scale_{op}")
        candidate = amax_to_scale(amax, dtype, margin=recipe.margin, power_of_2=recipe.power_of_2_scales)
        # tensor ops, no host reads; an all-zero history keeps the layer's scale
        scale.copy_(torch.where(refresh & (amax > 0), candidate, scale))
