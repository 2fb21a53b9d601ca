"""FSDP2 FP8 all-gather for tensorwise, delayed, rowwise, blockwise and mxfp8 scaling (the native engine's
counterpart of torchao's ``enable_fsdp_float8_all_gather`` + ``precompute_float8_dynamic_scale_for_fsdp``,
and of TransformerEngine's FP8 weight gather for ``DelayedScaling``).

FSDP2 all-gathers each weight before its forward. With :func:`enable_fsdp_float8_all_gather`
the weight of every tensorwise, delayed, rowwise, blockwise or mxfp8 :class:`~lowprec.fp8.Float8Linear` becomes a
:class:`Float8AllGatherWeight` (a wrapper around the high-precision tensor) whose FSDP2
extension hooks move FP8 instead of bf16:

* ``fsdp_pre_all_gather``: each rank casts its shard (first rounded to FSDP2's ``param_dtype``,
  as FSDP2 itself would) to FP8 with the weight's scale and hands FSDP2 the bytes: 1 byte per
  element on the wire instead of 2 (bf16) or 4 (fp32);
* ``fsdp_post_all_gather``: the gathered bytes become a
  :class:`~lowprec.fp8.modules.gathered.Float8GatheredWeight`, which the FP8 GEMM takes as its weight
  cast (no second cast).

Every rank needs the same scale before the gather, and both kinds build it from the amax of the
*whole* weight: :func:`precompute_float8_scales_for_fsdp`, run after each optimizer step (the
native backend's ``after_optimizer_step``), computes the shard amaxes of all weights and reduces
them in **one** MAX all-reduce (``4 bytes x layers``), instead of one collective per layer in the
next forward. A shard changed since (the first step, a checkpoint load, a manual edit) falls back
to one all-reduce for that weight inside the hook, logged once.

* tensorwise: ``amax_to_scale(whole amax)``, the recipe's own scale (same amax of the
  bf16-rounded weight).
* delayed (:class:`DelayedWeightScale`): the scale the layer's forward would take from its
  weight history, step counter and the whole amax (``scaling.delayed_scale_step``), computed in
  the hook without touching the state; the gathered weight carries the whole amax and the
  forward records it in the history and casts with the payload's scale. A re-gather during
  backward (FSDP2 resharded after forward, an activation-checkpoint recompute) uses the
  forward's scale. The weight history holds whole-weight amaxes, the same on every rank.

The FP8 cast is elementwise, so a run with the FP8 all-gather computes the same GEMMs as one
without it: losses agree bitwise (tests/test_distributed_fp8.py, every kind).

Interaction with the rest:

* rowwise (``_rowwise_inputs``): FSDP2 shards rows, and a row's scale is its own amax, so in
  forward each rank casts its rows and the per-row scales travel with the bytes (4 bytes per row:
  0.1% more at K=4096). grad_input reads the weight scaled per column, across every rank's rows:
  the re-gather for backward (FSDP2 resharded after forward) casts each shard with the whole
  weight's column scales (one MAX all-reduce of K amaxes). ``rowwise_with_gw_hp`` gathers its
  tensorwise grad_input cast the same way. If FSDP2 kept the forward's gathered weight
  (``reshard_after_forward=False``), grad_input re-casts it from the row-scaled FP8 values, one
  rounding more than without the FP8 all-gather (logged once).
* blockwise (``_block_inputs``): the weight's square tiles serve both GEMMs that read it, so each
  rank casts its rows in those tiles (no collective) and the tile scales travel with the bytes;
  every rank's rows must be whole tiles (rows / ranks a multiple of ``block_size``, 128), or the
  first gather stops with one line naming the fix.
* mxfp8 (``_mx_inputs``): forward, each rank casts its rows in 32-element blocks along K; the
  re-gather for backward casts W^T, blocks of 32 along N, which stay inside a rank's rows when
  those are a multiple of 32 (no collective either way). Both travel in W's layout with their
  E8M0 scales (1 byte per 32 elements), so both gathers have the same inputs;
  ``fp8/gathered.as_mx_weight`` hands the GEMMs views of the gathered buffers. Shards whose rows
  or columns are not multiples of 32 stop at the first gather with one line.
* nvfp4 is refused by the Accelerator/trainer with the fix in the message (its per-tensor scale
  and stochastically rounded 16x16 tiles are not built for it).
* Delayed on CUDA: a gathered weight takes the eager scale update (an amax read per operand),
  not the fused one-pass casts, which read the high-precision weight.
* O1 / O2 (MS-AMP opt levels) under FSDP2: O2's FP8AdamW steps the DTensor shards with the
  one-process scales (``lowprec.optim.sharded``); the optimizer steps the high-precision shard
  inside the wrapper, as any torch optimizer does. With O1/O2 the gradient reduce-scatter is FP8
  too (``fsdp_fp8_reduce_scatter.py``, installed by ``lowprec.optim.apply_opt_level``); without
  an opt level FSDP2 reduce-scatters in its ``reduce_dtype`` (fp32).
* Activation checkpointing: the recompute runs the layer's forward again on the FSDP2-unsharded
  weight (FP8 bytes still resident, or re-gathered with the same precomputed scale when FSDP2
  resharded after forward), so the recomputed GEMM uses the same FP8 weight as the first.
* Outside the FP8 region (eval without ``use_during_eval``) the layer sees the dequantized FP8
  weight, as with torchao's FP8 all-gather.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from lowprec.logs import log_once
from lowprec.catalog import check_fsdp_fp8_all_gather
from lowprec.fp8.modules.gathered import Float8GatheredWeight
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.cast.mx import MX_BLOCK
from lowprec.fp8.kinds.mxfp8 import cast_mx
from lowprec.fp8.cast.quantize import quantize_axiswise, quantize_blockwise, quantize_tensorwise
from lowprec.fp8.cast.scaling import amax, amax_along, amax_to_scale, delayed_scale_step

__all__ = [
    "DelayedWeightScale",
    "Float8AllGatherWeight",
    "enable_fsdp_float8_all_gather",
    "precompute_float8_scales_for_fsdp",
    "CountingAllGather",
    "install_counting_all_gather",
]


# FSDP2 pads, slices, copies and moves the sharded tensor: those keep the wrapper (torchao's
# list); anything else (optimizer math, amax) runs on the plain high-precision tensor
_KEEP = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (``_tensor``) that FSDP2 all-gathers in FP8 (see module doc)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, *args: Any, **kwargs: Any):  # the rest: __init__'s
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(
        self,
        tensor: torch.Tensor,
        fp8_dtype: torch.dtype,
        margin: int = 0,
        pow2: bool = False,
        delayed: Optional["DelayedWeightScale"] = None,
        rowwise: Optional[str] = None,
        block: Optional[int] = None,
        mx_rounding: Optional[str] = None,
    ):
        self._tensor = tensor
        self._fp8_dtype = fp8_dtype
        self._margin = margin
        self._pow2 = pow2
        self._delayed = delayed  # the layer's delayed-scaling state; None: tensorwise
        # rowwise kinds: the granularity of the grad_input GEMM's weight cast ("axis", or
        # "tensor" for rowwise_with_gw_hp); None: a per-tensor kind
        self._rowwise = rowwise
        self._block = block  # blockwise: the weight's square tile size; None otherwise
        self._mx_rounding = mx_rounding  # mxfp8: the recipe's E8M0 scale rounding; None otherwise
        self._param_dtype: Optional[torch.dtype] = None  # FSDP2's, learnt at the first all-gather
        # (amax of the whole weight rounded to param_dtype, _tensor._version it was taken at)
        self._precomputed: Optional[tuple[torch.Tensor, int]] = None

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]  # torch's stub
        return f"Float8AllGatherWeight({self._tensor!r}, fp8={self._fp8_dtype})"

    def _meta(self) -> tuple:
        return (self._fp8_dtype, self._margin, self._pow2, self._delayed, self._rowwise, self._block, self._mx_rounding)

    def __tensor_flatten__(self):
        return ["_tensor"], self._meta()

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_tensor"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        meta = next(a._meta() for a in args if isinstance(a, Float8AllGatherWeight))
        args, kwargs = tree_map_only(Float8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return tree_map_only(torch.Tensor, lambda t: Float8AllGatherWeight(t, *meta), out)

    # ---------------------------------------------------------------- FSDP2 extension hooks
    def _rounded(self) -> torch.Tensor:
        # the values FSDP2 would gather: the shard in param_dtype
        dt = self._param_dtype
        return self._tensor if dt is None or dt == self._tensor.dtype else self._tensor.to(dt)

    def _whole_amax(self, mesh: Any) -> torch.Tensor:
        """The amax of the whole weight (rounded to ``param_dtype``): precomputed after the last
        optimizer step, or one all-reduce now."""
        pre = self._precomputed
        if pre is not None and pre[1] == self._tensor._version:
            return pre[0]
        why = "first step" if pre is None else "the weight changed after its amax was precomputed"
        log_once(f"lowprec: FSDP2 FP8 all-gather: one amax all-reduce per weight ({why})", logging.INFO)
        a = amax(self._rounded()).reshape(1)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return a[0]

    def _scale_and_amax(self, mesh: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self._delayed is None:  # tensorwise: from this weight's amax
            a = self._whole_amax(mesh)
            return amax_to_scale(a, self._fp8_dtype, margin=self._margin, power_of_2=self._pow2), None
        if _in_backward():  # a re-gather for backward: the forward's scale
            return self._delayed.forward_scale(), None
        a = self._whole_amax(mesh)
        return self._delayed.scale_for(a), a

    def _rowwise_inputs(self, mesh: Any) -> tuple[tuple, tuple]:
        """Rowwise: forward, each row cast with its own scale (the shard holds whole rows: no
        collective), the row scales gathered with the bytes; backward, the cast grad_input reads,
        with the whole weight's column scales (one MAX all-reduce of K amaxes) or, for
        ``rowwise_with_gw_hp``, its tensor scale. Two inputs every time (FSDP2 keeps the output
        buffers): in backward the second is a placeholder and the scale travels as metadata."""
        rounded = self._rounded()
        if not _in_backward():
            q = quantize_axiswise(rounded, self._fp8_dtype, 1, power_of_2=self._pow2)
            return (q.data.contiguous().view(torch.uint8), q.scale), ("axis", 1, None)
        placeholder = torch.zeros(rounded.shape[0], 1, dtype=torch.float32, device=rounded.device)
        if self._rowwise == "tensor":
            scale = amax_to_scale(self._whole_amax(mesh), self._fp8_dtype, power_of_2=self._pow2)
            q = quantize_tensorwise(rounded, self._fp8_dtype, scale, power_of_2=self._pow2)
            return (q.data.contiguous().view(torch.uint8), placeholder), ("tensor", None, q.scale)
        cols = amax_along(rounded, 0)
        dist.all_reduce(cols, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = amax_to_scale(cols, self._fp8_dtype, power_of_2=self._pow2)
        q = quantize_axiswise(rounded, self._fp8_dtype, 0, power_of_2=self._pow2, scale=scale)
        return (q.data.contiguous().view(torch.uint8), placeholder), ("axis", 0, scale)

    def _block_inputs(self, mesh: Any) -> tuple[tuple, tuple]:
        """Blockwise: the shard cast in the weight's square tiles (forward and backward read the
        same cast), the tile scales gathered with the bytes. A tile must not straddle two ranks'
        rows, so each rank's rows must be whole tiles."""
        rounded = self._rounded()
        bs = cast(int, self._block)
        if rounded.shape[0] % bs:
            raise ValueError(
                f"fp8_enable_fsdp_float8_all_gather with blockwise scaling: each of the {mesh.size()} ranks "
                f"holds {rounded.shape[0]} rows of a weight, not a multiple of its {bs}x{bs} tiles; use a "
                f"number of processes that splits every weight into whole tiles, or drop "
                "fp8_enable_fsdp_float8_all_gather"
            )
        q = quantize_blockwise(rounded, self._fp8_dtype, (bs, bs), power_of_2=self._pow2)
        return (q.data.contiguous().view(torch.uint8), q.scale.contiguous()), ("block", None, None)

    def _mx_inputs(self, mesh: Any) -> tuple[tuple, tuple]:
        """MXFP8: forward, the rows cast in 32-element blocks along K (a shard holds whole rows);
        backward, W^T's cast, blocks of 32 along N, which stay inside a rank's rows when they are
        a multiple of 32. Both travel in W's layout, the E8M0 scales as (rows, K / 32) bytes, so
        the two gathers have the same inputs (FSDP2 keeps the buffers)."""
        rounded = self._rounded()
        rows, cols = rounded.shape
        if rows % MX_BLOCK or cols % MX_BLOCK:
            raise ValueError(
                f"fp8_enable_fsdp_float8_all_gather with mxfp8: each of the {mesh.size()} ranks holds a "
                f"{rows} x {cols} shard of a weight; both must be multiples of the {MX_BLOCK}-element blocks; "
                "use a number of processes that splits every weight so, or drop fp8_enable_fsdp_float8_all_gather"
            )
        rounding = cast(str, self._mx_rounding)
        if not _in_backward():
            q = cast_mx(rounded, self._fp8_dtype, rounding)  # quantize_mx; on CUDA one kernel
            return (q.data.view(torch.uint8), q.scale.view(torch.uint8)), ("mx", 1, None)
        q = cast_mx(rounded.t(), self._fp8_dtype, rounding)  # (K, rows): blocks along N, read in place
        data = q.data.t().contiguous().view(torch.uint8)
        scale = q.scale.view(torch.uint8).t().contiguous().reshape(rows, cols // MX_BLOCK)
        return (data, scale), ("mx", 0, None)

    @property
    def _per_block(self) -> bool:
        """Rowwise, blockwise, mxfp8: scales per row or block travel as a second input."""
        return self._rowwise is not None or self._block is not None or self._mx_rounding is not None

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        self._param_dtype = mp_policy.param_dtype or self._tensor.dtype
        if self._per_block and mesh.size() == 1:
            # FSDP2 on one process takes a single input and moves nothing: the weight as it is
            return (self._rounded(),), ("hp", None, None)
        if self._mx_rounding is not None:
            return self._mx_inputs(mesh)
        if self._block is not None:
            return self._block_inputs(mesh)
        if self._rowwise is not None:
            return self._rowwise_inputs(mesh)
        scale, whole_amax = self._scale_and_amax(mesh)
        q = quantize_tensorwise(self._rounded(), self._fp8_dtype, scale, power_of_2=self._pow2)
        # bytes, not FP8: FSDP2 packs all inputs of a group into one buffer, and gloo has no FP8
        return (q.data.view(torch.uint8),), (q.scale, whole_amax)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if self._per_block:
            return self._scaled_post(outputs, metadata, param_dtype, out)
        (data,), (scale, whole_amax) = outputs, metadata
        if out is not None:  # later steps: FSDP2 refilled the same bytes in place
            out._scale = scale
            out._amax = whole_amax
            return None
        weight = Float8GatheredWeight(data.view(self._fp8_dtype), scale, param_dtype, self._pow2, whole_amax)
        return weight, (data,)

    def _scaled_post(self, outputs, metadata, param_dtype, out):
        """Rowwise and blockwise: the bytes and the scales that came with them (per row or per
        tile), or those in the metadata (a backward gather's column or tensor scales)."""
        if metadata[0] == "hp":  # one process: the high-precision weight (the GEMMs cast it)
            (weight,) = outputs
            return None if out is not None else (weight, (weight,))
        (data, gathered_scales), (granularity, contract, scale) = outputs, metadata
        if granularity in ("block", "mx") or (granularity == "axis" and contract == 1):
            scale = gathered_scales
        block = (self._block, self._block) if self._block is not None else None
        if out is not None:  # FSDP2 refilled the same buffers: this gather's scales and layout
            out._scale, out._granularity, out._contract, out._block = scale, granularity, contract, block
            return None
        fp8 = data.view(self._fp8_dtype)
        weight = Float8GatheredWeight(fp8, scale, param_dtype, self._pow2, None, granularity, contract, block)
        return weight, (data, gathered_scales)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # inside the autograd engine


class DelayedWeightScale:
    """What the FP8 all-gather of a delayed-scaling layer's weight reads from the layer: every rank
    casts its shard *before* the gather, so the scale must be known then. It is the one the
    layer's forward would use (``scaling.delayed_scale_step`` on the weight's history, step
    counter and the whole weight's amax, without updating them: the forward does, recording the
    amax the gather carries); a re-gather in backward (FSDP2 resharded after forward, or an
    activation-checkpoint recompute) uses the forward's scale (``fp8_last_scales``). The weight's
    history holds whole-weight amaxes only, identical on every rank, so every rank computes the
    same scale with or without ``reduce_amax``."""

    def __init__(self, layer: Float8Linear) -> None:
        self._layer = weakref.ref(layer)

    def forward_scale(self) -> torch.Tensor:
        return self._owner().fp8_last_scales[1].clone()

    def scale_for(self, whole_amax: torch.Tensor) -> torch.Tensor:
        m = self._owner()
        r = m.recipe
        hist, scale, step = m.fp8_amax_history_weight, m.fp8_scale_weight, m.fp8_step
        return delayed_scale_step(hist, scale, step, whole_amax, r.fp8_format.forward_dtype, r)[0]

    def _owner(self) -> Float8Linear:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("the Float8Linear of this FP8 all-gather weight no longer exists")
        return layer


def _layers(model: nn.Module) -> list[Float8Linear]:
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def enable_fsdp_float8_all_gather(model: nn.Module) -> int:
    """Wrap the weight of every tensorwise Float8Linear (before ``fully_shard``); returns how
    many. New Parameter objects: an optimizer built earlier must be remapped (the Accelerator
    does, by name). Raises ``ValueError`` for a layer whose recipe is not tensorwise."""
    n = 0
    for m in _layers(model):
        check_fsdp_fp8_all_gather(m.recipe.name, m.recipe.scaling)
        w = m.weight
        if isinstance(w, Float8AllGatherWeight):
            continue
        r = m.recipe
        delayed = DelayedWeightScale(m) if r.kind.keeps_history else None
        fprop_w, dgrad_w = r.plan.fprop.b, r.plan.dgrad.b
        rowwise = block = mx_rounding = None
        if fprop_w is not None and fprop_w.granularity == "mx32":  # MXFP8: E8M0 scales per 32
            mx_rounding = r.scale_rounding
        if fprop_w is not None and fprop_w.granularity == "axis":
            rowwise = dgrad_w.granularity if dgrad_w is not None else "axis"
        if fprop_w is not None and fprop_w.granularity == "block":
            block = r.block_size
        fp8 = r.fp8_format.forward_dtype
        wrapped = Float8AllGatherWeight(
            w.detach(), fp8, r.margin, r.power_of_2_scales, delayed, rowwise, block, mx_rounding
        )
        m.weight = nn.Parameter(wrapped, requires_grad=w.requires_grad)
        n += 1
    return n


def _local(w: torch.Tensor) -> torch.Tensor:
    return getattr(w, "_local_tensor", w)  # FSDP2 keeps a DTensor around the wrapper


@torch.no_grad()
def precompute_float8_scales_for_fsdp(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> int:
    """Every wrapped weight's whole amax for the next all-gather (its scale follows: tensorwise's
    from it, delayed's from the history with it recorded), from one MAX all-reduce of the shard
    amaxes (after ``optimizer.step()``); returns the number of collectives (0 or 1)."""
    shards = [s for s in (_local(m.weight) for m in _layers(model)) if isinstance(s, Float8AllGatherWeight)]
    if not shards:
        return 0
    # amax of the shard rounded to param_dtype = amax rounded to it (rounding is monotonic):
    # the same amax the tensorwise recipe takes of the gathered bf16 weight, without a copy
    amaxes = torch.stack([_rounded_amax(s) for s in shards])
    if dist.is_initialized():
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for s, a in zip(shards, amaxes):
        s._precomputed = (a, s._tensor._version)
    return 1 if dist.is_initialized() else 0


def _rounded_amax(s: Float8AllGatherWeight) -> torch.Tensor:
    a = amax(s._tensor)
    dt = s._param_dtype
    return a if dt is None else a.to(dt).to(torch.float32)


class CountingAllGather:
    """An FSDP2 custom all-gather (``FSDPModule.set_custom_all_gather``) that counts the bytes
    each rank puts on the wire: ``(world - 1) x input bytes`` per call (ring / direct), plus the
    input bytes themselves in ``input_bytes``."""

    def __init__(self) -> None:
        self.calls = 0
        self.input_bytes = 0
        self.sent_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        self.calls += 1
        self.input_bytes += nbytes
        self.sent_bytes += (dist.get_world_size(group) - 1) * nbytes
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def install_counting_all_gather(model: nn.Module) -> CountingAllGather:
    """One :class:`CountingAllGather` on every FSDP2 module of ``model``; returns it."""
    from torch.distributed.fsdp import FSDPModule

    counter = CountingAllGather()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(cast(Any, counter))  # duck-typed: FSDP2 calls its methods
    return counter
