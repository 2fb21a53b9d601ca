"""MS-AMP, declared in ``lowprec/backends/msamp.py``: the real library (UNTESTED HERE: MS-AMP
cannot be installed on this machine) and lowprec's own O1/O2 when it is missing.

Real MS-AMP: ``msamp.initialize(model, optimizer, opt_level)`` returns a new model and a new
optimizer (LBAdam/LBAdamW), so it needs both; weights are fp16, so a loss scaler is used, and
``clip_grad_norm_`` unscales first (Accelerate clips scaled gradients, bug 12).

Native: the delayed-scaling recipe on lowprec's engine, plus
``lowprec.optim.apply_opt_level(model, optimizer, opt_level)`` (O1: FP8 weight gradients, FP8
gradient all-reduce under DDP; O2: also FP8/FP16 Adam moments).

Native under DeepSpeed (measured, docs/LOG.md, dsopt entry): DeepSpeed owns gradient reduction, so
the FP8 gradient part of O1/O2 cannot apply there. O2 keeps its optimizer half: the client
optimizer handed to ``deepspeed.initialize`` is :class:`lowprec.optim.FP8AdamW`, which ZeRO
steps on its flat fp32 partitions (FP8 first moment, FP16 second moment per partition; works
and resumes exactly under ZeRO 1, 2 and 3). O1 under DeepSpeed would change nothing, so it is
an error naming the fixes.
"""

from __future__ import annotations

from typing import Any, Optional, cast

from torch import nn

from lowprec.backends.base import BaseBackend, PrepareContext
from lowprec.logs import log_once
from lowprec.backends.engines.native import NativeBackend
from lowprec.fp8.recipes import Recipe
from lowprec.kwargs import MSAMPRecipeKwargs
from lowprec.optim import apply_opt_level, to_fp8_adamw
from lowprec.optim.opt_level import check_o2_optimizer

__all__ = ["MSAMPBackend", "NativeOptLevelBackend", "create", "native_recipe", "fallback"]


