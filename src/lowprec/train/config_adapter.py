"""Trainer keys for parameter-efficient adapters (``adapter: lora | qlora``, ``lora_*``).

Filled by the adapters work (issue 13 part 3); empty until then, so a ``lora_r`` key is still an
unknown-key error. Part of :class:`lowprec.train.config.TrainConfig`'s bases."""

from __future__ import annotations

from lowprec.train.config_base import StrictModel

__all__ = ["AdapterKeys"]


class AdapterKeys(StrictModel):
    pass
