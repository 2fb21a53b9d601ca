"""Trainer keys for parameter-efficient adapters (Axolotl's names), part of
:class:`lowprec.train.config.TrainConfig`'s bases.

``adapter: lora | qlora`` with ``lora_r``, ``lora_alpha``, ``lora_dropout``,
``lora_target_modules``, ``lora_target_linear``, ``lora_target_parameters``, ``lora_modules_to_save``,
``lora_fan_in_fan_out``; ``merge_lora`` saves the merged model too (``merge_lora_format``: bf16,
or an FP8 base's own format); ``load_in_4bit`` is what
``qlora`` loads with. A key set to null means "unset" (Axolotl configs list many that way).
What runs is in :mod:`lowprec.train.adapters`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from lowprec.train.config.base import StrictModel

__all__ = ["AdapterKeys", "LORA_KEYS"]

LORA_KEYS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_linear",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_fan_in_fan_out",
)


class AdapterKeys(StrictModel):
    adapter: Optional[Literal["lora", "qlora"]] = Field(
        default=None,
        description="lora (peft LoRA on the frozen base model; FP8 runs the frozen base GEMMs) or "
        "qlora (the same on a base model loaded in 4 bits, NF4, through bitsandbytes; needs load_in_4bit: true)",
    )
    lora_r: Optional[int] = Field(default=None, ge=1, description="LoRA rank (default 8)")
    lora_alpha: Optional[float] = Field(
        default=None, gt=0, description="LoRA scaling numerator: updates scale by lora_alpha / lora_r (default lora_r)"
    )
    lora_dropout: Optional[float] = Field(
        default=None, ge=0, lt=1, description="dropout on the adapter input (default 0)"
    )
    lora_target_modules: Optional[Union[list[str], str]] = Field(
        default=None, description="module names that get adapters, e.g. [q_proj, v_proj]"
    )
    lora_target_parameters: Optional[list[str]] = Field(
        default=None,
        description="Parameters (not modules) that get adapters, by the end of their names: a mixture-of-experts "
        "model's fused 3-D expert weights, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (peft's "
        "target_parameters). In FP8 the experts' grouped GEMMs read the weight with the adapter's delta added",
    )
    lora_target_linear: Optional[bool] = Field(
        default=None, description="adapters on every Linear / Conv1D but the output head (added to lora_target_modules)"
    )
    lora_modules_to_save: Optional[list[str]] = Field(
        default=None, description="modules trained in full next to the adapters (e.g. [embed_tokens, lm_head])"
    )
    lora_fan_in_fan_out: Optional[bool] = Field(
        default=None, description="weights stored (in, out), as GPT-2's Conv1D (default: detected)"
    )
    merge_lora: bool = Field(
        default=False,
        description="also save the base model with the adapters merged in, to output_dir/merged (bf16; an FP8 "
        "base_model: in its FP8 format, the merged layers re-quantized once, unless merge_lora_format: bf16)",
    )
    merge_lora_format: Optional[Literal["fp8", "bf16"]] = Field(
        default=None,
        description="what merge_lora writes: fp8 (an FP8 base_model's own format, the merged layers re-quantized "
        "once; needs an FP8 base_model) or bf16 (a plain bf16 model; from an FP8 base every layer dequantized). "
        "Default: the base model's own (bf16 for a bf16 base, its FP8 format for an FP8 base)",
    )
    load_in_4bit: Optional[bool] = Field(
        default=None,
        description="load the base model in 4 bits (NF4 through bitsandbytes, bf16 compute): what adapter: qlora needs",
    )

    @model_validator(mode="after")
    def _lora_keys(self):
        # lora_* keys without an adapter are inert, as in Axolotl: config/inert.py drops them with a note
        if self.adapter is None:
            if self.merge_lora:
                raise ValueError("merge_lora: true needs adapter: lora; drop merge_lora or add an adapter")
        if self.merge_lora_format is not None and not self.merge_lora:
            raise ValueError(
                f"merge_lora_format: {self.merge_lora_format} says what merge_lora writes; add merge_lora: true "
                "or drop merge_lora_format"
            )
        # Axolotl's rules: qlora requires load_in_4bit; a 4-bit base only trains through adapters
        if self.load_in_4bit and self.adapter != "qlora":
            raise ValueError(
                "load_in_4bit: true is what adapter: qlora loads with; set adapter: qlora, or drop "
                "load_in_4bit (adapter: lora trains on the bf16/FP8 base)"
            )
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError(
                "adapter: qlora needs load_in_4bit: true (the base model loaded in 4 bits); add it, or "
                "use adapter: lora for a bf16/FP8 base"
            )
        if self.adapter is not None:
            if str(getattr(self, "base_model", "")).startswith("builtin:"):
                raise ValueError(
                    f"adapter: {self.adapter} needs a Hugging Face base_model (a local directory or "
                    "cached hub id); built-in models train in full: drop adapter"
                )
            if not self.lora_target_modules and not self.lora_target_linear and not self.lora_target_parameters:
                raise ValueError(
                    f"adapter: {self.adapter} needs lora_target_modules (e.g. [q_proj, v_proj]), "
                    "lora_target_linear: true or lora_target_parameters (a mixture-of-experts model's expert weights)"
                )
            if self.lora_target_parameters and self.lora_dropout:
                raise ValueError(
                    f"lora_dropout: {self.lora_dropout} with lora_target_parameters: peft's adapters on "
                    "parameters (expert weights) take no dropout; set lora_dropout: 0"
                )
            for key in ("fsdp_version", "deepspeed"):
                if getattr(self, key, None) is not None:
                    raise ValueError(
                        f"adapter: {self.adapter} with {key} is not supported yet; train adapters on one "
                        "process or with DDP (--num_processes N), or drop the adapter"
                    )
        return self
