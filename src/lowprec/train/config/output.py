"""Trainer keys for what a run writes and watches: logs, evaluation, checkpoints, progress."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from lowprec.catalog import export_holds, kind_info, recipe_info
from lowprec.train.config.base import StrictModel, off_warn_act

__all__ = ["OutputKeys"]


class OutputKeys(StrictModel):
    output_dir: str = Field(
        default="./outputs/lowprec-run", description="where metrics, plots, checkpoints and the model go"
    )
    logging_steps: int = Field(default=10, ge=1, description="log (and FP8 telemetry) every N steps")
    eval_steps: Optional[Union[int, float]] = Field(
        default=None,
        description="validate every N steps, or a fraction of the run's steps below 1 (Axolotl's float form) "
        "(null: at the end only; needs val_set_size > 0)",
    )
    evals_per_epoch: Optional[int] = Field(
        default=None, ge=1, description="validate this many times per epoch (instead of eval_steps)"
    )
    eval_batches: int = Field(default=20, ge=1, description="validation batches per evaluation")
    eval_table_size: Optional[int] = Field(
        default=None,
        ge=0,
        le=1024,
        description="at each evaluation, greedy generations for this many validation "
        "prompts (the same ones every time), written to metrics.jsonl (kind: generations), TensorBoard text and "
        "eval_generations.md (0 or null: none)",
    )
    eval_max_new_tokens: Optional[int] = Field(
        default=None,
        ge=1,
        description="tokens generated per eval_table_size prompt (default 128, at most half of "
        "sequence_len); prompt and generation share sequence_len",
    )
    save_steps: Optional[Union[int, float]] = Field(
        default=None,
        description="checkpoint every N steps, or a fraction of the run's steps below 1 (Axolotl's float form) "
        "(null: no checkpoints)",
    )
    saves_per_epoch: Optional[int] = Field(
        default=None, ge=1, description="checkpoint this many times per epoch (instead of save_steps)"
    )
    save_total_limit: Optional[int] = Field(default=2, ge=1, description="keep the last N checkpoints (null: all)")
    resume_from_checkpoint: Optional[str] = Field(
        default=None, description="auto (latest checkpoint in output_dir, if any) or a checkpoint directory"
    )
    use_tensorboard: Union[Literal["auto"], bool] = Field(
        default="auto", description="TensorBoard events in output_dir/runs (auto: when tensorboard is installed)"
    )
    cpu_threads: Optional[int] = Field(
        default=None,
        ge=1,
        description="intra-op CPU threads per process (null: torch's default, OMP_NUM_THREADS or all cores)",
    )
    progress_bar: bool = Field(default=True, description="show a tqdm progress bar (loss, tokens/s, lr, memory)")
    skip_nonfinite_steps: bool = Field(
        default=True, description="skip an optimizer step whose loss or gradients hold NaN/inf (weights unchanged)"
    )
    loss_watchdog_threshold: Optional[float] = Field(
        default=None, gt=0, description="stop (exit code 3) when the training loss stays above this (null: never)"
    )
    loss_watchdog_patience: Optional[int] = Field(
        default=None,
        ge=1,
        description="optimizer steps in a row above loss_watchdog_threshold before stopping (default 3)",
    )
    loss_spike: Union[Literal["off", "warn", "act"], bool] = Field(
        default="off",
        description="loss-spike detector (robust z-score of the step's loss over loss_spike_window steps): warn logs "
        "each spike; act also rolls back to the last checkpoint and skips the batches that produced it",
    )
    loss_spike_window: int = Field(default=50, ge=5, description="optimizer steps the loss-spike z-score is taken over")
    loss_spike_zscore: float = Field(
        default=6.0, gt=0, description="robust z-score above which a step's loss is a spike"
    )
    loss_spike_max_rollbacks: int = Field(
        default=3, ge=1, description="loss_spike: act rolls back at most this many times, then stops (exit code 3)"
    )
    early_stopping_patience: Optional[int] = Field(
        default=None,
        ge=1,
        description="end training after this many evaluations in a row without a lower validation loss",
    )
    strict: bool = Field(default=False, description="true: a --key flag may only change a key the YAML file sets")
    max_consecutive_skipped_steps: Optional[int] = Field(
        default=3, ge=1, description="stop (exit code 3) after this many skipped steps in a row (null: never)"
    )

    export: list[Literal["hf-fp8", "compressed-tensors"]] = Field(
        default_factory=list,
        description="FP8 formats written at the end of training to output_dir/<format> "
        "(hf-fp8, compressed-tensors), as `lowprec export` does",
    )

    @model_validator(mode="after")
    def _export(self) -> "OutputKeys":
        # other topics' keys, read where TrainConfig combines them; absent on OutputKeys alone
        sharded = getattr(self, "fsdp_version", None) is not None or getattr(self, "deepspeed", None) is not None
        if self.export and sharded:
            raise ValueError(
                "export: needs the whole model in one process; under FSDP2 / DeepSpeed drop export and "
                "run `lowprec export OUTPUT_DIR --format F --out DIR` after training"
            )
        if self.export and getattr(self, "adapter", None):
            raise ValueError(
                "export: writes full FP8 models; with adapter: lora drop export and run `lowprec export "
                "OUTPUT_DIR --format F --out DIR` after training (it merges the adapter into the base and exports that)"
            )
        recipe = getattr(getattr(self, "fp8_recipe", None), "name", None)
        trained = kind_info(recipe_info(recipe).scaling) if recipe else None
        unheld = [f for f in self.export if trained is not None and not export_holds(f, trained)]
        if unheld and trained is not None and getattr(self, "fp8", None):  # unheld lists formats only with trained set
            held = " (compressed-tensors holds them)" if export_holds("compressed-tensors", trained) else ""
            raise ValueError(
                f"export: fp8_recipe {recipe} trains microscaled weights that {', '.join(unheld)} does not "
                f"hold{held}; drop {', '.join(unheld)} from export (or run `lowprec export ... --requantize` "
                "after training)"
            )
        return self

    @field_validator("eval_steps", "save_steps")
    @classmethod
    def _steps(cls, v: Optional[Union[int, float]], info: Any) -> Optional[Union[int, float]]:
        # Axolotl (transformers): an integer is every N steps, a float below 1 a fraction of the
        # run's steps, resolved once the run's length is known (resolve.total_steps)
        if v is None or (isinstance(v, int) and v >= 1) or (isinstance(v, float) and 0 < v < 1):
            return v
        if isinstance(v, float) and v.is_integer() and v >= 1:
            return int(v)
        raise ValueError(
            f"{v}: give a number of steps (1 or more) or a fraction of the run's steps between 0 and 1 "
            f"(e.g. {info.field_name}: 0.25)"
        )

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume(cls, v: Any) -> Any:
        # transformers' resume_from_checkpoint=True (the latest checkpoint); false asks for nothing
        if v is True:
            raise ValueError(
                "true: use resume_from_checkpoint: auto (the latest checkpoint in output_dir) or a "
                "checkpoint-<step> directory"
            )
        return None if v is False else v

    @field_validator("loss_spike")
    @classmethod
    def _spike(cls, v: Union[str, bool]) -> str:
        return off_warn_act("loss_spike", v, "roll back")

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str) -> str:
        # '' is the working directory, where checkpoint rotation would delete checkpoint-*
        # directories the run did not write: an explicit "." is still allowed
        if not v.strip():
            raise ValueError(
                f"{v!r} is empty, which would write (and rotate checkpoints) in the working "
                "directory; give a directory such as ./outputs/run (or . to mean it)"
            )
        return v
