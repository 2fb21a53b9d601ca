"""Per-tensor scale arithmetic on the host, for CPU tensors: the same bits, no scalar kernels.

On CPU a 0-dim tensor op costs a dispatch (~2-5 us) for one multiply. A current-scaling cast
and its GEMM ran ~15 of them per operand (``amax``: aminmax, neg, maximum, to; ``amax_to_scale``:
to float64, clamp, reciprocal, mul, to float32; the GEMM's alpha: two reciprocals, a multiply and
a read), which on the quickstart model's small GEMMs cost more than the element-wise work. Here
the same arithmetic runs on Python floats, which are IEEE doubles, rounded to float32 where torch
rounds, so the results are bit-identical to :mod:`lowprec.fp8.cast.scaling` (checked in
``tests/test_fp8_host_scale.py``):

* float64 ops (``amax_to_scale``) are the same IEEE double ops. Torch evaluates
  ``fp8_max / safe`` as ``safe.reciprocal() * fp8_max`` (``Tensor.__rdiv__``): two roundings,
  reproduced as two here.
* a float32 op is reproduced by the double op rounded once to float32: exact for a product of
  two floats (48 bits fit in 53) and correctly rounded for a quotient (53 >= 2 * 24 + 2 bits,
  so the double rounding is innocuous).

Reading a CPU scalar is no device synchronisation. CUDA tensors never come here.
``power_of_2`` scales stay on the torch path (``log2`` of a double may round differently in
libm and in torch's vectorised kernel).
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import torch

from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.cast.scaling import AMAX_EPS, no_grad_view

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["f32", "reciprocal32", "amax_value", "scale_value", "applies", "delayed_step"]

_F32 = struct.Struct("f")


def f32(v: float) -> float:
    """``v`` rounded to float32 (round to nearest even, as torch's ``.to(torch.float32)``)."""
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:  # finite, rounds past FLT_MAX: infinity, as the C cast gives
        return math.copysign(math.inf, v)


def reciprocal32(v: float) -> float:
    """``torch.reciprocal`` of a float32 value, in float32 (1/0 = inf, as IEEE says)."""
    if v == 0.0:
        return math.copysign(math.inf, v)
    return f32(1.0 / v)


def applies(x: torch.Tensor, power_of_2: bool) -> bool:
    """Whether the host arithmetic stands in for the torch one here: CPU, not under
    ``torch.compile`` (a host read would break the graph), no power-of-two rounding."""
    return x.device.type == "cpu" and not power_of_2 and not torch.compiler.is_compiling()


def amax_value(x: torch.Tensor) -> float:
    """``float(scaling.amax(x))``: one ``aminmax`` pass, two host reads; NaN propagates."""
    lo, hi = torch.aminmax(no_grad_view(x))
    lo_v, hi_v = lo.item(), hi.item()
    if math.isnan(lo_v) or math.isnan(hi_v):
        return math.nan
    return float(max(-lo_v, hi_v))  # exact: the values are those of x's dtype


def scale_value(amax: float, dtype: torch.dtype, margin: int = 0) -> float:
    """``scaling.amax_to_scale(amax, dtype, margin=margin)`` (no power-of-two rounding) as a
    float32 value held in a Python float."""
    safe = amax if (math.isnan(amax) or amax >= AMAX_EPS) else AMAX_EPS  # torch.clamp(min=eps)
    inv = math.inf if safe == 0.0 else 1.0 / safe  # reciprocal() then * fp8_max: Tensor.__rdiv__
    scale = inv * fp8_max(dtype)
    if margin:
        scale = scale / (2.0**margin)
    return f32(scale)


def delayed_step(
    history: torch.Tensor, scale: torch.Tensor, step: torch.Tensor, amax_now: float, dtype: torch.dtype, recipe: Recipe
) -> float:
    """``scaling.delayed_scale_step`` for CPU buffers, with its results written back as the
    caller of that function does (``history``, ``scale`` updated in place); returns the scale
    to cast this step's tensor with. About 25 scalar kernels become 3 host reads and 2 writes."""
    old_max = history.amax().item()  # entries are finite and >= 0: record_amax keeps the rest out
    have_history = old_max > 0
    finite = math.isfinite(amax_now)
    used = scale.item() if have_history else scale_value(amax_now, dtype, recipe.margin)
    if not finite:  # cast with NaN, as current scaling does; the history keeps it out
        used = math.nan
    if finite:  # record_amax: push to the front, drop the oldest
        history.copy_(history.roll(1))
        history[0] = amax_now
    refresh = (step.item() + 1) % recipe.interval == 0 or not have_history
    if refresh:
        if recipe.amax_compute_algo == "max":
            new_amax = history.amax().item()
        elif recipe.amax_compute_algo == "most_recent":
            new_amax = history[0].item()
        else:
            raise ValueError(f"amax_compute_algo={recipe.amax_compute_algo!r}; use 'max' or 'most_recent'")
        scale.fill_(scale_value(new_amax, dtype, recipe.margin))
    else:
        scale.fill_(used)
    return used
