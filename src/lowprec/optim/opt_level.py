"""MS-AMP style optimization levels on our own engine: ``apply_opt_level(model, opt, "O2")``.

=== ======================================================================================
O1  weight gradients in FP8. Without DDP: held as FP8 payload + scale between backward and
    the optimizer step (``fp8_grads``; saves ``param_bytes - 1`` bytes per parameter of
    gradient memory at the end of backward). A torch optimizer gets them back as full
    ``.grad`` at its step, where the peak usually is: measured peak unchanged (1.00x);
    only FP8AdamW (O2) reads them in FP8. Under DDP: gradient buckets are all-reduced in
    FP8 (``lowprec.distributed``), half the bytes of bf16; DDP keeps its own full-precision
    buckets, so there is no local gradient memory saving under DDP. Under FSDP2: the
    gradient reduce-scatter is FP8 (``distributed/fsdp_fp8_reduce_scatter.py``), half the
    bytes of bf16; one process has no reduce-scatter and keeps full-precision gradients.
O2  O1 + Adam/AdamW rebuilt as :class:`FP8AdamW` (FP8 first moment, FP16 second moment,
    fp32 masters for non-fp32 parameters), same param groups and hyper-parameters; on FSDP2
    shards with the one-process scales (``sharded.py``).
=== ======================================================================================

Under DDP, call it on the *wrapped* model (``apply_opt_level(ddp_model, ...)``): wrapping after
would hold local gradients while DDP writes reduced ones, which the optimizer step rejects
with an error naming this fix. Like ``msamp.initialize`` it returns ``(model, optimizer)``; the model's Parameter objects are
the same ones (nothing is re-created), the optimizer may be a new object: step the returned one.
An LR scheduler built before the call on the replaced optimizer keeps driving the new one (the
replaced optimizer hands over its param groups, frees its moments and refuses ``step()``).
FP8 GEMMs are a separate switch (``lowprec.fp8.convert``).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from lowprec.optim.fp8_adamw import FP8AdamW, block_segments
from lowprec.optim.fp8_grads import clear_fp8_grads, hold_grads_in_fp8, materialize_grads
from lowprec.optim.moments import encode_exp_avg, encode_exp_avg_sq
from lowprec.optim.sharded import agree_amaxes, finish_moments_shard, prepare_moments_shard
from lowprec.distributed import register_fp8_allreduce
from lowprec.distributed.fsdp_fp8_reduce_scatter import install_fp8_reduce_scatter
from lowprec.utils.distributed import is_fsdp2

__all__ = ["OPT_LEVELS", "apply_opt_level", "check_o2_optimizer", "to_fp8_adamw"]

OPT_LEVELS = ("O1", "O2")
# Keys torch's Adam/AdamW put in every param group that FP8AdamW does not take.
_TORCH_ADAM_KEYS = (
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def check_o2_optimizer(
    optimizer: Any, what: str = "opt_level='O2'", fix: str = "opt_level='O1' (FP8 gradients only, any optimizer)"
) -> None:
    """O2's optimizer rule, one place: torch Adam/AdamW (or FP8AdamW) without amsgrad/maximize.
    ``what`` names the caller's setting and ``fix`` its alternative in the message."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, FP8AdamW)):
        raise ValueError(
            f"{what} needs torch.optim.Adam or torch.optim.AdamW (it becomes lowprec.optim.FP8AdamW), got "
            f"{type(optimizer).__name__}; use one of those, or {fix}"
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"{what} does not support {type(optimizer).__name__}({flag}=True); set {flag}=False, or use {fix}"
                )


def to_fp8_adamw(optimizer: torch.optim.Optimizer, **fp8_kwargs) -> FP8AdamW:
    """Rebuild a ``torch.optim.Adam``/``AdamW`` as :class:`FP8AdamW` over the same params.

    Param groups keep their hyper-parameters and any extra keys (names, ``initial_lr``).
    Existing moments (an optimizer that already stepped) are encoded, not dropped.
    """
    if isinstance(optimizer, FP8AdamW):
        return optimizer
    check_o2_optimizer(optimizer)
    groups = []
    for g in optimizer.param_groups:
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
        new = {k: v for k, v in g.items() if k not in _TORCH_ADAM_KEYS}
        new["lr"] = float(new["lr"])  # a tensor lr (capturable setups) becomes a float
        new["adamw"] = adamw
        groups.append(new)
    fp8 = FP8AdamW(groups, **fp8_kwargs)
    pending = []  # FSDP2 shards: encoded after one all_gather for all of them (optim/sharded.py)
    for p, old in optimizer.state.items():
        if "exp_avg" not in old:
            continue
        st = fp8._init_state(p)
        st["step"] = torch.as_tensor(old["step"], dtype=torch.float32).clone().cpu()
        sr = fp8._shard(p)
        if sr is not None:  # FSDP2: torch's moments are DTensors placed like the parameter
            pending.append(
                (
                    st,
                    prepare_moments_shard(
                        sr,
                        old["exp_avg"].to_local().float(),
                        old["exp_avg_sq"].to_local().float(),
                        fp8.exp_avg_dtype,
                        fp8.exp_avg_sq_dtype,
                        fp8.block_size,
                    ),
                )
            )
            continue
        st["exp_avg"], st["exp_avg_scale"] = encode_exp_avg(
            old["exp_avg"].float(), fp8.exp_avg_dtype, fp8.block_size, segments=block_segments(p)
        )
        st["exp_avg_sq"], st["exp_avg_sq_scale"] = encode_exp_avg_sq(old["exp_avg_sq"].float(), fp8.exp_avg_sq_dtype)
    for (st, pm), everyone in zip(pending, agree_amaxes([e[1] for e in pending])):
        st["exp_avg"], st["exp_avg_scale"], st["exp_avg_sq"], st["exp_avg_sq_scale"] = finish_moments_shard(
            pm, everyone
        )
    _hand_over(optimizer, fp8)
    return fp8