class MSAMPBackend(BaseBackend):
    name = "msamp"
    needs_grad_scaler = True
    needs_model_for_optimizer = True  # msamp.initialize takes the model and the optimizer

    def __init__(self, opt_level: str, reason: str = "") -> None:
        import msamp

        self.msamp = msamp
        self.opt_level = opt_level
        self.engine = f"MS-AMP {getattr(msamp, '__version__', '?')} ({opt_level})"
        self.reason = reason or "MSAMPRecipeKwargs / fp8_backend=msamp and msamp is installed"
        self._pending: dict[int, nn.Module] = {}

    def prepare_optimizer(self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext):
        if ctx.distributed_type == "FSDP":
            raise ValueError("MS-AMP does not support FSDP2; use DeepSpeed, DDP, or the native backend")
        if model is None:
            raise ValueError(
                "MS-AMP's msamp.initialize needs the model and its optimizer: prepare the model "
                "too (in this or an earlier prepare call)"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            # msamp.initialize swaps Linear layers, which DDP has already bucketed
            raise ValueError(
                "real MS-AMP under DDP is not supported by lowprec's adapter (msamp.initialize must "
                "run before DDP wraps the model); use the native O1/O2 (uninstall msamp or pass "
                "NativeRecipeKwargs) or DeepSpeed"
            )
        new_model, new_optimizer = self.msamp.initialize(model, optimizer, opt_level=self.opt_level)
        return new_optimizer, new_model


class NativeOptLevelBackend(NativeBackend):
    """MS-AMP's O1/O2 on lowprec: delayed-scaling FP8 GEMMs + ``lowprec.optim.apply_opt_level``.

    ``apply_opt_level`` gets the model as the Accelerator holds it: under DDP the wrapped model,
    so it registers the FP8 gradient all-reduce itself. Gradients are rounded through FP8 in
    place (``hold_grads=False``) rather than held aside, so ``accelerator.clip_grad_norm_`` and
    a GradScaler still see ``.grad`` (the optim log measured no peak-memory gain from holding
    them with a torch optimizer anyway). Under FSDP2 (which MS-AMP lacks): O2's FP8AdamW steps the
    DTensor shards with the one-process scales (``lowprec.optim.sharded``); see ``apply_opt_level``
    for the gradients. Under DeepSpeed: O2 hands
    DeepSpeed an :class:`~lowprec.optim.FP8AdamW` as its client optimizer and DeepSpeed reduces
    the gradients (no FP8 all-reduce); O1 is an error (module docstring).
    """

    needs_model_for_optimizer = True  # apply_opt_level hooks the model's gradients

    def __init__(self, recipe: Any, opt_level: str, reason: str) -> None:
        super().__init__(recipe, name="msamp", reason=reason, skip_first_last=False, skip_patterns=())
        self.opt_level = opt_level
        self.engine = f"lowprec native engine (delayed recipe, {opt_level})"
        self.applied = False
        self.deepspeed = False

    def prepare_optimizer(self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext):
        if ctx.distributed_type == "DEEPSPEED":
            return self._prepare_for_deepspeed(optimizer), model
        if model is None:
            raise ValueError(
                f"MS-AMP {self.opt_level} needs the model that owns the optimizer's parameters: "
                "prepare the model too (in this or an earlier prepare call)"
            )
        model, optimizer = apply_opt_level(model, optimizer, self.opt_level, hold_grads=False)
        self.applied = True
        return optimizer, model

    def _prepare_for_deepspeed(self, optimizer: Any) -> Any:
        """O2: FP8AdamW as DeepSpeed's client optimizer. O1: ValueError (nothing of it applies)."""
        if self.opt_level == "O1":
            raise ValueError(
                "MSAMPRecipeKwargs(opt_level='O1') does not compose with DeepSpeed: O1 is FP8 "
                "gradients and an FP8 gradient all-reduce, and DeepSpeed ZeRO reduces and "
                "partitions the gradients itself. Use opt_level='O2' (FP8AdamW optimizer state, "
                "which DeepSpeed ZeRO steps on its partitions), DDP instead of DeepSpeed for O1, "
                "or TERecipeKwargs for FP8 GEMMs without an opt level"
            )
        check_o2_optimizer(
            optimizer,
            "MSAMPRecipeKwargs(opt_level='O2') under DeepSpeed",
            "TERecipeKwargs for FP8 GEMMs without an opt level",
        )
        optimizer = to_fp8_adamw(optimizer)
        self.applied = True
        self.deepspeed = True
        log_once(
            "lowprec: MS-AMP O2 under DeepSpeed: the optimizer state is FP8AdamW's (FP8/FP16, on "
            "ZeRO's partitions); DeepSpeed reduces the gradients in its own precision (no FP8 "
            "all-reduce)"
        )
        return optimizer

    def describe(self) -> dict:
        info = {**super().describe(), "opt_level": self.opt_level, "applied": self.applied}
        if self.deepspeed:
            info["optimizer"] = "FP8AdamW (DeepSpeed client optimizer)"
            info["gradients"] = "reduced by DeepSpeed (no FP8 all-reduce)"
        return info


def native_recipe(handler: MSAMPRecipeKwargs) -> Any:
    """MS-AMP's O1/O2 run on the delayed recipe. ``amax_compute_algo="max"`` is pinned: it is
    what this fallback always ran (the recipe default became Accelerate's ``most_recent``,
    docs/LOG.md, settings entry), and MSAMPRecipeKwargs has no field to choose it."""
    return Recipe.from_name("delayed", amax_compute_algo="max")


def _opt_level(handler: MSAMPRecipeKwargs) -> str:
    # _resolve_fields (the handler's __post_init__) filled it ("O2" by default), never None
    return cast(str, handler.opt_level)


def create(handler: MSAMPRecipeKwargs, reason: str) -> MSAMPBackend:
    return MSAMPBackend(_opt_level(handler), reason)


def fallback(handler: MSAMPRecipeKwargs, recipe: Any, reason: str) -> NativeOptLevelBackend:
    return NativeOptLevelBackend(recipe, _opt_level(handler), reason)
