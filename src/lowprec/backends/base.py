"""The one protocol every FP8 backend implements, and the helpers they share.

The Accelerator calls, in this order, and knows nothing else about a backend:

1. ``convert(model, ctx)``          swap layers (before DDP / FSDP2 / DeepSpeed wrapping)
2. ``prepare_optimizer(opt, model, ctx)``  keep the optimizer on the model's parameters;
   returns ``(optimizer, model)``, either possibly replaced (MS-AMP builds new ones)
3. ``after_wrap(wrapped, ctx)``      hooks that need the distributed wrapper (comm hooks)
4. ``fp8_context(model)``            entered around every forward, inside bf16 autocast
5. ``after_optimizer_step(model)``   per-step work (e.g. FSDP2 scale precompute)
6. ``after_skipped_step(model)``     the step was skipped (non-finite): undo what it recorded

plus ``plain_state_dict(sd)`` for :meth:`Accelerator.save_model`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch-free: the declarations (backends/<name>.py) import this; engines/ import torch
    import torch
    from torch import nn

__all__ = [
    "Backend",
    "PrepareContext",
    "BaseBackend",
    "remap_optimizer_params",
    "named_params",
]


@dataclass(frozen=True)
class PrepareContext:
    """Where the model will run: ``distributed_type`` is NO | MULTI | FSDP | DEEPSPEED."""

    distributed_type: str = "NO"
    device: "torch.device" = field(default_factory=lambda: _cpu())
    emulate: bool = False  # FP8 GEMMs emulated (fp8_fallback='emulate' or a non-CUDA device)


def _cpu() -> "torch.device":
    import torch

    return torch.device("cpu")


@runtime_checkable
class Backend(Protocol):
    name: str  # native | torchao | te | msamp: what the user asked for
    needs_grad_scaler: bool  # a loss scaler is needed (MS-AMP keeps fp16 weights)
    engine: str  # what actually runs, e.g. "lowprec native engine (delayed scaling)"
    needs_model_for_optimizer: bool  # prepare(optimizer) waits until its model is prepared
    reason: str  # why this engine runs it

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module: ...

    def prepare_optimizer(
        self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext
    ) -> tuple[Any, Optional[nn.Module]]: ...

    def after_wrap(self, model: nn.Module, ctx: PrepareContext) -> None: ...

    def fp8_context(self, model: nn.Module) -> ContextManager: ...

    def after_optimizer_step(self, model: nn.Module) -> None: ...

    def after_skipped_step(self, model: nn.Module) -> None: ...

    def plain_state_dict(self, state_dict: dict) -> dict: ...

    def describe(self) -> dict: ...


class BaseBackend:
    """No-op defaults; a backend overrides what it needs."""

    name = "base"
    needs_grad_scaler = False
    needs_model_for_optimizer = False
    engine = "none"
    reason = ""

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module:
        return model

    def prepare_optimizer(
        self, optimizer: Any, model: Optional[nn.Module], ctx: PrepareContext
    ) -> tuple[Any, Optional[nn.Module]]:
        """Returns (optimizer, model); a backend may replace either (MS-AMP does)."""
        return optimizer, model

    def after_wrap(self, model: nn.Module, ctx: PrepareContext) -> None:
        return None

    def fp8_context(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def after_optimizer_step(self, model: nn.Module) -> None:
        return None

    def after_skipped_step(self, model: nn.Module) -> None:
        return None

    def plain_state_dict(self, state_dict: dict) -> dict:
        return state_dict

    def describe(self) -> dict:
        return {"backend": self.name, "engine": self.engine, "reason": self.reason}


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def remap_optimizer_params(optimizer: Any, before: dict[str, nn.Parameter], after: dict[str, nn.Parameter]) -> int:
    """Point the optimizer at the parameters a conversion created, matched by name.

    Accelerate's torchao path skips this, so its optimizer trains stale tensors (reference
    bug 1). Returns how many parameters were swapped. Optimizer state is keyed by parameter,
    so it moves along.
    """
    by_id = {id(p): name for name, p in before.items()}
    swapped = 0
    for group in getattr(optimizer, "param_groups", []):
        params: list = group["params"]
        for i, p in enumerate(params):
            name = by_id.get(id(p))
            if name is None or name not in after or after[name] is p:
                continue
            new = after[name]
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[new] = state
            params[i] = new
            swapped += 1
    return swapped
