"""Trainer keys for batches, the optimizer and the learning-rate schedule."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from lowprec.errors import did_you_mean
from lowprec.train.config.base import StrictModel

__all__ = ["OptimKeys", "OPTIMIZERS", "LR_SCHEDULERS"]

_FLOAT32_MAX = 3.4028234663852886e38
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
LR_SCHEDULERS = ("cosine", "linear", "constant")
# Axolotl / transformers spellings of the same thing (warmup is always linear, then the schedule)
_ALIASES = {"adamw": "adamw_torch", "constant_with_warmup": "constant"}
_8BIT = (
    "8-bit and paged optimizers need bitsandbytes' optimizer states, which lowprec's trainer does not "
    "use (it uses bitsandbytes only to load 4-bit QLoRA bases)"
)
_AXOLOTL_ONLY = {
    **dict.fromkeys(
        (
            "adamw_bnb_8bit",
            "adamw_8bit",
            "paged_adamw_8bit",
            "paged_adamw_32bit",
            "paged_lion_8bit",
            "lion_8bit",
            "paged_ademamix_8bit",
            "ademamix_8bit",
            "adamw_torch_4bit",
            "ao_adamw_4bit",
            "ao_adamw_8bit",
            "ao_adamw_fp8",
        ),
        _8BIT,
    ),
    **dict.fromkeys(
        (
            "adafactor",
            "adamw_hf",
            "adamw_anyprecision",
            "lion_pytorch",
            "muon",
            "dion",
            "optimi_adamw",
            "schedule_free_adamw",
            "came_pytorch",
            "galore_adamw",
            "adopt_adamw",
            "ademamix",
            "lomo",
            "adalomo",
            "adamw_torch_xla",
            "sgd_hf",
            "rmsprop",
            "adagrad",
        ),
        "another optimizer implementation",
    ),
    **dict.fromkeys(
        (
            "one_cycle",
            "rex",
            "log_sweep",
            "cosine_with_restarts",
            "polynomial",
            "inverse_sqrt",
            "reduce_lr_on_plateau",
            "cosine_with_min_lr",
            "warmup_stable_decay",
            "constant_with_warmup_decay",
        ),
        "another schedule shape",
    ),
}


class OptimKeys(StrictModel):
    micro_batch_size: int = Field(default=8, ge=1, description="sequences per forward pass per process")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    num_epochs: Optional[float] = Field(
        default=None, gt=0, description="passes over the training data (used when max_steps is not set; default 1)"
    )
    max_steps: Optional[int] = Field(default=None, ge=1, description="optimizer steps to run (wins over num_epochs)")
    optimizer: str = Field(default="adamw_torch", description=f"one of {', '.join(OPTIMIZERS)}")
    learning_rate: float = Field(default=1e-3, gt=0, description="peak learning rate")
    lr_scheduler: str = Field(default="cosine", description=f"one of {', '.join(LR_SCHEDULERS)} (after warmup)")
    warmup_steps: int = Field(default=0, ge=0, description="linear warmup steps from 0 to learning_rate")
    warmup_ratio: Optional[float] = Field(
        default=None, ge=0, lt=1, description="warmup as a fraction of the run's steps (instead of warmup_steps)"
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = Field(default=0.9, gt=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(default=0.95, gt=0, lt=1, description="AdamW beta2")
    max_grad_norm: Optional[float] = Field(default=1.0, gt=0, description="clip the gradient norm (null: no clipping)")
    seed: int = Field(default=42, ge=0, le=2**32 - 1, description="seed of weights, data order and validation split")
    gradient_checkpointing: bool = Field(
        default=False, description="recompute each decoder layer in backward instead of storing its activations"
    )
    gradient_checkpointing_kwargs: Optional[dict[str, Any]] = Field(
        default=None, description="{use_reentrant: false} (the only supported setting)"
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v: Any) -> Any:
        if v in ("offload", "offload_disk"):
            raise ValueError(f"{v} (activation offloading) is an Axolotl setting lowprec does not support; use true")
        return v

    @field_validator("gradient_checkpointing_kwargs")
    @classmethod
    def _checkpointing_kwargs(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if v and (set(v) - {"use_reentrant"} or v.get("use_reentrant")):
            raise ValueError(f"{v}: only {{use_reentrant: false}} is supported (non-reentrant checkpointing)")
        return v

    @field_validator("learning_rate")
    @classmethod
    def _learning_rate(cls, v: float) -> float:
        # optimizers hold the rate as a float32 scalar: above its range the first step fails
        # with a bare "cannot be converted to type float without overflow"
        if v > _FLOAT32_MAX:
            raise ValueError(
                f"{v:g} is beyond float32's range ({_FLOAT32_MAX:.4g}), in which the optimizer "
                "holds it; use a learning rate such as 1e-3"
            )
        return v

    @field_validator("optimizer", "lr_scheduler")
    @classmethod
    def _named_choice(cls, v: str, info: Any) -> str:
        choices = {"optimizer": OPTIMIZERS, "lr_scheduler": LR_SCHEDULERS}[info.field_name]
        v = _ALIASES.get(v, v)
        if v in _AXOLOTL_ONLY:
            raise ValueError(
                f"{v} is an Axolotl {info.field_name} lowprec does not support ({_AXOLOTL_ONLY[v]}); "
                f"use one of {', '.join(choices)}"
            )
        if v not in choices:
            raise ValueError(
                f"unknown {info.field_name} {v!r}{did_you_mean(v, choices)}; use one of {', '.join(choices)}"
            )
        return v
