"""Distributed wrappers (DDP, FSDP2) and full-state-dict helpers for checkpoints."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from lowprec.distributed.expert_parallel import (
    expert_parallel_names,
    gather_expert_optimizer_state,
    gather_expert_state,
    slice_expert_optimizer_state,
)

__all__ = [
    "wrap_ddp",
    "trigger_sync_in_backward",
    "wrap_fsdp2",
    "fsdp2_units",
    "is_fsdp2",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
]

_FSDP_DTYPES = {"fp8": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_ddp(model: nn.Module, device: torch.device, ddp_kwargs: dict, ignore: Optional[list] = None) -> nn.Module:
    """DDP; ``ignore``: names of parameters and buffers each rank keeps its own (expert
    parallelism's experts), neither broadcast nor all-reduced."""
    from torch.nn.parallel import DistributedDataParallel

    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


@contextlib.contextmanager
def trigger_sync_in_backward(model: nn.Module):
    """Under DDP, the next backward all-reduces gradients even inside ``no_sync`` (for a last
    micro-step run under ``no_sync`` for other reasons); elsewhere a no-op."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    old_fwd, old_bwd = model.require_forward_param_sync, model.require_backward_grad_sync
    model.require_forward_param_sync = model.require_backward_grad_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_forward_param_sync, model.require_backward_grad_sync = old_fwd, old_bwd


def fsdp2_units(model: nn.Module, plugin: Any) -> list[nn.Module]:
    """The submodules sharded on their own (each one all-gather unit), innermost first."""
    if plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        names = set(plugin.transformer_cls_names_to_wrap)
        found = {type(m).__name__ for m in model.modules()}
        missing = names - found
        if missing:
            raise ValueError(
                f"FSDP transformer_cls_names_to_wrap {sorted(missing)} not found in the model; "
                f"module classes present: {sorted(found)}"
            )
        units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    elif plugin.auto_wrap_policy == "SIZE_BASED_WRAP":
        units = [
            m
            for m in model.modules()
            if m is not model and sum(p.numel() for p in m.parameters()) >= plugin.min_num_params
        ]
    else:
        units = []
    return list(reversed(units))  # children before parents, as fully_shard expects


def wrap_fsdp2(
    model: nn.Module,
    mixed_precision: str,
    plugin: Any,
    device: torch.device,
    mesh: Any = None,
    ignore: Sequence[str] = (),
) -> nn.Module:
    """``fully_shard`` each unit of the plugin's wrap policy, then the root. Parameters are
    computed in bf16 under fp8/bf16 (FP8 layers sit inside the bf16 policy), gradients reduced
    in fp32. ``ignore``: names of parameters FSDP2 leaves alone (expert parallelism: each
    rank's own experts, whose gradients the all-to-alls already sum over every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    param_dtype = _FSDP_DTYPES.get(mixed_precision)
    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if plugin.offload_params else OffloadPolicy()
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=plugin.reshard_after_forward, offload_policy=offload)
    if ignore:
        names = set(ignore)
        kw["ignored_params"] = {p for n, p in model.named_parameters() if n in names}
    for unit in fsdp2_units(model, plugin):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


def _dtensor_params(model: nn.Module) -> bool:
    """FSDP2 or tensor parallelism: parameters are DTensors, gathered into full state dicts."""
    if is_fsdp2(model):
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(model, FSDPModule)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _bias_only(module: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
    bias = getattr(module, "bias", None)
    if bias is not None:
        destination[prefix + "bias"] = bias if keep_vars else bias.detach()


def _state_dict_without_4bit_weights(model: nn.Module) -> dict:
    """``model.state_dict()`` without bitsandbytes' frozen 4-bit weights (QLoRA). On CPU
    ``Linear4bit`` packs its weights for the inference kernel at the first eval-mode forward and
    its ``state_dict`` unpacks them in place, lossily: saved after an evaluation, a checkpoint
    changed the base the run trained on. They are never loaded back
    (:func:`load_full_model_state_dict` skips them; the base is loaded again from its files)."""
    four_bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    if not four_bit:
        return model.state_dict()
    for m in four_bit:  # an instance attribute shadows the class's method while the dict is made
        m._save_to_state_dict = types.MethodType(_bias_only, m)  # type: ignore[method-assign]
    try:
        return model.state_dict()
    finally:
        for m in four_bit:
            del m._save_to_state_dict


def full_model_state_dict(model: nn.Module, checkpoint: bool = False) -> dict:
    """Full (unsharded) state dict; collective under FSDP2 and expert parallelism (the
    experts' slices all-gathered), on every process. ``checkpoint``: for ``save_state``, without
    bitsandbytes' frozen 4-bit weights (see :func:`_state_dict_without_4bit_weights`); a saved
    model (``save_model``, ``get_state_dict``) keeps them."""
    if not _dtensor_params(model):
        sd = _state_dict_without_4bit_weights(model) if checkpoint else model.state_dict()
        return gather_expert_state(model, sd)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(cpu_offload=True))
    # expert parallelism under FSDP2: the experts are plain tensors FSDP2 ignores, each rank its
    # slice; all-gathered from the model's own state dict (every rank), kept where rank 0's has them
    experts = expert_parallel_names(model)
    if experts:
        whole = gather_expert_state(model, model.state_dict())
        state.update({k: whole[k].detach().cpu() for k in experts if k in state})
    return state


def full_optimizer_state_dict(model: Optional[nn.Module], optimizer: Any) -> dict:
    if model is None or not _dtensor_params(model):
        return gather_expert_optimizer_state(optimizer, optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return gather_expert_optimizer_state(optimizer, state, model)  # expert parallelism: whole experts


def load_full_model_state_dict(model: nn.Module, state_dict: dict) -> None:
    if not _dtensor_params(model):
        frozen_4bit = tuple(f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Linear4bit")
        if not frozen_4bit:
            model.load_state_dict(state_dict)
            return
        # QLoRA: bitsandbytes' 4-bit base weights are frozen and made again from base_model when
        # the run starts; their saved copy (packed NF4 + quant-state keys, which Linear4bit's
        # load_state_dict does not take) is skipped, every other key loads strictly
        result = model.load_state_dict(
            {k: v for k, v in state_dict.items() if not k.startswith(frozen_4bit)}, strict=False
        )
        missing = [k for k in result.missing_keys if not k.startswith(frozen_4bit)]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(model).__name__}: missing keys "
                f"{missing[:5]}, unexpected keys {result.unexpected_keys[:5]}"
            )
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict, options=_options())


