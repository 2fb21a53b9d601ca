"""Sequence parallelism with FP8 block inputs: cast once, all-gather in FP8 (torchao's
``PrepareFloat8ModuleInput``), for tensor-parallel FP8 transformer blocks.

Under tensor + sequence parallelism (Megatron's sequence parallelism; torch's
``SequenceParallel`` style) the residual stream and the norms hold a slice of the sequence on
each process (``Shard(1)``); the attention and the MLP need the whole sequence, so their input
is all-gathered, and their rowwise output projections reduce-scatter back to the slices.
Every colwise FP8 layer (q, k, v; gate, up) would cast that gathered input to FP8 with one
whole-tensor scale (tensorwise recipe). So each process casts *its slice* with that scale
before the gather, and the gather carries FP8 bytes: half of bf16's, a quarter of fp32's.

* The scale is the whole tensor's: a MAX all-reduce of the slices' amaxes (4 bytes) over the
  tensor-parallel group, then ``fp8_max / amax`` as in :mod:`lowprec.fp8.cast.scaling`; the cast is
  elementwise, so every FP8 value is bitwise the one a single process casts.
* The gathered tensor is a :class:`~lowprec.fp8.modules.gathered.Float8GatheredWeight` (FP8 data + the
  scale, presenting as the input's dtype); the FP8 GEMMs take it as their cast of ``x``
  (``as_float8_data``), so q, k and v share one cast and one gather.
* Backward: the gradient of the gathered input is a sum of partial sums over the colwise
  shards; it is reduce-scattered back to the slices in the input's dtype (high precision, as
  torchao does). A consumer whose weights are not split (``use_local_output``: a replicated
  LM head) hands back the whole gradient on every rank; the slice is taken locally.

gloo has no FP8 dtype, so the bytes travel as ``uint8`` (the same bytes NCCL would send).
Inside ``fp8.autocast(enabled=False)`` (or for a module without FP8 layers) the styles gather in high
precision, exactly as torch's ``PrepareModuleInput`` / ``ColwiseParallel``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from lowprec.fp8.modules.gathered import Float8GatheredWeight
from lowprec.catalog import check_tensor_parallel
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.cast.quantize import quantize
from lowprec.fp8.cast.scaling import amax, amax_to_scale

__all__ = ["PrepareFloat8ModuleInput", "fp8_sequence_all_gather", "is_float8_input", "maybe_fp8_gather"]

logger = logging.getLogger("lowprec")


def is_float8_input(x: Any) -> bool:
    """True for an input already cast to FP8 and gathered (plain or inside a DTensor)."""
    local = x._local_tensor if isinstance(x, DTensor) else x
    return isinstance(local, Float8GatheredWeight)


class _Float8SequenceAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim: int, recipe, as_dtensor: bool):
        fp8 = recipe.plan.fprop.a.dtype  # the dtype the colwise GEMMs cast x to
        a = amax(x).reshape(1)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=mesh.get_group())  # the whole tensor's amax
        scale = amax_to_scale(a[0], fp8, margin=recipe.margin, power_of_2=recipe.power_of_2_scales)
        q = quantize(x, fp8, "tensor", scale=scale, margin=recipe.margin, power_of_2=recipe.power_of_2_scales)
        local = q.data.contiguous().view(torch.uint8)
        world = mesh.size()
        stacked = local.new_empty((world * local.shape[0], *local.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(stacked, local, group=mesh.get_group())  # along dim 0: the slices in rank order
        gathered = torch.cat(stacked.chunk(world, dim=0), dim=dim) if dim != 0 else stacked
        full = Float8GatheredWeight(gathered.view(fp8), scale, x.dtype, recipe.power_of_2_scales)
        ctx.mesh, ctx.dim = mesh, dim
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False) if as_dtensor else full

    @staticmethod
    def backward(ctx, grad):
        mesh, dim = ctx.mesh, ctx.dim
        if isinstance(grad, DTensor):  # Partial (colwise consumers): reduce-scatter to the slices
            g = grad.redistribute(mesh, [Shard(dim)]).to_local()
        else:  # a replicated consumer: every rank holds the whole gradient
            g = grad.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
        return g.contiguous(), None, None, None, None


def fp8_sequence_all_gather(x: torch.Tensor, mesh, dim: int, recipe, as_dtensor: bool = True) -> torch.Tensor:
    """``x`` (this process's slice along ``dim``, a plain tensor) cast to FP8 with the whole
    tensor's scale and all-gathered in FP8: a ``Replicate`` DTensor (``as_dtensor``) or a plain
    tensor of the whole sequence, presenting as ``x.dtype``."""
    check_tensor_parallel(recipe.name, recipe.scaling, what="the FP8 sequence-parallel all-gather")
    return _Float8SequenceAllGather.apply(x, mesh, dim, recipe, as_dtensor)


def maybe_fp8_gather(x: Any, mesh, src, dst, recipe, as_dtensor: bool) -> Optional[torch.Tensor]:
    """The FP8 gather of ``x`` from ``src`` (``Shard(d)``) to ``dst`` (``Replicate``) when FP8 is
    active (``recipe``) and the move is a gather; else ``None`` (the caller gathers as torch does)."""
    if recipe is None or not isinstance(src, Shard) or not isinstance(dst, Replicate) or not torch.is_tensor(x):
        return None
    if is_float8_input(x):
        return None
    if isinstance(x, DTensor):
        if tuple(x.placements) != (src,):
            x = x.redistribute(placements=[src])
        x = x.to_local()
    dim = src.dim if src.dim >= 0 else src.dim + x.dim()
    return fp8_sequence_all_gather(x, mesh, dim, recipe, as_dtensor)


def _colwise(module: nn.Module) -> dict[str, nn.Linear]:
    """The module's colwise-split Linears (weight ``Shard(0)`` on the tensor-parallel mesh): they
    all read the gathered input."""
    out = {}
    for name, m in module.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(w, DTensor) and w.placements[-1] == Shard(0):
            out[name] = m
    return out


def _reads_input_in_high_precision(m: nn.Linear) -> bool:
    """A colwise Linear that must get the gathered input unrounded: not FP8, or an FP8 layer whose
    GEMMs that read the input (fprop, wgrad) run in high precision (moved by the FP8 guard, or
    the recipe's override): an FP8-gathered input would reach them FP8-rounded."""
    if not isinstance(m, Float8Linear):
        return True
    precision = m.gemm_precision()
    return precision["fprop"] or precision["wgrad"]


def _first_float8(module: nn.Module, fqn: Optional[str]) -> Optional[Float8Linear]:
    if fqn is not None:
        layer = module.get_submodule(fqn)
        if not isinstance(layer, Float8Linear):
            raise ValueError(
                f"PrepareFloat8ModuleInput(fwd_config_submodule_fqn={fqn!r}): that submodule is a "
                f"{type(layer).__name__}, not a Float8Linear"
            )
        return layer
    return next((m for m in module.modules() if isinstance(m, Float8Linear)), None)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` whose ``Shard(d) -> Replicate`` moves cast to FP8 first
    (torchao's name and keywords). The recipe is that of the module's first Float8Linear (or of
    ``fwd_config_submodule_fqn``), read at each call, so inside ``fp8.autocast(enabled=False)`` the gather is
    in high precision; so it is (logged once) when a colwise Linear of the module is not FP8 (it
    reads the same input and must not get it FP8-rounded). Inputs beyond ``input_layouts`` (RoPE
    tables, masks) pass through."""

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_output: bool = False,
        fwd_config_submodule_fqn: Optional[str] = None,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_output,
        )
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        self._layer: Optional[Float8Linear] = None

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        recipe = self._layer._active_recipe() if self._layer is not None else None
        out = maybe_fp8_gather(input, mesh, input_layout, desired_layout, recipe, not self.use_local_output)
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout) if out is None else out

    def _prepare_input_fn(self, inputs, device_mesh):
        n = len(self.input_layouts or ())
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if self.input_layouts is None or len(inputs) <= n:
            return super()._prepare_input_fn(inputs, device_mesh)
        return super()._prepare_input_fn(inputs[:n], device_mesh) + inputs[n:]

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layer = _first_float8(module, self.fwd_config_submodule_fqn)
        if layer is not None:
            check_tensor_parallel(
                layer.recipe.name, layer.recipe.scaling, what=f"sequence-parallel FP8 inputs of {type(module).__name__}"
            )

        state: dict[str, Any] = {"colwise": None, "said": ()}

        def prepare(_module, args, kwargs):
            if state["colwise"] is None:  # the first call: every split Linear is in place by then
                state["colwise"] = _colwise(module) if layer is not None else {}
            # at every call: the FP8 guard may move a layer's GEMMs to high precision (or back)
            plain = tuple(n for n, m in state["colwise"].items() if _reads_input_in_high_precision(m))
            if plain != state["said"] and plain:  # e.g. the first Linear, kept in high precision by skip_first_last
                logger.info(
                    "lowprec: %s's input is all-gathered in high precision, not FP8: its colwise layer(s) "
                    "%s read it in high precision too",
                    type(module).__name__,
                    ", ".join(plain),
                )
            state["said"] = plain
            self._layer = None if plain else layer  # one style object may serve several modules (a plan's wildcard)
            if self.with_kwargs:
                return self._prepare_input_kwarg_fn(args, kwargs, device_mesh)
            return self._prepare_input_fn(args, device_mesh), kwargs

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module
