"""FP8 for ``transformers.Trainer`` and the trainers built on it (TRL's ``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer``; Axolotl).

    from lowprec.integrations.transformers import FP8Callback, enable_fp8

    model = AutoModelForCausalLM.from_pretrained(...)         # or a peft model
    report = enable_fp8(model, recipe="tensorwise")          # converts in place; report.summary()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[FP8Callback()])
    trainer.train()
    model.save_pretrained(out)                                 # plain weights, no FP8 state

Why each piece is what it is:

* **Conversion is the switch** (:mod:`lowprec.fp8.autocast`): a converted layer runs FP8
  wherever it is called, so Trainer's wrappers (Accelerate's ``prepare``, DDP, its own
  ``torch.autocast``) and TRL's direct calls into ``model.base_model`` need nothing more. No
  forward wrapper is installed: a wrapped forward's ``*args, **kwargs`` signature makes Trainer
  drop every dataset column (``remove_unused_columns``).
* **Gradient checkpointing** (``gradient_checkpointing=True``, ``use_reentrant`` either way, TRL's
  default): the engine recognises a recompute and replays the first forward's FP8 decision and
  delayed scales (``fp8.autocast.recomputing_unmarked``); nothing is passed to transformers.
* **peft**: convert before or after ``get_peft_model``; the default rule keeps adapter layers
  (``lora_A``/``lora_B``) in high precision and converts the frozen base layers.
* **save_pretrained writes weights only**: the FP8 scaling state (delayed scaling's amax
  histories, scales and step counters; nvfp4's rounding stream) is training state. Its keys are
  named in each ``PreTrainedModel``'s ``_keys_to_ignore_on_save`` (transformers' own hook, keys
  matched exactly), computed when saving, so a peft merge or a later conversion is covered and
  the checkpoint loads into the plain model with no unexpected keys. Trainer's checkpoints go
  through ``save_pretrained`` too: a resumed run starts delayed histories afresh (they refill
  within ``amax_history_len`` steps). ``lowprec.Accelerator.save_state`` keeps them.
* :class:`FP8Callback` refuses a model with no FP8 layers (never a silent full-precision run),
  warns once if converted layers ran in high precision during training, and adds to Trainer's
  logs: Linear calls in FP8 and in high precision since the last log and, on logging steps, the
  telemetry's worst saturated and underflow fractions.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any, Iterable, Iterator

from torch import nn
from transformers import TrainerCallback

from lowprec import fp8
from lowprec.fp8.convert import DEFAULT_SKIP_PATTERNS, ConversionReport, ModuleFilter

__all__ = ["enable_fp8", "FP8Callback", "fp8_state_keys"]

logger = logging.getLogger("lowprec")

def fp8_state_keys(model: nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``model`` that hold FP8 scaling state, not weights."""
    sd = model.state_dict()
    return set(sd) - set(fp8.plain_state_dict(sd))


