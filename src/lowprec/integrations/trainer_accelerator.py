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

Resuming mid-epoch, Trainer calls Accelerate's ``skip_first_batches`` on the prepared loader; on
lowprec's loader that function would build a plain DataLoader over its sampler and lose the
loader's own order. For the duration of ``train()`` the name resolves to lowprec's for lowprec's
loaders (and to Accelerate's for any other), so a resumed run sees the uninterrupted run's
batches.
"""

from __future__ import annotations

import logging
from typing import Any

from lowprec.accelerator import Accelerator
from lowprec.utils.data_loader import DataLoaderShard
from lowprec.utils.data_loader import skip_first_batches as lowprec_skip_first_batches

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

    def train(self, *args: Any, **kwargs: Any) -> Any:
        from transformers import trainer as hf_trainer

        accelerate_skip = hf_trainer.skip_first_batches

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if isinstance(dataloader, DataLoaderShard):
                return lowprec_skip_first_batches(dataloader, num_batches)
            return accelerate_skip(dataloader, num_batches)

        hf_trainer.skip_first_batches = skip_first_batches
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            hf_trainer.skip_first_batches = accelerate_skip
