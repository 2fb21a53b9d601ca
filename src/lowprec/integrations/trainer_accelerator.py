"""``transformers.Trainer`` (and the trainers built on it) running on ``lowprec.Accelerator``.

    from transformers import Trainer
    from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin

    class FP8Trainer(LowprecAcceleratorMixin, Trainer):  # or (LowprecAcceleratorMixin, SFTTrainer)
        pass

    trainer = FP8Trainer(model=model, args=TrainingArguments(..., mixed_precision="fp8"), ...)

Trainer builds its Accelerator in ``create_accelerator_and_postprocess`` from Accelerate's own
objects (``DistributedDataParallelKwargs``, ``GradientAccumulationPlugin``,
``DataLoaderConfiguration``, the FSDP / DeepSpeed / dynamo plugins it was asked for).
``lowprec.Accelerator`` takes those objects as they are (:mod:`lowprec.accelerate_objects`
converts each, or refuses it with one line), so the mixin only has Trainer call our class: the
name ``Accelerator`` in ``transformers.trainer`` is lowprec's for the duration of that one method
(Trainer has no argument for the class; the method is the hook it offers subclasses), and every
step of Trainer's own setup runs unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from lowprec.accelerator import Accelerator

__all__ = ["LowprecAcceleratorMixin"]

logger = logging.getLogger("lowprec")


class LowprecAcceleratorMixin:
    """Put before ``Trainer`` (or ``SFTTrainer``, ...) in the bases: Trainer's accelerator is
    ``lowprec.Accelerator``."""

    def create_accelerator_and_postprocess(self) -> Any:
        from transformers import trainer as hf_trainer  # optional dependency

        accelerate_class = hf_trainer.Accelerator
        hf_trainer.Accelerator = Accelerator
        try:
            return super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            hf_trainer.Accelerator = accelerate_class
