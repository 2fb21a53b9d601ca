"""FP8 for transformers' ``Conv1D`` (GPT-2, GPT-J-style checkpoints): a Linear whose weight is
stored transposed, (in, out), computing ``y = x @ W + b``.

:class:`Float8Conv1D` is a :class:`Float8Linear` that keeps that layout: the same ``weight``
Parameter (in, out) and ``bias``, so ``state_dict`` keys and shapes are exactly those of the
``Conv1D`` it replaces and GPT-2 checkpoints load before and after conversion. The GEMMs read
``weight.t()`` (out, in), made contiguous: one high-precision copy of the weight per forward,
which autograd transposes back into the (in, out) gradient. That copy costs less than teaching
every cast and GEMM path a second weight layout for one layer type.

Detected by duck typing (class name ``Conv1D`` with an ``nf`` attribute), so lowprec does not
import transformers.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lowprec.fp8.modules.linear import Float8Linear, _copy_hooks, plain_module
from lowprec.fp8.recipes import Recipe

__all__ = ["Float8Conv1D", "is_conv1d", "gemm_dims"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D (or a module of the same shape), not yet converted."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def gemm_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or a Conv1D."""
    if is_conv1d(module):
        nx, nf = cast(torch.Tensor, module.weight).shape
        return int(nx), int(nf)
    linear = cast(nn.Linear, module)
    return linear.in_features, linear.out_features


class Float8Conv1D(Float8Linear):
    """``Conv1D`` with FP8 GEMMs (off inside ``fp8.autocast(enabled=False)``); weight stored (in, out)."""

    nx: int  # Conv1D's own names for in_features and out_features
    nf: int
    _conv1d_cls: type[nn.Module]

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: Recipe) -> "Float8Conv1D":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = gemm_dims(conv)
        new.nx, new.nf = new.in_features, new.out_features
        new.weight, new.bias = (
            cast(nn.Parameter, conv.weight),
            cast(nn.Parameter, conv.bias),
        )  # bias: or None, as nn.Linear allows
        new.train(conv.training)
        _copy_hooks(conv, new)
        new._init_fp8(recipe)
        new._conv1d_cls = type(conv)
        return new

    def gemm_weight(self) -> torch.Tensor:
        return self.weight.t().contiguous()

    def to_linear(self) -> nn.Module:
        """The original ``Conv1D`` class with the same Parameters (what ``unconvert`` restores)."""
        return plain_module(self, self._conv1d_cls, nx=self.in_features, nf=self.out_features)

    def reset_parameters(self) -> None:
        """Conv1D's own initialisation (normal, std 0.02; zero bias) and fresh FP8 state."""
        with torch.no_grad():
            nn.init.normal_(self.weight, std=0.02)
            if self.bias is not None:
                nn.init.zeros_(self.bias)
        if hasattr(self, "fp8_stats"):
            self.reset_fp8_state()

    def extra_repr(self) -> str:
        return f"nx={self.in_features}, nf={self.out_features}, recipe={self.recipe.name} (weight stored in x out)"
