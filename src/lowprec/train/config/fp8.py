"""Trainer keys for numerics: fp16 / bf16 / fp8, the FP8 recipe and filter, torch.compile."""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Union, cast

from pydantic import ConfigDict, Field, field_validator, model_validator

from lowprec import guard_settings
from lowprec.catalog import RECIPE_NAMES, recipes_reading, unread_recipe_fields
from lowprec.train.config.base import StrictModel, yaml_text

__all__ = ["FP8RecipeSpec", "PrecisionKeys", "yaml_spelling"]


def yaml_spelling(key: str, value: Any) -> str:
    """``key: value`` as the YAML writes it (the guard rules' ``spell``)."""
    return f"{key}: {yaml_text(value)}"


class FP8RecipeSpec(StrictModel):
    """``fp8_recipe:`` as a mapping: a named recipe plus single-field overrides."""

    model_config = ConfigDict(
        extra="allow", frozen=True, strict=True, allow_inf_nan=False
    )  # recipe fields, checked in the validator

    name: str = Field(default="tensorwise", description=", ".join(RECIPE_NAMES))

    @model_validator(mode="after")
    def _known(self) -> "FP8RecipeSpec":
        # validation only (the engine's own messages: unknown name / field with "did you mean",
        # cross-field rules); the Recipe that runs is built once, by the backend. A known name
        # alone is a valid recipe as it is: not built here, so that a process that only launches
        # workers (`lowprec train --num_processes N`) does not import torch for it
        if self.name not in RECIPE_NAMES or self.overrides:
            with warnings.catch_warnings():  # an unread field is the error below, not a warning
                warnings.filterwarnings("ignore", message=r"Recipe\.from_name.*does not read", category=UserWarning)
                self.to_recipe()
        unread = unread_recipe_fields(self.name, self.overrides)
        if unread:  # a setting that does nothing is an error, not kept silently
            readers = recipes_reading(unread[0])
            raise ValueError(
                f"fp8_recipe.{unread[0]}: the {self.name} recipe does not read it (read by: "
                f"{', '.join(readers) or 'none'}); drop it"
                + (f" or set fp8_recipe name: {' or '.join(readers)}" if readers else "")
            )
        return self

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def to_recipe(self):
        # torch: checking a recipe needs the engine; importing the schema does not (tests/test_imports.py)
        from lowprec.fp8.recipes import Recipe

        return Recipe.from_name(self.name, **self.overrides)


