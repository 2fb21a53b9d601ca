"""Trainer keys for batches, the optimizer and the learning-rate schedule."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from lowprec.errors import did_you_mean
from lowprec.train.config_base import StrictModel

__all__ = ["OptimKeys", "OPTIMIZERS", "LR_SCHEDULERS"]

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
LR_SCHEDULERS = ("cosine", "linear", "constant")


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
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = Field(default=0.9, gt=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(default=0.95, gt=0, lt=1, description="AdamW beta2")
    max_grad_norm: Optional[float] = Field(default=1.0, gt=0, description="clip the gradient norm (null: no clipping)")
    seed: int = Field(default=42, ge=0, description="seed of weights, data order and validation split")

    @field_validator("optimizer", "lr_scheduler")
    @classmethod
    def _named_choice(cls, v: str, info: Any) -> str:
        choices = {"optimizer": OPTIMIZERS, "lr_scheduler": LR_SCHEDULERS}[info.field_name]
        v = {"adamw": "adamw_torch"}.get(v, v) if info.field_name == "optimizer" else v
        if v not in choices:
            raise ValueError(f"unknown {info.field_name} {v!r}{did_you_mean(v, choices)}; use one of {', '.join(choices)}")
        return v
