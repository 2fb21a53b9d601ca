"""Axolotl keys that do nothing given the rest of the config: accepted with one note, not an error.

Axolotl's own configs carry keys that only matter next to another one: its llama-3 instruct
example sets ``eval_max_new_tokens: 128`` with ``eval_table_size`` unset, 53 of its examples
set ``evals_per_epoch`` with ``val_set_size: 0``, its archived ones ``lora_r: 8`` under an
empty ``adapter:``. Axolotl reads such a key nowhere; so does lowprec. Each row of
:data:`RULES` says "these keys only matter when that is so", with where Axolotl decides it
(axolotl-ai-cloud/axolotl, src/axolotl/, read 2026-11 at 067b021). A key a rule finds inert is
dropped before the schema sees it, so it can be neither an error ("an Axolotl key lowprec does
not support", "lora_r is set but adapter is not") nor a setting, and the run logs one note.

Rules are applied until nothing changes: ``eval_max_new_tokens`` under ``eval_table_size: 4``
is inert too when ``val_set_size: 0`` makes ``eval_table_size`` inert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lowprec.train.axolotl_keys import AXOLOTL_DEFAULTS
from lowprec.train.config.adapter import LORA_KEYS
from lowprec.train.config.base import yaml_text

__all__ = ["Inert", "RULES", "inert_keys"]

Get = Callable[[str], Any]


@dataclass(frozen=True)
class Inert:
    """``keys`` do nothing unless ``live(get)``; ``needs`` says what would make them matter."""

    keys: tuple[str, ...]
    needs: str
    live: Callable[[Get], bool]
    axolotl: str  # where Axolotl ignores them (for the reader of this table)


def _positive(key: str) -> Callable[[Get], bool]:
    return lambda get: isinstance(get(key), (int, float)) and not isinstance(get(key), bool) and get(key) > 0


def _any_set(*keys: str) -> Callable[[Get], bool]:
    return lambda get: any(get(k) not in (None, False, "") for k in keys)


RULES: tuple[Inert, ...] = (
    Inert(
        ("eval_steps", "evals_per_epoch", "eval_table_size", "eval_sample_packing", "eval_batch_size"),
        "val_set_size above 0",
        _positive("val_set_size"),
        "core/builders/base.py _configure_save_and_eval_strategy: eval_strategy 'no' without eval data",
    ),
    Inert(
        ("eval_max_new_tokens",),
        "eval_table_size above 0",
        _positive("eval_table_size"),
        "utils/callbacks LogPredictionCallback.on_evaluate returns when eval_table_size <= 0 (its default)",
    ),
    Inert(
        (
            "num_generation_samples",
            "generation_max_new_tokens",
            "generation_temperature",
            "generation_top_p",
            "generation_top_k",
            "generation_prompt_ratio",
            "generation_do_sample",
        ),
        "generate_samples: true",
        _any_set("generate_samples"),
        "utils/callbacks/generation.py SFTGenerationCallback returns without generate_samples",
    ),
    Inert(
        (*LORA_KEYS, "lora_model_dir"),
        "adapter (lora or qlora)",
        _any_set("adapter"),
        "loaders/adapter.py load_adapter returns the model unchanged when adapter is None",
    ),
    Inert(
        ("loss_watchdog_patience",),
        "loss_watchdog_threshold",
        _any_set("loss_watchdog_threshold"),
        "core/builders/causal.py adds LossWatchDogCallback only when loss_watchdog_threshold is set",
    ),
    Inert(
        ("gradient_checkpointing_kwargs",),
        "gradient_checkpointing: true",
        _any_set("gradient_checkpointing", "activation_offloading"),
        "core/builders/base.py _configure_gradient_checkpointing; transformers reads the kwargs only when checkpointing",
    ),
    Inert(
        ("torch_compile_backend", "torch_compile_mode", "torch_compile_options"),
        "torch_compile",
        _any_set("torch_compile"),
        "core/builders/base.py _configure_torch_compile",
    ),
    Inert(
        ("hub_strategy", "hub_revision"),
        "hub_model_id",
        _any_set("hub_model_id"),
        "core/builders/base.py _configure_hub_parameters",
    ),
    Inert(
        ("wandb_entity", "wandb_name", "wandb_run_id", "wandb_mode", "wandb_watch", "wandb_log_model"),
        "wandb_project (or use_wandb)",
        _any_set("wandb_project", "use_wandb"),
        "utils/wandb_.py: use_wandb only with wandb_project; the variables it exports are read by wandb alone",
    ),
    Inert(
        ("mlflow_tracking_uri", "mlflow_run_name", "hf_mlflow_log_artifacts"),
        "mlflow_experiment_name (or use_mlflow)",
        _any_set("mlflow_experiment_name", "use_mlflow"),
        "utils/mlflow_.py: use_mlflow only with mlflow_experiment_name; the variables it exports are read by mlflow alone",
    ),
)

# values that ask for nothing even where the key matters: Axolotl's defaults (0 is eval_table_size's "off";
# eval_max_new_tokens' 128 is left out: its llama-3 example sets it, and the user is told once)
_OFF: dict[str, Any] = AXOLOTL_DEFAULTS


def _asks(key: str, value: Any) -> bool:
    return value is not None and value is not False and not (key in _OFF and value == _OFF[key])


def inert_keys(data: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, str]:
    """{key: note} for every key of ``data`` that asks for something no rule lets it do.
    ``defaults`` gives the value of a key ``data`` leaves out (the schema's defaults: lowprec's
    ``val_set_size`` is 0.03 where Axolotl's is 0)."""
    dropped: dict[str, str] = {}

    def get(key: str) -> Any:
        if key in dropped:
            return None
        return data[key] if key in data and data[key] is not None else defaults.get(key)

    changed = True
    while changed:
        changed = False
        for rule in RULES:
            if rule.live(get):
                continue
            for key in rule.keys:
                if key in data and key not in dropped and _asks(key, data[key]):
                    dropped[key] = (
                        f"{key}: {yaml_text(data[key])} is ignored: it only matters with {rule.needs}, "
                        f"as in Axolotl; set that or drop {key}"
                    )
                    changed = True
    return dropped
