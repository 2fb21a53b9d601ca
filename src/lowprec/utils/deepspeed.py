"""DeepSpeed ZeRO 1-3 glue (DeepSpeed is an optional extra; on CPU set ``DS_ACCELERATOR=cpu``).

``deepspeed.initialize`` takes the model and its optimizer together, so under DeepSpeed they
must come in the same ``prepare`` call (DeepSpeed's constraint, said in the error). FP8 keeps
working here: the model is converted before DeepSpeed wraps it and its forward runs inside the
FP8 region with the user's recipe (Accelerate passes only the legacy handler here, bug 3), and
``accelerator.autocast()`` is bf16 under fp8 (Accelerate uses the device default, bug 13).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

__all__ = ["build_ds_config", "deepspeed_initialize", "DeepSpeedOptimizer"]


def build_ds_config(plugin: Any, mixed_precision: str, micro_batch_size: int, accumulation_steps: int, world: int) -> dict:
    """The DeepSpeed config: the user's ``hf_ds_config`` with precision, ZeRO stage, batch sizes
    and clipping filled in where it does not set them; a conflicting precision is an error."""
    cfg = copy.deepcopy(plugin.hf_ds_config or {})
    want_bf16 = mixed_precision in ("bf16", "fp8")  # FP8 sits on bf16, as in Accelerate
    want_fp16 = mixed_precision == "fp16"
    for key, want in (("bf16", want_bf16), ("fp16", want_fp16)):
        section = cfg.setdefault(key, {})
        if "enabled" in section and bool(section["enabled"]) != want:
            raise ValueError(
                f"DeepSpeed config has {key}.enabled={section['enabled']} but mixed_precision="
                f"{mixed_precision!r}; make them agree (fp8 trains on bf16)"
            )
        section["enabled"] = want
    zero = cfg.setdefault("zero_optimization", {})
    zero.setdefault("stage", plugin.zero_stage)
    for key, device in (("offload_optimizer", plugin.offload_optimizer_device), ("offload_param", plugin.offload_param_device)):
        if device not in (None, "none"):
            zero.setdefault(key, {"device": device})
    cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
    cfg.setdefault("gradient_accumulation_steps", accumulation_steps)
    cfg.setdefault("train_batch_size", micro_batch_size * accumulation_steps * world)
    if plugin.gradient_clipping is not None:
        cfg.setdefault("gradient_clipping", plugin.gradient_clipping)
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    return cfg


def deepspeed_initialize(model: Any, optimizer: Any, config: dict) -> tuple[Any, Any]:
    try:
        import deepspeed
    except ImportError:
        raise ValueError(
            "DeepSpeed was asked for (deepspeed_plugin / ACCELERATE_USE_DEEPSPEED) but is not "
            "installed: pip install 'lowprec[deepspeed]' (on CPU also set DS_ACCELERATOR=cpu)"
        ) from None
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, ds_optimizer


class DeepSpeedOptimizer:
    """What ``prepare`` returns for the optimizer under DeepSpeed: ``step`` runs the engine's step
    (DeepSpeed decides on accumulation boundaries), ``zero_grad`` is the engine's business."""

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.scaler = None
        self.unscaled = False
        self.after_step: Optional[Any] = None

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def step(self, closure: Any = None) -> None:
        self.engine.step()
        if self.after_step is not None:
            self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine zeroes gradients at each boundary

    @property
    def step_was_skipped(self) -> bool:
        return bool(getattr(self.optimizer, "overflow", False))

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