def load_full_optimizer_state_dict(model: Optional[nn.Module], optimizer: Any, state_dict: dict) -> None:
    if model is None or not _dtensor_params(model):
        state_dict = slice_expert_optimizer_state(optimizer, state_dict)
        _check_state_shapes(optimizer, state_dict)
        optimizer.load_state_dict(state_dict)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state_dict = _keyed_by_name(model, optimizer, state_dict)  # a one-process / DDP checkpoint's
    state_dict = slice_expert_optimizer_state(optimizer, state_dict, model)  # expert parallelism: this rank's
    set_optimizer_state_dict(model, optimizer, state_dict, options=_options())


def _keyed_by_name(model: nn.Module, optimizer: Any, state_dict: dict) -> dict:
    """A whole optimizer state keyed by parameter index (``Optimizer.state_dict``'s numbering, as
    one process or DDP saves it: ``state[0]``, ``param_groups[g]["params"] == [0, 1, ...]``) keyed
    by parameter name instead, as torch.distributed's full optimizer state dict is (FSDP2, tensor
    parallelism). The rule ``Optimizer.load_state_dict`` maps by: the saved groups' ``params`` in
    order against this optimizer's ``param_groups`` in order. A state already keyed by name is
    returned as it is; groups of other sizes are a ValueError."""
    saved = state_dict.get("param_groups", [])
    if not any(isinstance(i, int) and not isinstance(i, bool) for g in saved for i in g.get("params", [])):
        return state_dict
    groups = optimizer.param_groups
    sizes, own = [len(g["params"]) for g in saved], [len(g["params"]) for g in groups]
    if sizes != own:
        raise ValueError(
            f"the saved optimizer has parameter groups of {sizes} parameters, this run's {own}: "
            "another model or optimizer setup"
        )
    names = _parameter_names(model)
    name_of = {i: names[id(p)] for s, g in zip(saved, groups) for i, p in zip(s["params"], g["params"])}
    unknown = [k for k in state_dict.get("state", {}) if k not in name_of]
    if unknown:
        raise ValueError(f"the saved optimizer holds state for parameter index {unknown[0]!r}, which no group lists")
    return {
        "state": {name_of[k]: v for k, v in state_dict.get("state", {}).items()},
        "param_groups": [{**s, "params": [name_of[i] for i in s["params"]]} for s in saved],
    }


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the name torch.distributed's optimizer state dicts key it by (wrapper
    prefixes such as DDP's ``module.`` or ``_orig_mod.`` left out, as ``_get_fqns`` does)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - a torch without the helper: the plain names
        return {id(p): n for n, p in model.named_parameters()}
    return {id(p): next(iter(_get_fqns(model, n))) for n, p in model.named_parameters()}


