"""Model helpers with Accelerate's names: unwrap a model from its wrappers, build one without
allocating its weights."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from lowprec.utils.precision import unwrap_forward

__all__ = ["extract_model_from_parallel", "init_empty_weights", "init_on_device"]


def _is_wrapper(model: nn.Module) -> bool:
    return (
        isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        or type(model).__name__ == "DeepSpeedEngine"
    )


def extract_model_from_parallel(
    model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> nn.Module:
    """The user's model inside DDP / DataParallel / DeepSpeed and ``torch.compile`` wrappers.
    With ``keep_torch_compile`` a compiled model stays compiled (its ``_orig_mod`` unwrapped);
    ``keep_fp32_wrapper=False`` also removes lowprec's precision wrapper from ``forward``."""
    compiled = model if hasattr(model, "_orig_mod") else None
    if compiled is not None:
        model = model._orig_mod
    while True:
        if _is_wrapper(model):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # compiled inside a wrapper
            model = model._orig_mod
        else:
            break
    if not keep_fp32_wrapper:
        unwrap_forward(model)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


@contextlib.contextmanager
def init_on_device(device: torch.device, include_buffers: bool = False) -> Iterator[None]:
    """Modules built inside get their parameters (and buffers, if asked) on ``device``."""
    old_param, old_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param) -> None:
        old_param(module, name, param)
        if param is not None:
            cls = type(module._parameters[name])
            kwargs = module._parameters[name].__dict__
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = cls(module._parameters[name].to(device), **kwargs)

    def register_buffer(module: nn.Module, name: str, buffer, persistent: bool = True) -> None:
        old_buffer(module, name, buffer, persistent=persistent)
        if buffer is not None:
            module._buffers[name] = module._buffers[name].to(device)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = old_param  # type: ignore[method-assign]
        nn.Module.register_buffer = old_buffer  # type: ignore[method-assign]


def init_empty_weights(include_buffers: bool = False):
    """Build a model without allocating its weights: parameters land on the ``meta`` device
    (materialize them later with ``to_empty`` or a checkpoint load)."""
    return init_on_device(torch.device("meta"), include_buffers=include_buffers)