class PrecisionKeys(StrictModel):
    fp16: Optional[bool] = Field(default=None, description="fp16 autocast with a gradient scaler")
    bf16: Union[Literal["auto", "full"], bool] = Field(
        default="auto",
        description="auto (bf16 autocast where the device supports it), true (fp32 weights, bf16 autocast), "
        "full (pure bf16 weights, no autocast), false",
    )
    fp8: Optional[bool] = Field(default=None, description="FP8 GEMMs in the Linear layers (lowprec's engine)")
    fp8_recipe: Union[str, FP8RecipeSpec] = Field(
        default="tensorwise",
        description=f"named FP8 recipe ({', '.join(RECIPE_NAMES)}) or {{name: ..., <recipe field>: ...}}",
    )
    fp8_filter: list[str] = Field(
        default_factory=list,
        description="layer name patterns kept in high precision (a name part like o_proj, or a glob like "
        "model.layers.0.*), added to the defaults (first/last Linear, lm_head, router, gate)",
    )
    fp8_enable_fsdp_float8_all_gather: Optional[bool] = Field(
        default=None,
        description="all-gather FSDP2 weights in FP8 (needs fsdp_version: 2 and an fp8_recipe other than nvfp4)",
    )
    fp8_force_recompute_fp8_weight_in_bwd: Union[Literal["auto"], bool] = Field(
        default="auto",
        description="backward re-casts each FP8 weight from the re-gathered weight instead of keeping its FP8 "
        "copy: auto (where FSDP2 or ZeRO-3 shards the weights: no unsharded FP8 weight held from forward to "
        "backward), true (always: 1 byte per weight element less held, one more cast per layer in backward), "
        "false (keep the copy)",
    )
    fp8_fallback: Optional[Literal["bf16", "emulate"]] = Field(
        default=None,
        description="on a GPU without FP8 (below sm_89): bf16 (train in bf16) or emulate (FP8 numerics, slow)",
    )
    fp8_guard: Union[Literal["off", "warn", "act"], bool] = Field(
        default="off",
        description="per-layer FP8 health guard: off, warn (log the layer, signal and step once per episode) or act "
        "(also move that layer to bf16, kept on resume); thresholds in docs/guide.md, checked at each logging step",
    )
    fp8_guard_patience: int = Field(
        default=3, ge=1, description="unhealthy checks (logging steps) in a row before fp8_guard warns or acts"
    )
    fp8_guard_recover_after: Optional[int] = Field(
        default=None,
        ge=1,
        description="with fp8_guard: act, move a moved layer back to FP8 after this many healthy checks in a row "
        "(its would-be FP8 casts measured on the side; kept on resume); null: a moved layer stays in bf16",
    )
    fp8_guard_scope: str = Field(
        default="layer",
        description="what fp8_guard: act moves: layer (the whole layer to bf16) or gemm (only the GEMMs that read "
        "the unhealthy operand: x -> fprop, wgrad; W -> fprop, dgrad; dY -> dgrad, wgrad; SQNR -> fprop)",
    )
    fp8_guard_thresholds: Optional[dict[str, float]] = Field(
        default=None,
        description="change fp8_guard thresholds: {saturated: 1.0e-3, underflow: 0.02, max_to_rms: 200, sqnr_db: 15} "
        "(the defaults; a layer crossing any is unhealthy at that check)",
    )
    fp8_health: Optional[bool] = Field(
        default=None,
        description="per-layer FP8 health signals (kind: fp8_health in metrics.jsonl) at each logging step "
        "(default: on when fp8_guard is warn or act)",
    )
    fp8_health_sqnr_every: int = Field(
        default=50,
        ge=1,
        description="measure each FP8 layer's output SQNR against a float32 shadow GEMM 1 step in N (on a logging step)",
    )
    tf32: Union[Literal["auto"], bool] = Field(
        default="auto", description="TF32 matmuls on NVIDIA GPUs (auto: torch's setting; no effect on CPU)"
    )
    torch_compile: Union[Literal["auto"], bool] = Field(
        default=False, description="torch.compile the model (auto: on CUDA only)"
    )

    # the rules live in lowprec.guard_settings, shared with NativeRecipeKwargs (the Accelerator)
    @field_validator("fp8_guard")
    @classmethod
    def _guard(cls, v: Union[str, bool]) -> str:
        return guard_settings.guard_mode(v, yaml_spelling)

    @field_validator("fp8_guard_scope", mode="before")
    @classmethod
    def _scope(cls, v: Any) -> str:
        return guard_settings.guard_scope(v, yaml_spelling)

    @field_validator("fp8_guard_thresholds")
    @classmethod
    def _thresholds(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        guard_settings.check_thresholds(v)
        return v

    @model_validator(mode="after")
    def _recover_needs_act(self) -> "PrecisionKeys":
        guard = cast(str, self.fp8_guard)  # _guard made a bool a mode
        guard_settings.check_recover_needs_act(self.fp8_guard_recover_after, guard, yaml_spelling)
        guard_settings.check_scope_needs_act(self.fp8_guard_scope, guard, yaml_spelling)
        return self

    @property
    def fp8_health_on(self) -> bool:
        """Health signals are recorded: fp8_health: true, or by default with a guard."""
        return guard_settings.health_on(cast(str, self.fp8_guard), self.fp8_health)  # _guard made a bool a mode

    @field_validator("fp8_recipe")
    @classmethod
    def _recipe(cls, v: Union[str, FP8RecipeSpec]) -> FP8RecipeSpec:
        return FP8RecipeSpec(name=v) if isinstance(v, str) else v
