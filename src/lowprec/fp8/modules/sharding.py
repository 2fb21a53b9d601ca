"""What an FP8 Linear keeps for backward when FSDP or DeepSpeed ZeRO-3 shards its weight.

FSDP2 (``fully_shard(reshard_after_forward=True)``) gathers a unit's weights before its forward,
frees them after it and gathers them again for backward; ZeRO-3 does the same with its
partitions. A plain ``nn.Linear`` keeps a *reference* to the gathered weight for backward, whose
storage the wrapper frees: nothing stays. An FP8 Linear whose forward cast also serves
grad_input (per-tensor recipes: one scale serves both orientations; nvfp4: 16x16 tiles serve
both) would keep that cast instead, a fresh tensor the wrapper does not know: 1 byte (nvfp4 0.5)
per element of the *whole* weight, on every rank, from forward to backward; summed over the
model it does not fall with the number of ranks (6 of 6 layers held).

So where the weight is sharded, backward keeps :class:`SavedWeight`: the reference and the
forward's per-tensor scale, and re-casts the re-gathered weight with that scale. The cast is
elementwise and deterministic, so the re-cast is bit-identical to the forward's (delayed
scaling included: its scale came from the amax history, not from the weight, which is why it is
kept); nvfp4's tiles are a function of the weight alone. Cost: one cast of the weight per layer
in backward. The Recipe field ``force_recompute_fp8_weight_in_bwd`` (torchao's and Accelerate's
name) chooses: ``None`` (auto) re-casts where the weight is sharded, ``True`` always, ``False``
never (the FP8 copy is kept). Recipes that cast the weight along the other axis for grad_input
(rowwise, blockwise, mxfp8) re-cast it from the reference in backward anyway.

Sharded means (:func:`weight_sharded`), decided by the wrapper when it wraps, read per call as
one attribute: FSDP (``fully_shard``, and FSDP1 with ``use_orig_params``) marks every module it
manages with ``_is_fsdp_managed_module`` (the flag torch.compile reads for the same question);
ZeRO-3 gives each partitioned Parameter a ``ds_id``.

Also here: :func:`reshape_output`, which gives a Linear's output its leading dims without making
it a view (FSDP2 warns about a view returned by a unit: an in-place op on it would drop the
pre-backward hook that re-gathers the weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

__all__ = ["SavedWeight", "weight_sharded", "recast_weight_in_backward", "reshape_output", "EP_LOCAL"]

# set on a grouped GEMM module whose experts expert parallelism sharded: each rank holds its own
# experts whole, which FSDP2 leaves alone (its ignored parameters) though it marks the module
EP_LOCAL = "_lowprec_ep_local"

logger = logging.getLogger("lowprec")
_LOGGED: set[str] = set()


@dataclass
class SavedWeight:
    """What backward keeps of the weight instead of its FP8 cast: the (gathered) weight itself,
    which the sharding wrapper frees after forward and gathers again for backward, and the
    forward's per-tensor scale (``None`` where the cast's scales are a function of the weight)."""

    weight: torch.Tensor
    scale: Optional[torch.Tensor] = None


def weight_sharded(layer: torch.nn.Module, weight: torch.Tensor) -> Optional[str]:
    """Why ``weight`` is freed between forward and backward, or ``None`` when it is not. An
    expert's slot (``grouped.ExpertSlot``) is sharded as its grouped GEMM module is."""
    layer = layer.__dict__.get("_owner", layer)
    if layer.__dict__.get(EP_LOCAL, False):  # FSDP ignores expert-parallel weights: never freed
        return None
    if layer.__dict__.get("_is_fsdp_managed_module", False):  # set by fully_shard on every module it manages
        return "FSDP manages the layer"
    if getattr(weight, "ds_id", None) is not None:  # a ZeRO-3 partitioned Parameter
        return "DeepSpeed ZeRO-3 partitions the weight"
    return None


def recast_weight_in_backward(layer: torch.nn.Module, weight: torch.Tensor, recipe: Any) -> bool:
    """Whether backward re-casts the weight instead of keeping the forward's FP8 cast (the
    recipe's ``force_recompute_fp8_weight_in_bwd``; ``None``: where the weight is sharded). The
    first auto decision of each kind is logged with its reason."""
    force = recipe.force_recompute_fp8_weight_in_bwd
    if force is not None:
        return force
    why = weight_sharded(layer, weight)
    if why is None:
        return False
    if why not in _LOGGED and not torch.compiler.is_compiling():  # a log call would break the graph
        _LOGGED.add(why)
        logger.info(
            "lowprec: force_recompute_fp8_weight_in_bwd=auto: %s, so backward keeps a reference to the "
            "weight and the forward's scale and re-casts it (bit-identical), not an FP8 copy of the whole "
            "weight; set it to false to keep the copy (1 byte per weight element held from forward to backward)",
            why,
        )
    return True


def reshape_output(out: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``out.reshape(shape)`` that is never a view: the same values in the same memory (copied
    only where ``out`` is not contiguous), with no ``_base``, as ``torch.matmul`` returns a 3-D
    product (``_unsafe_view``; its gradient is reshaped back)."""
    return torch.ops.aten._unsafe_view(out.contiguous(), shape)
