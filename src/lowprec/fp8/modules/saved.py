"""What a linear layer's autograd function keeps for backward, saved and given back.

Both autograd functions (``linear._Float8LinearFn`` and ``mx_linear._MXLinearFn``) keep two
operands, each a plain tensor, ``None`` or a quantized dataclass (:class:`Float8Data`,
:class:`BlockScaledData`). Every tensor goes through one ``ctx.save_for_backward`` so that
saved-tensor hooks (CPU offload, ``fp8.checkpoint``) see the FP8 data and scales, not only the
high-precision ones; the dataclass's other fields (granularity, block, ...) ride along in
``ctx``. A field marked ``metadata={"saved": False}`` (Float8Data's bf16 upcast cache) is
dropped: it is a cache, rebuilt where needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

__all__ = ["save_operands", "saved_operands"]

_TENSOR = object()  # "this field / operand was a tensor, see saved_tensors"


def _split(item: Any, tensors: list) -> Any:
    if item is None:
        return None
    if isinstance(item, torch.Tensor):
        tensors.append(item)
        return _TENSOR
    fields = {}
    for f in dataclasses.fields(item):
        if not f.metadata.get("saved", True):
            continue
        value = getattr(item, f.name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            value = _TENSOR
        fields[f.name] = value
    return (type(item), fields)


def _join(meta: Any, tensors: list) -> Any:
    if meta is None or meta is _TENSOR:
        return None if meta is None else tensors.pop(0)
    cls, fields = meta
    return cls(**{k: tensors.pop(0) if v is _TENSOR else v for k, v in fields.items()})


def save_operands(ctx, operands: Sequence[Any], **attrs: Any) -> None:
    """``ctx.save_for_backward`` every tensor of ``operands``; ``attrs`` set on ``ctx``."""
    tensors: list = []
    ctx.operand_meta = [_split(item, tensors) for item in operands]
    ctx.save_for_backward(*tensors)
    for name, value in attrs.items():
        setattr(ctx, name, value)


def saved_operands(ctx) -> list:
    """The operands given to :func:`save_operands`, rebuilt from ``ctx.saved_tensors``."""
    tensors = list(ctx.saved_tensors)
    return [_join(meta, tensors) for meta in ctx.operand_meta]
