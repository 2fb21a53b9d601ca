"""Trainer keys for the model and tokenizer (Axolotl's names).

``base_model``: ``builtin:<name>``, a local directory written by ``save_pretrained``, or a hub id
(``org/name``) already in the local Hugging Face cache (nothing is downloaded; a missing one is
a one-line error naming the missing files). ``model_type``: a transformers causal-LM class name
(default AutoModelForCausalLM). ``tokenizer_config``: a tokenizer directory or cached hub id
(default: the base model's own tokenizer). ``tokenizer_type``: a transformers tokenizer class
(default AutoTokenizer). ``trust_remote_code``: false, so a model whose code ships in its
directory is refused unless asked for. ``tokenizer`` is lowprec's own key (``byte`` or a
directory), kept for the built-in models.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from lowprec.errors import did_you_mean
from lowprec.train.config.base import StrictModel
from lowprec.train.hf_files import locate_pretrained
from lowprec.train.model_config import MODEL_NAMES

__all__ = ["ModelKeys"]


class ModelKeys(StrictModel):
    base_model: str = Field(
        default="builtin:llama-tiny",
        description="builtin:llama-tiny | builtin:llama-small | builtin:llama-base | builtin:llama-1b | "
        "builtin:moe-tiny (mixture of experts, top-2 of 8), a local Hugging Face model directory, or a hub id "
        "(org/name) already in the local Hugging Face cache (needs transformers; nothing is downloaded)",
    )
    tokenizer: Optional[str] = Field(
        default=None,
        description="byte (built-in byte-level tokenizer) or a local Hugging Face tokenizer directory "
        "(default: byte for a built-in base_model, the base model's own tokenizer for a Hugging Face one)",
    )
    model_type: Optional[str] = Field(
        default=None,
        description="transformers class that loads base_model: AutoModelForCausalLM (default) or a "
        "causal LM class such as LlamaForCausalLM",
    )
    tokenizer_config: Optional[str] = Field(
        default=None,
        description="tokenizer directory or cached hub id (default: base_model's own tokenizer for "
        "a Hugging Face base_model)",
    )
    tokenizer_type: Optional[str] = Field(
        default=None,
        description="transformers tokenizer class: AutoTokenizer (default) or e.g. PreTrainedTokenizerFast",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="run model/tokenizer code shipped in the model directory (off: such models are refused)",
    )

    @field_validator("base_model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v.startswith("builtin:"):
            name = v[len("builtin:") :]
            if name not in MODEL_NAMES:
                raise ValueError(
                    f"unknown built-in model {v!r}{did_you_mean(name, MODEL_NAMES)}; use one of "
                    + ", ".join(f"builtin:{n}" for n in MODEL_NAMES)
                )
        else:  # a local directory, or a hub id found in the local cache (never downloaded)
            locate_pretrained(v, key="")
        return v

    @model_validator(mode="after")
    def _model_keys(self):
        builtin = self.base_model.startswith("builtin:")
        for key in ("model_type", "tokenizer_type"):
            if getattr(self, key) is not None and builtin:
                raise ValueError(
                    f"{key} is set but base_model is built-in; {key} applies to Hugging Face models: "
                    "drop it or set base_model to a local model directory"
                )
        if self.tokenizer_config is not None and self.tokenizer is not None:
            raise ValueError("tokenizer and tokenizer_config are both set; keep tokenizer_config (Axolotl's key)")
        if self.tokenizer_config is not None:
            locate_pretrained(self.tokenizer_config, "tokenizer_config", tokenizer=True)
        return self
