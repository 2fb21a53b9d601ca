"""The precision wrapper put around a prepared model's ``forward``.

Order, outermost first: ``torch.autocast`` (bf16 for bf16/fp8, fp16 for fp16), then the FP8
backend's context (FP8 runs on top of bf16 autocast, as in Accelerate), then the model; the
outputs are converted to float32. ``unwrap_model(keep_fp32_wrapper=False)`` removes it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from lowprec.utils.operations import to_fp32

__all__ = ["AUTOCAST_DTYPES", "autocast_context", "PrecisionForward", "wrap_forward", "unwrap_forward"]

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def autocast_context(device_type: str, mixed_precision: str, kwargs: Any = None) -> contextlib.AbstractContextManager:
    dtype = AUTOCAST_DTYPES.get(mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    if kwargs is not None and not kwargs.enabled:
        # an explicit off switch: also turns off an enclosing autocast region
        return torch.autocast(device_type, enabled=False)
    extra = {}
    if kwargs is not None and kwargs.cache_enabled is not None:
        extra["cache_enabled"] = kwargs.cache_enabled
    return torch.autocast(device_type, dtype=dtype, **extra)


class PrecisionForward:
    """A picklable replacement for ``model.forward``."""

    def __init__(
        self,
        model: nn.Module,
        original: Callable,
        autocast: Callable[[], Any],
        fp8: Optional[Callable[[nn.Module], Any]],
    ) -> None:
        self.model = model
        self.original = original
        self.autocast = autocast
        self.fp8 = fp8
        self.__wrapped__ = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():
            with self.fp8(self.model) if self.fp8 is not None else contextlib.nullcontext():
                out = self.original(*args, **kwargs)
        return to_fp32(out)


def wrap_forward(model: nn.Module, autocast: Callable[[], Any], fp8: Optional[Callable[[nn.Module], Any]]) -> None:
    if isinstance(model.__dict__.get("forward"), PrecisionForward):
        return  # prepared before
    cast(Any, model)._original_forward = model.forward  # nn.Module.__setattr__ is typed for tensors and modules
    model.forward = PrecisionForward(model, model.forward, autocast, fp8)


def unwrap_forward(model: nn.Module) -> None:
    """Undo the precision wrapper on ``model.forward``: lowprec's, or Accelerate's convention
    (``model._original_forward`` kept, ``forward`` replaced by ``functools.wraps`` wrappers such
    as ``convert_outputs_to_fp32`` or ``torch.autocast`` used as a decorator), so the model
    pickles again. A forward that does not lead back to ``_original_forward`` is left alone."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, PrecisionForward):
        del model.forward
        model.__dict__.pop("_original_forward", None)
        return
    original = model.__dict__.get("_original_forward")
    if forward is None or original is None:
        return
    inner = forward
    while inner != original and hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    if inner != original:
        return
    del model._original_forward
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is getattr(
        type(model), "forward", None
    ):
        del model.forward  # the class's own method again
    else:
        model.forward = original
