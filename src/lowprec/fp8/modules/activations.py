"""FP8 copies for backward in the non-Linear ops: the SwiGLU product and RMSNorm.

A Float8Linear keeps its input in E4M3 for the weight-gradient GEMM (1 byte/element). The ops
between the Linears keep theirs in high precision: ``silu(gate) * up`` saves ``gate``,
``silu(gate)`` and ``up`` (6 bytes/element in bf16), an RMSNorm its fp32 input and its
normalised output (8 bytes/element when the residual stream is fp32, as under autocast with
fp32 weights). With ``Recipe(fp8_activations=True)`` these ops run as the autograd functions
below: the forward computes exactly what the plain expression computes (same ops, same dtypes,
bit-identical output), and saves only

* SwiGLU: ``gate`` and ``up``, each E4M3 with one float32 scale per row (per token);
* RMSNorm: ``x`` E4M3 with one scale per row, plus the exact float32 ``1/rms`` per row;

and the backward dequantizes them and computes the gradients in float32. Only the saved copies
are rounded, so the output and the loss are unchanged; the gradients carry E4M3's relative
error (3 mantissa bits, at most 2^-4 per element, SQNR about 30 dB per saved operand), the error
level the Float8Linear's own E4M3 input cast already puts on grad_weight. ``tests/
test_fp8_activations.py`` bounds every gradient's SQNR against float64 on fresh random data.

Off by default: gradients change (slightly), so it is an explicit choice. ``convert()`` turns it
on where a module supports it (listed in the report):

* the built-in model (``lowprec.train.model``): ``RMSNorm`` and ``LlamaMLP`` declare a class
  attribute ``fp8_activations`` and call :func:`rms_norm` / :func:`swiglu` when it is set;
* Hugging Face ``LlamaRMSNorm`` and ``LlamaMLP`` (with a SiLU ``act_fn``): the instance's class
  becomes a subclass whose ``forward`` calls the same functions (``isinstance`` checks, the
  state_dict and hooks are unchanged; ``disable`` restores the class).

Inside ``fp8.autocast(enabled=False)``, without autograd, or when no input needs a gradient the
plain expression runs (nothing is saved then anyway).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.autocast import fp8_enabled
from lowprec.fp8.cast.quantize import quantize_axiswise

__all__ = ["swiglu", "rms_norm", "rms_norm_plain", "enable", "disable", "SAVED_DTYPE"]

SAVED_DTYPE = torch.float8_e4m3fn  # 3 mantissa bits: the saved values' relative error <= 2^-4


def _active(*tensors: torch.Tensor) -> bool:
    return fp8_enabled() and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _save_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 data and one float32 scale per row (last dim): rows (tokens) differ in magnitude by
    orders, one tensor scale would flush the small ones into subnormals. Scales are not rounded
    to powers of two (nothing folds them into a GEMM), which halves the worst-case error."""
    q = quantize_axiswise(t.detach().reshape(-1, t.shape[-1]), SAVED_DTYPE, 1, power_of_2=False)
    return q.data, q.scale


def _restore(data: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return (data.to(torch.float32) * scale.reciprocal()).reshape(shape)


class _SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up``; d_up = dy * silu(g), d_gate = dy * up * s * (1 + g * (1 - s)),
    s = sigmoid(g), from the E4M3 copies of gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        out = F.silu(gate) * up  # the plain expression: bit-identical output
        ctx.save_for_backward(*_save_rows(gate), *_save_rows(up))
        ctx.shape, ctx.dtypes = gate.shape, (gate.dtype, up.dtype)
        return out

    @staticmethod
    def backward(ctx, dy):
        gq, gs, uq, us = ctx.saved_tensors
        g, u = _restore(gq, gs, ctx.shape), _restore(uq, us, ctx.shape)
        s = torch.sigmoid(g)
        dy = dy.float()
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:
            d_gate = (dy * u * s * (1 + g * (1 - s))).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            d_up = (dy * g * s).to(ctx.dtypes[1])
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, keeping E4M3 copies of gate and up for backward in an FP8 region."""
    if gate.shape != up.shape or gate.numel() == 0 or not _active(gate, up):
        return F.silu(gate) * up
    return _SwiGLUFn.apply(gate, up)


class _RMSNormFn(torch.autograd.Function):
    """``weight * (x * r).to(x.dtype)``, r = rsqrt(mean(x^2) + eps) in float32 (HF Llama's
    order). With n = x * r and g = dy * weight: dx = r * (g - n * mean(g * n)),
    d_weight = sum over rows of dy * n; r is saved exactly (one float per row), x in E4M3."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (h * r).to(x.dtype)  # the plain expression: bit-identical output
        ctx.save_for_backward(*_save_rows(x), r, weight)
        ctx.shape, ctx.x_dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        xq, xs, r, weight = ctx.saved_tensors
        n = _restore(xq, xs, ctx.shape) * r
        dy = dy.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dy * weight.float()
            dx = (r * (g - n * (g * n).mean(-1, keepdim=True))).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32 whatever the activation dtype (a bf16 mean of
    squares loses ~3 digits), cast back before the weight, as HF Llama does."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, keeping an E4M3 copy of ``x`` for backward in an FP8 region."""
    if x.numel() == 0 or weight.shape != x.shape[-1:] or not _active(x, weight):
        return rms_norm_plain(x, weight, eps)
    return _RMSNormFn.apply(x, weight, eps)


# ---------------------------------------------------------------------- module switch
def _hf_rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _hf_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


# Hugging Face classes whose forward is exactly the expression above (read from transformers'
# modeling_llama.py); matched by name, so transformers is never imported here.
_HF_FORWARDS = {"LlamaRMSNorm": _hf_rms_forward, "LlamaMLP": _hf_mlp_forward}
_SUBCLASSES: dict[type, type] = {}


def _hf_supported(module: nn.Module) -> bool:
    name = type(module).__name__
    if name == "LlamaMLP":  # SwiGLU only when the activation is SiLU (hidden_act: silu)
        return type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    return name == "LlamaRMSNorm" and hasattr(module, "variance_epsilon")


def _fp8_subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": _HF_FORWARDS[cls.__name__], "_lowprec_base": cls})
    return _SUBCLASSES[cls]


def enable(model: nn.Module) -> list[str]:
    """Turn FP8-saved activations on in every supported module; returns their names."""
    names = []
    for fqn, module in model.named_modules():
        if hasattr(type(module), "fp8_activations"):  # declared support (the built-in model)
            module.fp8_activations = True
        elif hasattr(type(module), "_lowprec_base"):  # switched already (convert called twice)
            pass
        elif type(module).__name__ in _HF_FORWARDS and _hf_supported(module):
            module.__class__ = _fp8_subclass(type(module))
        else:
            continue
        names.append(fqn)
    return names


def disable(model: nn.Module) -> int:
    """Undo :func:`enable`; returns how many modules were switched back."""
    count = 0
    for module in model.modules():
        if getattr(module, "fp8_activations", False):
            cast(Any, module).fp8_activations = False  # a plain attribute of ours, not a tensor
            count += 1
        elif hasattr(type(module), "_lowprec_base"):
            module.__class__ = cast(Any, type(module))._lowprec_base
            count += 1
    return count
