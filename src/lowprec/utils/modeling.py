"""Model helpers with Accelerate's names: unwrap a model from its wrappers, build one without
allocating its weights."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, cast

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
        model = cast(nn.Module, model._orig_mod)
    while True:
        if _is_wrapper(model):
            model = cast(nn.Module, model.module)
        elif hasattr(model, "_orig_mod"):  # compiled inside a wrapper
            model = cast(nn.Module, model._orig_mod)
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

    # nn.Module's own signatures (argument names too): ``register_buffer(name, tensor=...)`` keeps working
    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        old_param(self, name, param)
        if param is not None:
            registered = cast(nn.Parameter, self._parameters[name])  # ``param``, just registered
            cls = type(registered)
            kwargs = registered.__dict__
            kwargs["requires_grad"] = param.requires_grad
            self._parameters[name] = cls(registered.to(device), **kwargs)

    def register_buffer(self: nn.Module, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        old_buffer(self, name, tensor, persistent=persistent)
        if tensor is not None:
            self._buffers[name] = cast(torch.Tensor, self._buffers[name]).to(device)

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
