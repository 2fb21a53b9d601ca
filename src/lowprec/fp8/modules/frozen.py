"""FP8 casts of a frozen weight (a LoRA base layer, a frozen backbone), made once and reused.

A weight that does not train costs :class:`~lowprec.fp8.modules.linear.Float8Linear` two GEMMs, not
three: autograd asks for no weight gradient, so the weight-gradient GEMM and the FP8 copy of
the input it would read are skipped. Its casts are the same from one forward to the next, so
they are kept on the layer, keyed by the weight's identity and version counter (any in-place
write through autograd-visible ops, ``load_state_dict`` included, bumps it), the recipe and
whether backward wants the dgrad layout: with gradient accumulation over k micro-batches the
weight is cast once, not k times (and not again in an activation-checkpoint recompute).

Only where the forward's cast is also the one grad_input reads (``plan.w_reused``: per-tensor
scales; ``plan.w_square``: 128x128 blocks, which a trained layer re-casts in backward but a
frozen one keeps, both layouts, in the cache): there the cached cast is the tensor backward keeps alive anyway, so
peak memory does not grow on CPU (one cast serves both GEMMs); on CUDA the row-major forward
copy (1 byte per weight) is held as well. Rowwise recipes re-cast the weight along the other
axis in backward; caching both would hold two bytes per weight, so they are not cached.
Delayed scaling is not cached either: its scales come from the amax history, which the layer
keeps updating; nor is anything under ``torch.compile``. Writes through ``.data`` bypass the version counter: call
``Float8Linear.reset_fp8_state()`` after such a write (it drops the cache).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["frozen_weight_cache", "drop_frozen_cache", "CACHE_ATTR"]

CACHE_ATTR = "_fp8_frozen_weight_cast"


def frozen_weight_cache(
    layer: nn.Module, weight: torch.Tensor, recipe: Any, plan: Any, need_dgrad: bool
) -> Optional[Callable[[Callable[[], Any]], Any]]:
    """``None`` when the weight's casts cannot be reused; else ``cached(make)``, which returns
    the stored casts when the key still matches and otherwise stores and returns ``make()``."""
    if weight.requires_grad or recipe.kind.keeps_history or plan.fprop.high_precision:
        return None
    if torch.compiler.is_compiling():  # a Python-side store is no graph op: compiled code casts each call
        return None
    if need_dgrad and not (plan.w_reused or plan.w_square) and not plan.dgrad.high_precision:
        return None  # backward would cast the weight again (rowwise): nothing to gain cheaply
    key = (id(weight), weight._version, weight.data_ptr(), weight.dtype, weight.device, recipe, need_dgrad)

    def cached(make: Callable[[], Any]) -> Any:
        hit = layer.__dict__.get(CACHE_ATTR)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = make()
        layer.__dict__[CACHE_ATTR] = (key, value)
        return value

    return cached


def drop_frozen_cache(layer: nn.Module) -> None:
    layer.__dict__.pop(CACHE_ATTR, None)