class _IgnoreOnSave(Set):
    """``_keys_to_ignore_on_save`` of one PreTrainedModel: the keys it had, plus its FP8 state
    keys as they are when ``save_pretrained`` reads them (iteration and ``len``)."""

    def __init__(self, model: nn.Module, before: Iterable[str] | None) -> None:
        self.model = model  # a strong reference: deepcopy maps it to the copy
        self.before = frozenset(before or ())

    def _keys(self) -> frozenset[str]:
        return self.before | fp8_state_keys(self.model)

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def _strip_fp8_state_on_save(model: nn.Module) -> int:
    """Install :class:`_IgnoreOnSave` on every PreTrainedModel inside ``model`` (a peft model
    holds one); returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "save_pretrained") and hasattr(module, "_keys_to_ignore_on_save"):
            current = module._keys_to_ignore_on_save
            if not isinstance(current, _IgnoreOnSave):
                module._keys_to_ignore_on_save = _IgnoreOnSave(module, current)
            n += 1
    return n


def enable_fp8(
    model: nn.Module,
    recipe: fp8.Recipe | str | None = "tensorwise",
    *,
    module_filter: ModuleFilter | None = None,
    skip_first_last: bool = True,
    skip_patterns: Iterable[str] = DEFAULT_SKIP_PATTERNS,
) -> ConversionReport:
    """Convert ``model`` (a transformers model, or a peft model around one) to FP8 in place for
    ``Trainer``; ``save_pretrained`` then writes plain weights. Arguments as
    :func:`lowprec.fp8.convert`. Raises ``ValueError`` when nothing converts (it would train in
    full precision)."""
    report = fp8.convert(model, recipe, module_filter, skip_first_last=skip_first_last, skip_patterns=skip_patterns)
    if not fp8.has_fp8_layers(model):
        raise ValueError(
            f"enable_fp8: no Linear layer of {type(model).__name__} was converted ({len(report.skipped)} kept in high "
            "precision: see the report's skip reasons); training would run in full precision. Loosen "
            "skip_patterns/module_filter, or train without FP8")
    _strip_fp8_state_on_save(model)
    logger.info("lowprec: %s", report.summary())
    return report


class _Counts:
    """Float8Linear calls in training mode since the last log: FP8 and high precision. A layer
    records its decision on each call (``_fp8_forward_recipe``); a forward hook reads it."""

    def __init__(self) -> None:
        self.fp8 = self.hp = 0
        self.handles: list = []

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            if module.__dict__.get("_fp8_forward_recipe") is not None:
                self.fp8 += 1
            else:
                self.hp += 1

    def attach(self, model: nn.Module) -> int:
        if not self.handles:
            layers = [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]
            self.handles = [m.register_forward_hook(self.hook) for m in layers]
        return len(self.handles)


def _worst(model: nn.Module) -> dict[str, float]:
    """The largest saturated and underflow fractions over every layer and operand."""
    rows = [op for layer in fp8.telemetry(model).values() for op in layer.values() if op["scale"] > 0]
    if not rows:
        return {}
    return {"fp8_saturated_max": max(r["saturated"] for r in rows),
            "fp8_underflow_max": max(r["underflow"] for r in rows)}


class FP8Callback(TrainerCallback):
    """Trainer callback for a model converted with :func:`enable_fp8` or ``lowprec.fp8.convert``
    (see the module docstring). Pass it in ``Trainer(callbacks=[...])``; for reporters that run
    before it (TensorBoard, W&B) to see its keys, insert it first:
    ``trainer.callback_handler.callbacks.insert(0, FP8Callback())``.

    Args:
        telemetry: collect FP8 statistics on the steps that log (two extra elementwise passes
            per cast on those steps only) and add the worst fractions to the logs.
    """

    def __init__(self, telemetry: bool = True) -> None:
        self.telemetry = telemetry
        self.counts = _Counts()
        self.model: nn.Module | None = None
        self._warned = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or not fp8.has_fp8_layers(model):
            raise ValueError(
                "FP8Callback: the model has no FP8 layers, so it would train in full precision; call "
                "lowprec.integrations.transformers.enable_fp8(model) before building the Trainer")
        self.model = model
        n = self.counts.attach(model)
        logger.info("lowprec: %d FP8 layer(s) under Trainer; FP8 on wherever they run in training mode, off inside "
                    "lowprec.fp8.autocast(enabled=False)", n)

    def _logs_next_step(self, args, state) -> bool:
        strategy = getattr(args, "logging_strategy", "steps")
        every = getattr(state, "logging_steps", None) or args.logging_steps  # state's: a ratio resolved
        return getattr(strategy, "value", strategy) == "steps" and bool(every) and (state.global_step + 1) % int(every) == 0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.telemetry and self.model is not None and self._logs_next_step(args, state):
            fp8.enable_telemetry(self.model)

    def on_step_end(self, args, state, control, **kwargs):
        if self.telemetry and self.model is not None:
            fp8.disable_telemetry(self.model)  # the statistics of this step stay in the buffers

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.model is None:  # training logs only
            return
        extra: dict[str, float] = {"fp8_linear_calls": self.counts.fp8, "hp_linear_calls": self.counts.hp}
        if self.counts.hp and not self.counts.fp8 and not self._warned:
            self._warned = True
            logger.warning("lowprec: the converted layers ran %d call(s) in high precision and none in FP8 since the "
                           "last log (inside lowprec.fp8.autocast(enabled=False)?)", self.counts.hp)
        if self.telemetry:
            extra.update(_worst(self.model))
        self.counts.fp8 = self.counts.hp = 0
        logs.update(extra)
        # Trainer stored a copy before calling the callbacks: keep the history complete too
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
