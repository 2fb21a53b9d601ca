"""``transformers.Trainer`` (and the trainers built on it) running on ``lowprec.Accelerator``.

    from transformers import Trainer
    from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin

    class FP8Trainer(LowprecAcceleratorMixin, Trainer):  # or (LowprecAcceleratorMixin, SFTTrainer)
        pass

    trainer = FP8Trainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds,
                         kwargs_handlers=[TERecipeKwargs(amax_history_len=16)])  # Accelerate's or lowprec's
    # or no kwargs_handlers and ACCELERATE_MIXED_PRECISION=fp8 (`lowprec launch --mixed_precision fp8`)

Trainer builds its Accelerator in ``create_accelerator_and_postprocess`` from Accelerate's own
objects (``DistributedDataParallelKwargs``, ``GradientAccumulationPlugin``,
``DataLoaderConfiguration``, the FSDP / DeepSpeed / dynamo plugins it was asked for).
``lowprec.Accelerator`` takes those objects as they are (:mod:`lowprec.accelerate_objects`
converts each, or refuses it with one line), so the mixin only has Trainer call our class: the
name ``Accelerator`` in ``transformers.trainer`` is lowprec's for the duration of that one method
(Trainer has no argument for the class; the method is the hook it offers subclasses), and every
step of Trainer's own setup runs unchanged.

Asking for FP8. ``TrainingArguments`` has no ``fp8`` switch and its ``accelerator_config`` takes no
kwargs handlers, so the mixin takes ``kwargs_handlers=`` (FP8 recipe kwargs, Accelerate's or
lowprec's: a recipe means FP8) beside Trainer's own arguments; the launcher's
``ACCELERATE_MIXED_PRECISION=fp8`` works too. Trainer passes ``mixed_precision="bf16"`` when
``bf16=True``, which would drop either request without a word: FP8 runs on bf16 autocast, so the
mixin keeps FP8 (one log line). ``fp16=True`` with FP8 asked is an error.

With FP8 on, the mixin adds :class:`~lowprec.integrations.transformers.FP8Callback` (unless one is
there): FP8 counts and telemetry in Trainer's logs, ``save_pretrained`` without FP8 scaling
state, and that state saved in each checkpoint and restored on resume (Trainer loads a
checkpoint's weights before the Accelerator converts the model, so the state cannot travel in
``model.safetensors``).

For the duration of ``train()`` four more module globals of ``transformers.trainer`` resolve to
lowprec's for lowprec's objects (and to Accelerate's for any other):

* ``skip_first_batches``: resuming mid-epoch, Trainer calls Accelerate's on the prepared loader,
  which would build a plain DataLoader over its sampler and lose the loader's own order;
  lowprec's keeps it, so a resumed run sees the uninterrupted run's batches.
* ``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer``:
  under FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={...})`` or ``lowprec launch
  --use_fsdp``, CPU/gloo included: Accelerate enables FSDP on accelerators only) Trainer saves
  and loads its checkpoints through these Accelerate functions, which read Accelerate's plugin.
  lowprec's write each process's shards through ``torch.distributed.checkpoint`` into
  Accelerate's folder names (``pytorch_model_fsdp_0``, ``optimizer_0``), whatever the
  ``state_dict_type`` (the weights Trainer exports follow it: ``model.safetensors`` with
  ``FULL_STATE_DICT``), and read them back through lowprec's safe reader (nothing unpickled).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from lowprec.accelerate_objects import from_accelerate
from lowprec.accelerator import Accelerator
from lowprec.checkpoint.sharded import load_into
from lowprec.errors import UsageError
from lowprec.fp8_kwargs import RecipeKwargs
from lowprec.kwargs import FullyShardedDataParallelPlugin, env_get
from lowprec.utils.data_loader import DataLoaderShard
from lowprec.utils.data_loader import skip_first_batches as lowprec_skip_first_batches

__all__ = ["LowprecAcceleratorMixin"]

logger = logging.getLogger("lowprec")

# Accelerate's folder names for a sharded FSDP checkpoint: Trainer recognises a checkpoint's model
# and optimizer by them (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``)
FSDP_MODEL_DIR = "pytorch_model_fsdp_{}"
FSDP_OPTIMIZER_DIR = "optimizer_{}"


def _mixed_precision(trainer_value: str | None, recipe: bool) -> str | None:
    """The precision for lowprec's Accelerator: Trainer's, unless FP8 was asked for (a recipe in
    ``kwargs_handlers`` or ``ACCELERATE_MIXED_PRECISION=fp8``) and Trainer's ``bf16=True`` would
    silently replace it."""
    launcher = (env_get("ACCELERATE_MIXED_PRECISION") or "").lower()
    asked = "a recipe in kwargs_handlers" if recipe else "ACCELERATE_MIXED_PRECISION=fp8" if launcher == "fp8" else None
    if asked is None or trainer_value == "fp8":
        return trainer_value
    if trainer_value == "fp16":
        raise UsageError(
            f"FP8 was asked for ({asked}) but TrainingArguments(fp16=True): lowprec's FP8 runs on bf16 "
            "autocast; set bf16=True (or neither)"
        )
    if trainer_value == "bf16":
        logger.info("lowprec: TrainingArguments(bf16=True) and %s: FP8 runs, on bf16 autocast", asked)
    return "fp8"


class LowprecAcceleratorMixin:
    """Put before ``Trainer`` (or ``SFTTrainer``, ...) in the bases: Trainer's accelerator is
    ``lowprec.Accelerator``. ``kwargs_handlers``: extra handlers for it (an FP8 recipe's kwargs,
    Accelerate's classes or lowprec's), added to those Trainer builds."""

    def __init__(self, *args: Any, kwargs_handlers: list | None = None, **kwargs: Any) -> None:
        # Accelerate's objects converted now: a field with no lowprec meaning fails here, in one line
        self._lowprec_handlers = [from_accelerate(h, "kwargs_handlers") for h in kwargs_handlers or []]
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.accelerator.mixed_precision == "fp8":  # type: ignore[attr-defined]
            # transformers and accelerate: optional dependencies, needed by an fp8 run's callback only
            from lowprec.integrations.transformers import FP8Callback

            callbacks = self.callback_handler.callbacks  # type: ignore[attr-defined]
            if not any(isinstance(c, FP8Callback) for c in callbacks):
                callbacks.insert(0, FP8Callback())  # first: reporters (TensorBoard, W&B) see its keys

    def create_accelerator_and_postprocess(self) -> Any:
        from transformers import trainer as hf_trainer  # optional dependency

        extra = getattr(self, "_lowprec_handlers", [])

        def accelerator(**kwargs: Any) -> Accelerator:
            kwargs["kwargs_handlers"] = [*(kwargs.get("kwargs_handlers") or []), *extra]
            kwargs["mixed_precision"] = _mixed_precision(
                kwargs.get("mixed_precision"), any(isinstance(h, RecipeKwargs) for h in extra)
            )
            return Accelerator(**kwargs)

        accelerate_class = hf_trainer.Accelerator
        hf_trainer.Accelerator = accelerator
        try:
            return super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            hf_trainer.Accelerator = accelerate_class

    def train(self, *args: Any, **kwargs: Any) -> Any:
        from transformers import trainer as hf_trainer

        with _lowprec_functions(hf_trainer):
            return super().train(*args, **kwargs)  # type: ignore[misc]


class _lowprec_functions:
    """``transformers.trainer``'s ``skip_first_batches`` and FSDP checkpoint functions resolve
    to lowprec's for lowprec's objects while the block runs (see the module docstring)."""

    NAMES = ("skip_first_batches", "save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")

    def __init__(self, module: Any) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = {n: getattr(self.module, n) for n in self.NAMES if hasattr(self.module, n)}
        for name, theirs in self.saved.items():
            setattr(self.module, name, _dispatch(name, theirs))

    def __exit__(self, *exc: Any) -> None:
        for name, theirs in self.saved.items():
            setattr(self.module, name, theirs)


def _dispatch(name: str, theirs: Any) -> Any:
    table: dict[str, Callable[..., Any]] = {
        "skip_first_batches": _skip_first_batches,
        "save_fsdp_model": save_fsdp_model,
        "load_fsdp_model": load_fsdp_model,
        "save_fsdp_optimizer": save_fsdp_optimizer,
        "load_fsdp_optimizer": load_fsdp_optimizer,
    }
    ours = table[name]
    is_ours: Callable[[tuple], bool] = (
        (lambda a: isinstance(a[0], DataLoaderShard)) if name == "skip_first_batches" else _lowprec_plugin
    )

    def call(*args: Any, **kwargs: Any) -> Any:
        return (ours if is_ours(args) else theirs)(*args, **kwargs)

    return call


def _lowprec_plugin(args: tuple) -> bool:
    return bool(args) and isinstance(args[0], FullyShardedDataParallelPlugin)


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    return lowprec_skip_first_batches(dataloader, num_batches)


def _model_and_state(accelerator: Any, model: Any) -> tuple[Any, dict]:
    """The model out of its wrappers, and its state dict as DCP reads and writes it (shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    inner = accelerator.unwrap_model(model)
    return inner, get_model_state_dict(inner)


def save_fsdp_model(plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, **_: Any) -> None:
    """Collective: every process writes its shards of ``model`` (weights and FP8 scaling state)
    to ``output_dir/pytorch_model_fsdp_<i>``. The whole model, also when Trainer passes
    ``adapter_only`` (a LoRA run resumes from a superset)."""
    import torch.distributed.checkpoint as dcp

    _, state = _model_and_state(accelerator, model)
    directory = os.path.join(output_dir, FSDP_MODEL_DIR.format(model_index))
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(directory))


