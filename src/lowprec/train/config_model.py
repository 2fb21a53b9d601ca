"""Trainer keys for the model and tokenizer (``base_model``, ``tokenizer``)."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from lowprec.errors import did_you_mean
from lowprec.train.config_base import StrictModel

__all__ = ["ModelKeys"]


class ModelKeys(StrictModel):
    base_model: str = Field(
        default="builtin:llama-tiny",
        description="builtin:llama-tiny | builtin:llama-small | builtin:llama-base | builtin:llama-1b, "
        "or a local Hugging Face model directory (needs transformers)",
    )
    tokenizer: str = Field(
        default="byte", description="byte (built-in byte-level tokenizer) or a local Hugging Face tokenizer directory"
    )

    @field_validator("base_model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v.startswith("builtin:"):
            from lowprec.train.model import MODEL_NAMES

            name = v[len("builtin:"):]
            if name not in MODEL_NAMES:
                raise ValueError(
                    f"unknown built-in model {v!r}{did_you_mean(name, MODEL_NAMES)}; use one of "
                    + ", ".join(f"builtin:{n}" for n in MODEL_NAMES)
                )
        elif not os.path.exists(v):
            raise ValueError(
                f"{v!r} is neither builtin:<name> nor an existing local Hugging Face model directory; "
                "downloads are not supported: give a local path or builtin:llama-tiny"
            )
        return v
