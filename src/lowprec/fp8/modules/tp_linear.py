"""Float8Linear on tensor-parallel (DTensor) weights: the local FP8 GEMMs and their layouts.

``torch.distributed.tensor.parallel`` shards a Linear's weight by output features (colwise,
``Shard(0)``) or input features (rowwise, ``Shard(1)``) and hands the layer DTensors. The FP8
GEMMs run on the local shards (``Float8LinearFn``, unchanged); this module decides the scales
and the layouts around them:

==========  ===============  =================  =====================================  ==============
style       weight           input              per-tensor scales (tensorwise)         output
==========  ===============  =================  =====================================  ==============
colwise     Shard(0)         Replicate          x: its own amax (same on every rank);  Shard(-1)
                                                W: MAX of the shard amaxes
rowwise     Shard(1)         Shard(-1)          x, W: MAX of the shard amaxes           Partial (sum)
==========  ===============  =================  =====================================  ==============

so the forward casts with exactly the scales one process would use for the whole tensors (one
8-byte MAX all-reduce over the tensor-parallel group per layer and step). Under sequence
parallelism a colwise input may arrive already cast and gathered in FP8
(:mod:`lowprec.distributed.sequence_parallel`): its data is the cast, its scale the whole
input's, and only W's amax is reduced (4 bytes). The input's gradient
of a colwise layer is a partial sum (``Partial``), reduced by DTensor; a rowwise layer's bias
is added on the first rank only, so the partial sums add it once. The gradient of the output
(grad_output) is cast per shard in backward: for colwise it is ``Shard(-1)``, so its scale is the
shard's amax (at least as fine as the whole tensor's; the only numerical difference from one
process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowprec.catalog import check_tensor_parallel
from lowprec.fp8.modules.cast_state import CastState
from lowprec.fp8.modules.gathered import as_float8_data
from lowprec.fp8.modules.linear_fn import Float8LinearFn, FnConfig
from lowprec.fp8.modules.sharding import recast_weight_in_backward
from lowprec.fp8.cast.scaling import amax, amax_to_scale

__all__ = ["is_tensor_parallel", "tp_forward"]


def is_tensor_parallel(weight: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def tp_forward(layer, x: torch.Tensor, recipe, hp: torch.dtype) -> torch.Tensor:
    """``layer``'s forward on a DTensor weight (called from ``Float8Linear.forward``)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w = layer.weight
    mesh = w.device_mesh
    check_tensor_parallel(recipe.name, recipe.scaling, what="a tensor-parallel Float8Linear")
    if w.ndim != 2 or len(w.placements) != 1:
        raise ValueError(
            f"tensor parallel Float8Linear needs a 2-D weight on a 1-D tensor-parallel mesh "
            f"(got placements {w.placements}); shard it with one Colwise/RowwiseParallel style"
        )
    colwise = w.placements[0] == Shard(0)
    if not colwise and w.placements[0] != Shard(1):
        raise ValueError(
            f"tensor parallel Float8Linear: weight placement {w.placements[0]} is neither "
            "Shard(0) (colwise) nor Shard(1) (rowwise)"
        )
    if not isinstance(x, DTensor):  # a layer whose plan left the input plain
        x = DTensor.from_local(x, mesh, [Replicate() if colwise else Shard(-1)], run_check=False)
    # the input gradient of a colwise layer is a partial sum over the output shards
    x_local = x.to_local(grad_placements=[Partial()] if colwise else None)
    w_local = w.to_local()
    fwd = recipe.fp8_format.forward_dtype
    pre = as_float8_data(x_local, recipe.plan.fprop.a.dtype, "tensor")  # an FP8-gathered sequence-parallel input
    # one collective for both amaxes (a colwise input is replicated: the MAX leaves its amax as
    # it is); an input cast before its gather already carries the whole tensor's scale
    amaxes = torch.stack([amax(w_local)] if pre is not None else [amax(x_local), amax(w_local)])
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group())
    scales = amax_to_scale(amaxes, fwd, margin=recipe.margin, power_of_2=recipe.power_of_2_scales)
    x2 = x_local.reshape(-1, x_local.shape[-1])
    state = CastState(layer.fp8_stats if layer.fp8_telemetry else None)
    # whole-tensor scales, handed in
    state.x_scale, state.w_scale = (pre.scale, scales[0]) if pre is not None else (scales[0], scales[1])
    cfg = FnConfig(recipe, hp, recipe.plan, recast_weight=recast_weight_in_backward(layer, w, recipe))  # FSDP2 x TP
    out = Float8LinearFn.apply(x2, w_local, cfg, state)
    out = out.reshape(*x_local.shape[:-1], w_local.shape[0])
    bias = layer.bias
    if colwise:
        if bias is not None:
            out = out + bias.to_local().to(out.dtype)
        return DTensor.from_local(out, mesh, [Shard(-1)], run_check=False)
    if bias is not None:  # Replicate bias, added once to the partial sums: by the first rank. The
        # others add it times 0, so every rank has a (Partial) bias gradient and the optimizer's
        # reduction of it runs on all ranks (a rank without one would skip that collective)
        b = bias.to_local(grad_placements=[Partial()]) if isinstance(bias, DTensor) else bias
        out = out + b.to(out.dtype) * (1.0 if mesh.get_local_rank() == 0 else 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)
