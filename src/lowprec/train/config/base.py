"""What every part of the trainer schema shares: the strict frozen base model and the YAML
spelling of a value in messages. The schema itself is split by topic into mixins
(``config.model``, ``config.data``, ``config.optim``, ``config.output``, ``config.fp8``,
``config.dist``, ``config.adapter``) that :class:`lowprec.train.config.TrainConfig` composes by
multiple inheritance, so the YAML stays one flat mapping as in Axolotl."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel", "yaml_text", "off_warn_act"]


class StrictModel(BaseModel):
    """Unknown keys are errors; values are frozen once validated; defaults validate too.

    Types are strict (pydantic's strict mode): YAML already gives ints, floats and booleans
    their own types, so the coercions lax mode adds only hide mistakes (``max_steps: true`` ran
    one step, ``max_steps: 1.0e+30`` became a 31-digit int, ``fp16: 1`` a bool). An int is
    still a valid float. Floats must be finite: ``learning_rate: .inf`` is an error, not a run
    whose weights turn to inf."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)


def yaml_text(v: Any) -> str:
    """``v`` as the user would write it in YAML (``true``, ``[a, b]``), for error messages."""
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def off_warn_act(key: str, v: Any, act: str) -> Any:
    """An ``off | warn | act`` key: YAML 1.1 reads a bare ``off`` as false (accepted as off);
    ``true`` says neither warn nor act, so it is refused with both spelled out."""
    if v is False:
        return "off"
    if v is True:
        raise ValueError(f"{key}: true is ambiguous; use {key}: warn (log) or {key}: act ({act})")
    return v