def _check_state_shapes(optimizer: Any, state_dict: dict) -> None:
    """A ValueError where a state tensor is its parameter's shape but for the first dim (AdamW's
    moments of another number of experts or rows: one process's share, saved by another process
    count or an earlier lowprec): ``Optimizer.load_state_dict`` takes it as it is and the first
    step fails, or broadcasts. States of other ranks (factored moments, scales) are not compared."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in state_dict.get("state", {}).get(i, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == p.dim() >= 1 and v.shape != p.shape:
                if v.shape[1:] == p.shape[1:]:
                    raise ValueError(
                        f"the optimizer state {k!r} of parameter {i} is {tuple(v.shape)}, the parameter is "
                        f"{tuple(p.shape)}: it holds another share of the rows (experts) than this run's; resume "
                        "with the process count (and ep_size) that saved it"
                    )


def _grad_groups(parameters: Any) -> dict[Any, list]:
    """The parameters with a gradient, grouped by where their norm is taken: one plain group, one
    per DTensor mesh, one per expert-parallel group (each rank holds other experts)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters) if p.grad is not None]
    groups: dict[Any, list] = {}
    for p in params:
        ep = getattr(p, "_lowprec_ep_group", None)  # lowprec.distributed.expert_parallel
        key = ("ep", ep) if ep is not None else (p.grad.device_mesh if isinstance(p.grad, DTensor) else None)
        groups.setdefault(key, []).append(p)
    return groups


def _total_norm(groups: dict[Any, list], norm_type: float) -> torch.Tensor:
    """Each group's norm, whole (over its mesh or every rank's experts), combined into one."""
    from torch.distributed.tensor import DTensor

    norms = []
    for key, group in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        if isinstance(key, tuple):  # the norm over every rank's experts
            inf = norm_type == float("inf")
            part = norm.clone() if inf else norm.pow(norm_type)
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=key[1])
            norms.append(part if inf else part.pow(1.0 / norm_type))
        else:
            norms.append(norm if key is None else cast(DTensor, norm).full_tensor())  # a mesh: DTensor grads
    return torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.tensor(0.0)


def grad_norm(parameters: Any, norm_type: float = 2.0) -> torch.Tensor:
    """The total gradient norm :func:`clip_grad_norm` would clip with, gradients left untouched
    (collective where the gradients are sharded or experts are spread over ranks)."""
    return _total_norm(_grad_groups(parameters), norm_type)


def clip_grad_norm(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, also over gradients on several meshes or none (tensor
    parallelism: the split Linears are DTensors on the tensor-parallel mesh, embeddings plain;
    under FSDP2 + TP, 2-D DTensors beside the 1-D ones FSDP2 made of the embeddings; torch's
    foreach kernels refuse the mix): each group's norm, whole, is combined into the one total."""
    groups = _grad_groups(parameters)
    if len(groups) <= 1 and not any(isinstance(k, tuple) for k in groups):
        params = [p for group in groups.values() for p in group]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    total = _total_norm(groups, norm_type)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
