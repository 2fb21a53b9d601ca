"""Per-tensor scale arithmetic on the host, for CPU tensors: the same bits, no scalar kernels.

On CPU a 0-dim tensor op costs a dispatch (~2-5 us) for one multiply. A current-scaling cast
and its GEMM ran ~15 of them per operand (``amax``: aminmax, neg, maximum, to; ``amax_to_scale``:
to float64, clamp, reciprocal, mul, to float32; the GEMM's alpha: two reciprocals, a multiply and
a read), which on the quickstart model's small GEMMs cost more than the element-wise work. Here
the same arithmetic runs on Python floats, which are IEEE doubles, rounded to float32 where torch
rounds, so the results are bit-identical to :mod:`lowprec.fp8.scaling` (checked in
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

import torch

from lowprec.fp8.formats import fp8_max
from lowprec.fp8.scaling import AMAX_EPS

__all__ = ["f32", "reciprocal32", "amax_value", "scale_value", "applies"]

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
    lo, hi = torch.aminmax(x.detach())
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
