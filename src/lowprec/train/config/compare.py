"""Trainer keys for precision comparisons: ``compare:`` and ``fp8_backend``.

``compare:`` holds what ``lowprec compare`` reads (``lowprec train`` ignores it), so a config
file carries its own parity test::

    compare:
      precisions: [bf16, fp8-tensorwise, fp8-torchao]
      seeds: 5            # or a list: [1, 2, 3]
      threshold: 0.005    # FP8 may be at most 0.5% worse than the baseline at 95% confidence

Instead of precisions, ``arms:`` names the runs and the keys each one changes, for comparisons
that differ in something else than the precision, e.g. a LoRA on an FP8 base against the same
LoRA on its bf16 upcast::

    compare:
      arms:
        bf16-upcast: {base_model: outputs/fp8-bases/bf16}
        hf-fp8: {base_model: outputs/fp8-bases/hf-fp8}
      baseline: bf16-upcast   # default: the first arm
      seeds: 5

An arm may name a precision (``precision: fp8-rowwise``: that precision's keys, then the arm's
own). Its keys are trainer keys, validated as the config is; ``seed``, ``output_dir`` and the
keys ``lowprec compare`` sets per run are not arm keys.

``fp8_backend: torchao`` routes the FP8 conversion through torchao's ``Float8Linear`` instead of
lowprec's engine (the ``fp8-torchao`` precision of ``lowprec compare`` sets it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from lowprec.backends.spec import get_spec, trainer_backends
from lowprec.train.config.base import StrictModel as _Strict

__all__ = ["CompareSpec", "CompareKeys", "FP8_BACKENDS", "check_fp8_backend"]

# the engine first (the default), then each backend that declares trainer recipes (backends/<name>.py)
FP8_BACKENDS = (get_spec("native").name, *trainer_backends())
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a directory name and a report label
if TYPE_CHECKING:
    _Backend = str  # the registered backends' names: a Literal built at import time, which a checker cannot read
else:
    _Backend = Literal[FP8_BACKENDS]
# keys lowprec compare sets on every run: an arm does not change them
COMPARE_MANAGED = ("seed", "output_dir", "compare", "resume_from_checkpoint", "save_steps", "saves_per_epoch")


class CompareSpec(_Strict):
    """``compare:`` settings; each has a ``lowprec compare --flag`` of the same name that wins."""

    precisions: list[str] = Field(
        default_factory=lambda: ["fp32", "bf16", "fp8"],
        description="precisions to run: fp32, bf16, fp16, bf16-full, fp8 (the config's recipe), fp8-<recipe>, "
        "fp8-torchao, fp8-torchao-<recipe>",
    )
    seeds: Union[int, list[int]] = Field(
        default=1, description="N (seeds seed, seed+1, ..., seed+N-1) or an explicit list; every precision runs each"
    )
    threshold: float = Field(
        default=0.02,
        ge=0.0,
        lt=1.0,
        description="largest allowed excess of a precision's loss over the baseline's, as a fraction (0.005 = 0.5%)",
    )
    baseline: Optional[str] = Field(
        default=None, description="the precision others are judged against (default bf16, else the highest)"
    )
    workers: Union[Literal["auto"], int] = Field(
        default="auto", description="runs in parallel (auto: CPU cores / cpu_threads on CPU, 1 on a GPU)"
    )
    tail_fraction: float = Field(
        default=0.2,
        gt=0.0,
        le=1.0,
        description="the last part of training (fraction of logged steps) for the curve gap",
    )
    arms: Optional[dict[str, dict[str, Any]]] = Field(
        default=None,
        description="instead of precisions: named runs, each the config with the keys given changed (trainer keys; "
        "precision: <name> applies a precision's keys first), e.g. {bf16-upcast: {base_model: A}, hf-fp8: "
        "{base_model: B}}; the baseline defaults to the first",
    )
    reuse: bool = Field(
        default=False,
        description="read finished runs of the identical config from the compare directory instead of running them "
        "again (continue an interrupted comparison, or add seeds)",
    )

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: Union[int, list[int]]) -> Union[int, list[int]]:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}: give a number of seeds >= 1 or a list of seeds")
        if isinstance(v, list) and (not v or len(set(v)) != len(v)):
            raise ValueError(f"{v}: list each seed once, at least one")
        return v

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: Union[str, int]) -> Union[str, int]:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}: use auto or a number of processes >= 1")
        return v

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: Optional[dict[str, dict[str, Any]]]) -> Optional[dict[str, dict[str, Any]]]:
        if v is None:
            return v
        if len(v) < 2:
            raise ValueError("give at least two arms (name: {key: value, ...}) to compare")
        for name, keys in v.items():
            if not ARM_NAME.fullmatch(str(name)):
                raise ValueError(f"arm name {name!r}: use letters, digits, '-', '_', '.' or '+' (it names a directory)")
            bad = [k for k in keys if k in COMPARE_MANAGED]
            if bad:
                raise ValueError(
                    f"arms.{name}.{bad[0]}: lowprec compare sets {bad[0]} for every run; drop it from the arm "
                    "(seeds: compare.seeds)"
                )
            if "precision" in keys and not isinstance(keys["precision"], str):
                raise ValueError(f"arms.{name}.precision: give one precision name, e.g. bf16 or fp8-rowwise")
        return v

    @model_validator(mode="after")
    def _arms_or_precisions(self) -> "CompareSpec":
        if self.arms is not None and "precisions" in self.model_fields_set:
            raise ValueError(
                "arms and precisions both given: each arm is a run; drop precisions (an arm may set precision: <name>)"
            )
        return self

    def run_names(self) -> list[str]:
        """The runs' names: the arms', else the precisions."""
        return list(self.arms) if self.arms is not None else list(self.precisions)

    def seed_list(self, base: int) -> list[int]:
        return list(self.seeds) if isinstance(self.seeds, list) else [base + i for i in range(self.seeds)]


class CompareKeys(_Strict):
    """The top-level keys this file adds to :class:`lowprec.train.config.TrainConfig`."""

    fp8_backend: _Backend = Field(
        default=FP8_BACKENDS[0],
        description=f"{FP8_BACKENDS[0]} (lowprec's engine) or "
        + "; ".join(
            f"{n} ({n}'s own FP8 layers; recipes {', '.join(s.trainer_recipes)})" for n, s in trainer_backends().items()
        ),
    )
    compare: Optional[CompareSpec] = Field(
        default=None, description="settings read by `lowprec compare` (precisions, seeds, threshold, workers, ...)"
    )


def check_fp8_backend(cfg) -> None:
    """Cross-field rules of ``fp8_backend: <library backend>`` (called from TrainConfig's validator)."""
    spec = trainer_backends().get(cfg.fp8_backend)
    if spec is None:  # the native engine
        return
    key = f"fp8_backend: {spec.name}"
    if not cfg.fp8:
        raise ValueError(f"{key} needs fp8: true; set fp8: true or drop fp8_backend")
    name = cfg.fp8_recipe.name
    if name not in spec.trainer_recipes:
        raise ValueError(
            f"{key} has no {name!r} recipe; use fp8_recipe: "
            f"{' | '.join(spec.trainer_recipes)} or fp8_backend: {FP8_BACKENDS[0]}"
        )
    if cfg.fp8_recipe.overrides:
        raise ValueError(
            f"fp8_recipe.{next(iter(cfg.fp8_recipe.overrides))}: lowprec recipe fields do not reach "
            f"{spec.name}; drop it or use fp8_backend: {FP8_BACKENDS[0]}"
        )
    if getattr(cfg, "ep_size", 1) > 1:
        raise ValueError(
            f"ep_size: {cfg.ep_size} with {key}: expert parallelism shards lowprec's FP8 experts; drop ep_size "
            f"or use fp8_backend: {FP8_BACKENDS[0]}"
        )
    if cfg.fp8_guard != "off" or cfg.fp8_health:
        raise ValueError(
            f"fp8_guard / fp8_health with {key}: {spec.name}'s layers have no lowprec telemetry; drop them "
            f"or use fp8_backend: {FP8_BACKENDS[0]}"
        )
    if cfg.fp8_force_recompute_fp8_weight_in_bwd != "auto":
        raise ValueError(
            f"fp8_force_recompute_fp8_weight_in_bwd with {key}: {spec.name}'s layers always keep the "
            f"high-precision weight for backward and re-cast it; drop it or use fp8_backend: {FP8_BACKENDS[0]}"
        )
    if cfg.fp8_filter:
        raise ValueError(
            f"fp8_filter with {key}: {spec.name} keeps only the default layers (first/last "
            f"Linear, lm_head, router, gate) in high precision here; drop fp8_filter or use "
            f"fp8_backend: {FP8_BACKENDS[0]}"
        )