def load_fsdp_model(plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, **_: Any) -> None:
    """Collective: reads what :func:`save_fsdp_model` wrote (any number of processes)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    inner, state = _model_and_state(accelerator, model)
    loaded = load_into({"model": state}, os.path.join(input_dir, FSDP_MODEL_DIR.format(model_index)))
    set_model_state_dict(inner, loaded["model"])


def save_fsdp_optimizer(plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, **_: Any) -> None:
    """Collective: every process writes its shards of the optimizer state to ``output_dir/optimizer_<i>``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = accelerator.unwrap_model(model)
    state = get_optimizer_state_dict(inner, getattr(optimizer, "optimizer", optimizer))
    directory = os.path.join(output_dir, FSDP_OPTIMIZER_DIR.format(optimizer_index))
    dcp.save({"optimizer": state}, storage_writer=dcp.FileSystemWriter(directory))


def load_fsdp_optimizer(plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, **_: Any) -> None:
    """Collective: reads what :func:`save_fsdp_optimizer` wrote."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = accelerator.unwrap_model(model)
    opt = getattr(optimizer, "optimizer", optimizer)
    directory = os.path.join(input_dir, FSDP_OPTIMIZER_DIR.format(optimizer_index))
    loaded = load_into({"optimizer": get_optimizer_state_dict(inner, opt)}, directory)
    set_optimizer_state_dict(inner, opt, loaded["optimizer"])
