"""Where lowprec's defaults are not Axolotl's: said once for a run on a Hugging Face model.

An Axolotl config leaves out keys whose Axolotl defaults differ from lowprec's (chosen for the
built-in models and corpus). Such a run trains otherwise than under Axolotl; the trainer says
which keys and values, as one resolved setting, so that nothing differs without a word."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["AXOLOTL_DEFAULTS", "differing_defaults"]

# key -> (Axolotl's default, as it reads); lowprec's own default comes from the schema
AXOLOTL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "val_set_size": (0.0, "0.0"),
    "sequence_len": (512, "512"),
    "micro_batch_size": (1, "1"),
    "adam_beta2": (0.999, "0.999 (torch AdamW's)"),
    # Axolotl's trainer builder passes save_total_limit or 4: its null (and its default) keep 4
    "save_total_limit": (4, "4"),
}


def differing_defaults(cfg: Any) -> Optional[str]:
    """``"val_set_size 0.03 (Axolotl: 0.0), ..."`` for the keys the config leaves out whose
    lowprec default is not Axolotl's, on a Hugging Face base model; None otherwise."""
    if str(cfg.base_model).startswith("builtin:"):
        return None
    given = cfg.model_fields_set
    parts = [
        f"{key} {getattr(cfg, key)} (Axolotl: {shown})"
        for key, (value, shown) in AXOLOTL_DEFAULTS.items()
        if key not in given and getattr(cfg, key) != value
    ]
    if "save_total_limit" in given and cfg.save_total_limit is None:
        parts.insert(0, "save_total_limit null: every checkpoint kept (Axolotl: 4)")
    if "warmup_steps" not in given and "warmup_ratio" not in given:
        # Axolotl's trainer builder without either key: min(int(0.03 x total steps), 100)
        parts.append(f"warmup_steps {cfg.warmup_steps} (Axolotl: 3% of the run's steps, at most 100)")
    if "save_steps" not in given and "saves_per_epoch" not in given:
        parts.append("no save_steps / saves_per_epoch: no checkpoints (Axolotl: one per epoch)")
    return "; ".join(parts) or None
