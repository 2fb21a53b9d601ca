"""Optimizer and scheduler wrappers: step only on gradient-sync steps, through the loss scaler."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch

from lowprec.utils.aliases import alias

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "note_replaced", "retarget_scheduler"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a user optimizer. ``step``/``zero_grad`` act only when gradients are synced (the
    last micro-batch of an accumulation window); with a GradScaler, ``step`` goes through
    ``scaler.step`` + ``scaler.update`` and records whether the step was skipped (inf/nan).
    Without a scaler, the non-finite ``guard`` (:mod:`lowprec.utils.nonfinite`) decides."""

    def __init__(
        self,
        optimizer: Any,
        scaler: Any,
        gradient_state: Any,
        after_step: Optional[Callable[[], None]] = None,
        guard: Any = None,
        after_skip: Optional[Callable[[], None]] = None,
    ) -> None:
        # no super().__init__: this object forwards to ``optimizer`` (it is an Optimizer only so
        # that isinstance checks in LR schedulers and user code pass)
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = gradient_state
        self.after_step = after_step
        self.after_skip = after_skip  # the backend discards what the skipped step recorded (FP8 amaxes)
        self.guard = guard
        self._is_overflow = False  # step_was_skipped (Accelerate's attribute name behind it)
        self.unscaled = False
        self._replaced: list = []  # (weak reference to an optimizer a backend replaced, its replacement)

    def replace_optimizer(self, new: Any) -> None:
        """Wrap ``new`` instead (a backend rebuilt the optimizer, e.g. MS-AMP O2's FP8AdamW); LR
        schedulers built on the replaced one are pointed at ``new`` by :func:`retarget_scheduler`."""
        note_replaced(self, self.optimizer, new)
        self.optimizer = new

    step_was_skipped = alias(
        "_is_overflow", "Whether the last ``step`` was skipped (the loss scaler found inf/nan gradients)."
    )

    # forwarding -----------------------------------------------------------------------
    param_groups = alias("optimizer.param_groups")  # type: ignore[assignment]
    state = alias("optimizer.state", settable=False)  # type: ignore[assignment]
    defaults = alias("optimizer.defaults", settable=False)  # type: ignore[assignment]

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return {**self.__dict__, "_replaced": []}  # weak references do not pickle

    def __setstate__(self, state):
        self.__dict__.update(state)

    # behaviour ------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return None
        result = None
        guard = self.guard
        counts, why = True, "loss or gradients not finite"
        if self.scaler is not None:
            if guard is not None and guard.enabled and guard.loss_flag_pending():
                # an inf loss can give finite gradients: hand the loss flag to the scaler's own
                # found-inf check, so one decision (and no extra host read) covers both
                if not self.unscaled:
                    self.scaler.unscale_(self.optimizer)
                    self.unscaled = True
                guard.fold_into_scaler(self.scaler, self.optimizer)
            scale_before = self.scaler.get_scale()
            result = (
                self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
            )
            self.scaler.update()
            # GradScaler lowers the scale exactly when it found inf/nan and skipped the step
            self.step_was_skipped = self.scaler.get_scale() < scale_before
            if self.step_was_skipped and guard is not None:
                # an overflow under a large scale is the scaler's normal work; a non-finite loss,
                # or a scale driven below 1, is a run going wrong
                counts = guard.loss_was_nonfinite() or self.scaler.get_scale() < 1.0
                why = f"gradient scaler found inf/nan (scale lowered to {self.scaler.get_scale():g})"
        elif guard is not None and guard.enabled and guard.step_is_nonfinite(self.optimizer):
            self.step_was_skipped = True
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self.step_was_skipped = False
        self.unscaled = False
        hook = self.after_skip if self.step_was_skipped else self.after_step
        if hook is not None:
            hook()
        if guard is not None:
            guard.record(self.step_was_skipped, counts=counts, why=why)
        return result


class AcceleratedScheduler:
    """Steps the LR scheduler with each real optimizer step (not on accumulation micro-steps,
    not after a step the scaler skipped), ``steps_per_call`` times: Accelerate's rule is one
    step per process, since each optimizer step consumed ``num_processes`` batches of the
    dataloader the schedule was written for (1 with ``split_batches=True``; a schedule with a
    ``total_steps`` is never stepped past it). ``step_with_optimizer=False``
    (``Accelerator(step_scheduler_with_optimizer=False)``) steps it on every call instead. With
    ``adjust_scheduler`` a micro-step still counts the call, so torch's "scheduler before
    optimizer" check stays quiet (Accelerate's behaviour)."""

    def __init__(
        self,
        scheduler: Any,
        optimizers: list,
        gradient_state: Any,
        step_with_optimizer: bool = True,
        adjust_scheduler: bool = True,
        steps_per_call: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.adjust_scheduler = adjust_scheduler
        self.steps_per_call = steps_per_call

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(getattr(o, "step_was_skipped", False) for o in self.optimizers):
            return
        for _ in range(self.steps_per_call):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["scheduler"], name)


def _track_step_called(optimizer: Any) -> None:
    """What torch's LRScheduler does to the optimizer it is built on: ``step`` marks
    ``_opt_called``, so the scheduler's "lr_scheduler.step() before optimizer.step()" check reads
    the optimizer that actually steps."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)  # no reference cycle through the bound method
    inner = optimizer.step
    func = getattr(inner, "__func__", None)

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs) if func is not None else inner(*args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step


def note_replaced(wrapper: Any, old: Any, new: Any) -> None:
    """Record on an optimizer ``wrapper`` (what ``prepare`` returned) that a backend replaced the
    user's optimizer ``old`` by ``new``, for :func:`retarget_scheduler`."""
    if new is not old:
        wrapper._replaced = [*getattr(wrapper, "_replaced", []), (weakref.ref(old), new)]


def retarget_scheduler(scheduler: Any, optimizers: list) -> None:
    """Point ``scheduler`` (and the schedulers a ``SequentialLR`` / ``ChainedScheduler`` holds)
    at the optimizer that now steps, where it was built on one a backend replaced (MS-AMP O2's
    FP8AdamW): otherwise its learning rates would go to an optimizer nobody steps, and the
    schedule would silently not apply."""
    replaced = [pair for opt in optimizers for pair in getattr(opt, "_replaced", ())]
    for sched in (scheduler, *getattr(scheduler, "_schedulers", ())):
        for old, new in replaced:  # in the order of replacement: A -> B, then B -> C
            if old() is getattr(sched, "optimizer", None):
                sched.optimizer = new
                _track_step_called(new)