def _hand_over(old: torch.optim.Optimizer, new: FP8AdamW) -> None:
    """``old`` is replaced by ``new``. An LR scheduler built on ``old`` writes ``group["lr"]``
    into ``old.param_groups``; they become ``new``'s, so the schedule applies to the optimizer
    that steps (else it silently would not). A step of ``new`` counts as ``old``'s for torch's
    "scheduler before optimizer" check. ``old``'s moments, now encoded in ``new``, are freed (a
    scheduler keeps ``old`` alive), and ``old.step()`` refuses: it would step nothing."""
    old.param_groups = new.param_groups
    old.state.clear()
    ref = weakref.ref(old)

    def count_step(opt, args, kwargs) -> None:
        replaced = ref()
        if replaced is not None:
            cast(Any, replaced)._opt_called = True

    new.register_step_post_hook(count_step)

    def step(*args, **kwargs):
        raise RuntimeError(
            f"this {type(old).__name__} was replaced by lowprec.optim.FP8AdamW (opt_level 'O2'); "
            "step the optimizer apply_opt_level / to_fp8_adamw returned"
        )

    cast(Any, step)._wrapped_by_lr_sched = True  # torch's schedulers check for their wrapper
    cast(Any, old).step = step


def apply_opt_level(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    *,
    grad_dtype: torch.dtype = torch.float8_e4m3fn,
    hold_grads: bool = True,
    **fp8_adamw_kwargs,
):
    """Apply ``"O1"`` or ``"O2"`` (see module docstring); returns ``(model, optimizer)``.

    ``grad_dtype`` is the FP8 dtype of held gradients / the all-reduce (E4M3: measured 2x
    lower error than E5M2 with per-tensor scales, see docs/LOG.md, optim entry). ``hold_grads=False``
    rounds ``.grad`` through FP8 in place instead of holding it (no memory saved; for a
    GradScaler or a plain ``clip_grad_norm_`` that must see ``.grad``). Extra keyword
    arguments go to :class:`FP8AdamW` (O2 only).
    """
    level = str(opt_level).upper()
    if level not in OPT_LEVELS:
        hint = " (O3 = FP8 weights for ZeRO is not implemented)" if level == "O3" else ""
        raise ValueError(f"opt_level={opt_level!r} is not supported{hint}; use 'O1' or 'O2'")
    if fp8_adamw_kwargs and level != "O2":
        raise ValueError(f"{sorted(fp8_adamw_kwargs)} configure FP8AdamW and only apply to opt_level='O2'")
    if level == "O2":
        optimizer = to_fp8_adamw(optimizer, **fp8_adamw_kwargs)

    # Applying a level twice must not stack a second quantization on the gradients.
    if isinstance(model, DistributedDataParallel):
        if getattr(model, "lowprec_fp8_allreduce", None) is None:
            cast(Any, model).lowprec_fp8_allreduce = register_fp8_allreduce(model, fp8_dtype=grad_dtype)
        return model, optimizer

    if _is_fsdp2(model):
        # FSDP2 owns the gradient reduction, as DDP does: O1's FP8 part is its reduce-scatter
        # (FP8 chunks, float32 sum); the reduced shard lands in .grad, which FP8AdamW reads
        if getattr(model, "lowprec_fp8_reduce_scatter", None) is None:
            cast(Any, model).lowprec_fp8_reduce_scatter = install_fp8_reduce_scatter(model, grad_dtype)
        return model, optimizer
    if getattr(model, "lowprec_fp8_grads", None) is None:
        cast(Any, model).lowprec_fp8_grads = hold_grads_in_fp8(model.parameters(), grad_dtype, hold_grads)
    if not isinstance(optimizer, FP8AdamW):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: materialize_grads(params))
        _clear_held_grads_on_zero_grad(optimizer, params)
    return model, optimizer


def _is_fsdp2(model: torch.nn.Module) -> bool:
    return is_fsdp2(model)


def _clear_held_grads_on_zero_grad(optimizer: torch.optim.Optimizer, params: list) -> None:
    """``optimizer.zero_grad()`` must also drop gradients held in FP8 (a backward that no step
    consumed, e.g. a skipped step, would otherwise be added into the next one). torch has no
    zero_grad hook, so the instance's method is wrapped once."""
    if getattr(optimizer, "_lowprec_clears_fp8_grads", False):
        return
    inner = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        clear_fp8_grads(params)
        inner(set_to_none=set_to_none)

    wrapped: Any = optimizer  # the instance's method, replaced on this object only
    wrapped.zero_grad = zero_grad
    wrapped._lowprec_clears_fp8_grads = True
