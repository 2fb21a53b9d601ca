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

:func:`apply_tp_plan` applies a model's ``_tp_plan`` (and ``_sp_plan``) with these styles for FP8
layers and torch's for the others (the Accelerator's tensor-parallel step,
:mod:`lowprec.utils.parallelism`).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lowprec.catalog import check_tensor_parallel
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.distributed.sequence_parallel import PrepareFloat8ModuleInput, maybe_fp8_gather

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "check_float8_tp_layer", "apply_tp_plan"]


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


def _styles(sequence_parallel: bool) -> dict:
    """Plan value -> style factory (FP8 layers get lowprec's Float8 styles)."""
    # under sequence parallelism the rowwise outputs are reduce-scattered to sequence slices
    row: dict[str, Any] = {"output_layouts": Shard(1)} if sequence_parallel else {}
    return {
        ("colwise", False): ColwiseParallel,
        ("colwise", True): Float8ColwiseParallel,
        ("rowwise", False): lambda: RowwiseParallel(**row),
        ("rowwise", True): lambda: Float8RowwiseParallel(**row),
        "sequence_parallel": SequenceParallel,
        "sequence_gather": lambda: PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "sequence_gather_local": lambda: PrepareFloat8ModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        ),
        # tensor parallelism alone: a block's colwise layers take one replicated DTensor input, so
        # their input gradients (partial sums) add up before one all-reduce instead of one each
        "replicated_input": lambda: PrepareFloat8ModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Replicate()
        ),
        "sequence_shard_output": lambda: PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        ),
    }


def apply_tp_plan(model: Any, tp_mesh: Any, sequence_parallel: bool = False) -> int:
    """Parallelize every module the model's ``_tp_plan`` names (and, with ``sequence_parallel``,
    its ``_sp_plan``); returns how many. FP8 layers get lowprec's Float8 styles (tensorwise),
    the others torch's. A model without a plan is an error, raised before ``tp_mesh`` is used.

    ``_sp_plan`` values: ``sequence_parallel`` (a norm on sequence slices, torch's style),
    ``sequence_gather`` (the module's first input arrives sharded on the sequence and is
    all-gathered, in FP8 when its Linears are FP8), ``sequence_gather_local`` (the same, handed
    on as a plain tensor: a consumer whose weights are not split), ``sequence_shard_output``
    (a replicated output split along the sequence)."""
    plan = getattr(model, "_tp_plan", None) or getattr(model, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"tp_size > 1 but {type(model).__name__} has no _tp_plan "
            "({'<module pattern>': 'colwise' | 'rowwise'}); add one or set tp_size to 1"
        )
    sp_plan = getattr(model, "_sp_plan", None)
    if not sequence_parallel:  # its gather points still share one input among the colwise layers
        sp_plan = {k: "replicated_input" for k, v in (sp_plan or {}).items() if v == "sequence_gather"}
    if sp_plan is None:
        raise ValueError(
            f"sequence_parallel with {type(model).__name__}, which has no _sp_plan ({{'<module pattern>': "
            "'sequence_parallel' | 'sequence_gather' | ...}}); add one or turn sequence_parallel off"
        )
    styles = _styles(sequence_parallel)
    applied = {}
    for name, module in model.named_modules():
        for pattern, style in [*plan.items(), *sp_plan.items()]:
            if fnmatch.fnmatchcase(name, pattern):
                key = (style, isinstance(module, Float8Linear)) if style in ("colwise", "rowwise") else style
                if key not in styles:
                    names = ", ".join(["colwise", "rowwise", *(k for k in styles if isinstance(k, str))])
                    raise ValueError(f"plan entry {pattern!r}: {style!r} is not a style; use one of {names}")
                applied[name] = styles[key]()
                break
    parallelize_module(model, tp_mesh, applied)
    return len(applied)
