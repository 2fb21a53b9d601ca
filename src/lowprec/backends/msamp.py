"""MS-AMP: the real library (UNTESTED HERE: MS-AMP cannot be installed on this machine) and
lowprec's own O1/O2 when it is missing.

Real MS-AMP: ``msamp.initialize(model, optimizer, opt_level)`` returns a new model and a new
optimizer (LBAdam/LBAdamW), so it needs both; weights are fp16, so a loss scaler is used, and
``clip_grad_norm_`` unscales first (Accelerate clips scaled gradients, bug 12).

Native: the delayed-scaling recipe on lowprec's engine, plus
``lowprec.optim.apply_opt_level(model, optimizer, opt_level)`` (FP8/FP16 Adam state) and, under
DDP, ``lowprec.distributed.register_fp8_allreduce(ddp_model)`` (FP8 gradient all-reduce), both
imported lazily: if this build lacks them, FP8 GEMMs still run and one log line says what
is not applied.
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
        new_model, new_optimizer = self.msamp.initialize(model, optimizer, opt_level=self.opt_level)
        return new_optimizer, new_model


class NativeOptLevelBackend(NativeBackend):
    """MS-AMP's O1/O2 on lowprec: delayed scaling GEMMs + low-precision optimizer/comm."""

    def __init__(self, recipe: Any, opt_level: str, reason: str) -> None:
        super().__init__(recipe, name="msamp", reason=reason, skip_first_last=False, skip_patterns=())
        self.opt_level = opt_level
        self.engine = f"lowprec native engine (delayed recipe, {opt_level})"
        self.applied: dict[str, bool] = {"apply_opt_level": False, "register_fp8_allreduce": False}

    def prepare_optimizer(self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext):
        try:
            from lowprec.optim import apply_opt_level
        except ImportError:
            log_once(
                f"lowprec: lowprec.optim.apply_opt_level is not in this build; MS-AMP {self.opt_level} "
                "optimizer state stays float32 (FP8 GEMMs still run)"
            )
            return optimizer, model
        if model is None:
            raise ValueError(
                f"MS-AMP {self.opt_level} needs the model that owns the optimizer's parameters: "
                "prepare the model too (in this or an earlier prepare call)"
            )
        model, optimizer = apply_opt_level(model, optimizer, self.opt_level)
        self.applied["apply_opt_level"] = True
        return optimizer, model

    def after_wrap(self, model: nn.Module, ctx: PrepareContext) -> None:
        if ctx.distributed_type != "MULTI":
            return
        try:
            from lowprec.distributed import register_fp8_allreduce
        except ImportError:
            log_once(
                "lowprec: lowprec.distributed.register_fp8_allreduce is not in this build; "
                "gradients are all-reduced in full precision"
            )
            return
        register_fp8_allreduce(model)
        self.applied["register_fp8_allreduce"] = True

    def describe(self) -> dict:
        return {**super().describe(), "opt_level": self.opt_level, "applied": dict(self.applied)}
