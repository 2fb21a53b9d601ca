"""MS-AMP: the real library (UNTESTED HERE: MS-AMP cannot be installed on this machine) and
lowprec's own O1/O2 when it is missing.

Real MS-AMP: ``msamp.initialize(model, optimizer, opt_level)`` returns a new model and a new
optimizer (LBAdam/LBAdamW), so it needs both; weights are fp16, so a loss scaler is used, and
``clip_grad_norm_`` unscales first (Accelerate clips scaled gradients, bug 12).

Native: the delayed-scaling recipe on lowprec's engine, plus
``lowprec.optim.apply_opt_level(model, optimizer, opt_level)`` (O1: FP8 weight gradients, FP8
gradient all-reduce under DDP; O2: also FP8/FP16 Adam moments), imported lazily: if a build
lacks it, FP8 GEMMs still run and one log line says what is not applied.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lowprec.backends.base import BaseBackend, PrepareContext, log_once
from lowprec.backends.native import NativeBackend

__all__ = ["MSAMPBackend", "NativeOptLevelBackend"]


class MSAMPBackend(BaseBackend):
    name = "msamp"
    needs_grad_scaler = True

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
    them with a torch optimizer anyway). Not under FSDP2 (as MS-AMP); under DeepSpeed the
    engine owns the optimizer, so only the FP8 GEMMs run.
    """

    def __init__(self, recipe: Any, opt_level: str, reason: str) -> None:
        super().__init__(recipe, name="msamp", reason=reason, skip_first_last=False, skip_patterns=())
        self.opt_level = opt_level
        self.engine = f"lowprec native engine (delayed recipe, {opt_level})"
        self.applied = False

    def prepare_optimizer(self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext):
        if ctx.distributed_type == "FSDP":
            raise ValueError(
                f"MS-AMP opt_level {self.opt_level} is not supported with FSDP2 (nor by MS-AMP); "
                "use DDP or DeepSpeed, or an FP8 recipe without an opt level (TERecipeKwargs)"
            )
        if ctx.distributed_type == "DEEPSPEED":
            log_once(f"lowprec: under DeepSpeed the engine owns the optimizer; opt_level {self.opt_level} "
                     "is not applied (FP8 GEMMs still run)")
            return optimizer, model
        try:
            from lowprec.optim import apply_opt_level
        except ImportError:
            log_once(
                f"lowprec: lowprec.optim.apply_opt_level is not in this build; MS-AMP {self.opt_level} "
                "optimizer state and gradients stay in full precision (FP8 GEMMs still run)"
            )
            return optimizer, model
        if model is None:
            raise ValueError(
                f"MS-AMP {self.opt_level} needs the model that owns the optimizer's parameters: "
                "prepare the model too (in this or an earlier prepare call)"
            )
        model, optimizer = apply_opt_level(model, optimizer, self.opt_level, hold_grads=False)
        self.applied = True
        return optimizer, model

    def describe(self) -> dict:
        return {**super().describe(), "opt_level": self.opt_level, "applied": self.applied}
