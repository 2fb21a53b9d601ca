"""Tensor parallelism for FP8 layers: parallel styles for :class:`~lowprec.fp8.Float8Linear`
(torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` names) on DTensor.

The styles shard like torch's ``ColwiseParallel`` / ``RowwiseParallel`` (weight ``Shard(0)`` /
``Shard(1)``, the same input and output layouts, ``Shard(1)`` inputs or outputs for sequence
parallelism) and check that the layer is an FP8 layer with the tensorwise recipe; the layer's
forward then runs its FP8 GEMMs on the local shards with whole-tensor scales
(:mod:`lowprec.fp8.modules.tp_linear`). Order, as in torchtitan: convert to FP8, then
``parallelize_module`` over the tensor-parallel mesh, then FSDP2 ``fully_shard`` over the
data-parallel mesh of the same 2-D device mesh.

Sequence-parallel inputs (``input_layouts=Shard(1)``) are cast to FP8 with the whole tensor's
scale and all-gathered in FP8 unless fp8.autocast(enabled=False) (:mod:`lowprec.distributed.sequence_parallel`,
which also has torchao's ``PrepareFloat8ModuleInput`` for a block whose colwise layers share
one gathered input).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lowprec.catalog import check_tensor_parallel
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.distributed.sequence_parallel import maybe_fp8_gather

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "check_float8_tp_layer"]


def check_float8_tp_layer(module: nn.Module, style: str) -> None:
    if not isinstance(module, Float8Linear):
        raise ValueError(
            f"Float8{style}Parallel applies to lowprec Float8Linear layers, got {type(module).__name__}; "
            f"convert the model first (lowprec.fp8.convert) or use torch's {style}Parallel"
        )
    check_tensor_parallel(module.recipe.name, module.recipe.scaling, what=f"Float8{style}Parallel")


def _plain_buffers(module: nn.Module) -> nn.Module:
    """torch's styles replicate buffers as DTensors; the FP8 scaling state and telemetry stay
    plain tensors (the same on every rank), read and written by the engine as before."""
    from torch.distributed.tensor import DTensor

    for name, buf in list(module._buffers.items()):
        if isinstance(buf, DTensor):
            module._buffers[name] = buf.to_local()
    return module


class Float8ColwiseParallel(ColwiseParallel):
    """Output features sharded; input replicated (or ``Shard(1)`` for sequence parallelism:
    all-gathered in FP8 unless inside fp8.autocast(enabled=False))."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        recipe = mod._active_recipe() if isinstance(mod, Float8Linear) else None
        out = maybe_fp8_gather(inputs[0], device_mesh, input_layouts[0], desired_input_layouts[0], recipe, True)
        if out is None:
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        return out

    def _apply(self, module: nn.Module, device_mesh):
        check_float8_tp_layer(module, "Colwise")
        return _plain_buffers(super()._apply(module, device_mesh))


class Float8RowwiseParallel(RowwiseParallel):
    """Input features sharded; output summed (``Replicate``) or reduce-scattered (``Shard(1)``)."""

    def _apply(self, module: nn.Module, device_mesh):
        check_float8_tp_layer(module, "Rowwise")
        return _plain_buffers(super()._apply(module, device_mesh))
