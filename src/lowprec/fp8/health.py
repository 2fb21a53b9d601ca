"""FP8 health signals per layer and operand, cheap enough to leave on (issue 27).

From the telemetry a step already records (``telemetry.py``: amax, scale, saturated and
underflow fractions of x, W and dY) and two readings a :class:`HealthProbe` takes in the
forward of the same step:

==================  =========================================================================
signal              meaning
==================  =========================================================================
saturated           fraction of values clipped at the format's max (telemetry)
underflow           fraction of non-zero values flushed to 0 (telemetry)
saturated_trend     change of ``saturated`` since the previous check of this layer
underflow_trend     change of ``underflow`` since the previous check
headroom_bits       log2(fmt_max / (amax * scale)): how far the scaled amax sits below the
                    format's max (0 = at the max, < 0 = clipping; per-tensor recipes; for
                    rowwise/blockwise ``scale`` is the tensor's smallest, so it is a bound)
max_to_rms          (input only) max|x| / rms(x): the activation outlier indicator of the FOG
                    and Smooth-SwiGLU papers (a growing SwiGLU channel shows here first)
sqnr_db             (layer) 10 log10(|Y_ref|^2 / |Y - Y_ref|^2) of the forward GEMM's output
                    against a float32 shadow GEMM of the same inputs, sampled 1 step in N
==================  =========================================================================

The probe is a forward hook installed only when health is on; it reads the layer's input and
output under ``no_grad`` and changes no value of the step (training with it is bit-identical).
Pure functions below; the guard that acts on them is ``guard.py``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.formats import fp8_max
from lowprec.fp8.linear import Float8Linear
from lowprec.fp8.tp_linear import is_tensor_parallel

__all__ = ["sqnr_db", "max_to_rms", "headroom_bits", "operand_max", "signals", "HealthProbe"]


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref`` in dB (inf when equal)."""
    ref, out = ref.float(), out.float()
    noise = (out - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


def max_to_rms(x: torch.Tensor) -> float:
    """max|x| / rms(x) (0 for an all-zero tensor)."""
    x = x.float()
    rms = x.pow(2).mean().sqrt().item()
    return 0.0 if rms == 0.0 else x.abs().amax().item() / rms


def headroom_bits(amax: float, scale: float, fmt_max: float) -> Optional[float]:
    """log2(fmt_max / (amax * scale)); None before the operand was cast (amax or scale 0)."""
    if amax <= 0.0 or scale <= 0.0 or not math.isfinite(amax * scale):
        return None
    return math.log2(fmt_max / (amax * scale))


def operand_max(layer: Float8Linear) -> dict[str, float]:
    """The format max each operand is cast to: x and W in the forward dtype, dY in the
    gradient dtype (E4M3 448 / E5M2 57344); block-scaled recipes report their element format's."""
    fmt = layer.recipe.fp8_format
    fwd, bwd = fp8_max(fmt.forward_dtype), fp8_max(fmt.backward_dtype)
    return {"input": fwd, "weight": fwd, "grad_output": bwd}


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else (v if not math.isfinite(v) else float(f"{v:.6g}"))


def _bits(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 4) + 0.0  # + 0.0: no -0.0 from float rounding at the max


def signals(
    tele: dict[str, dict[str, dict[str, float]]],
    layers: dict[str, Float8Linear],
    readings: dict[str, dict[str, float]],
    previous: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Health signals per layer: ``{layer: {"input": {...}, "weight": {...}, "grad_output": {...},
    "max_to_rms": .., "sqnr_db": ..}}`` from one step's telemetry, the probe's ``readings`` and the
    previous check's signals (for the trends; None at the first check). JSON-ready numbers."""
    out: dict[str, Any] = {}
    for name, ops in tele.items():
        layer = layers.get(name)
        if layer is None:
            continue
        fmax = operand_max(layer)
        prev = (previous or {}).get(name, {})
        row: dict[str, Any] = {}
        for op, st in ops.items():
            sat, uf = float(st.get("saturated", 0.0)), float(st.get("underflow", 0.0))
            p = prev.get(op)
            row[op] = {
                "saturated": _r(sat),
                "underflow": _r(uf),
                "saturated_trend": _r(sat - p["saturated"]) if p else 0.0,
                "underflow_trend": _r(uf - p["underflow"]) if p else 0.0,
                "headroom_bits": _bits(
                    headroom_bits(float(st.get("amax", 0.0)), float(st.get("scale", 0.0)), fmax[op])
                ),
            }
        got = readings.get(name, {})
        row["max_to_rms"] = _r(got.get("max_to_rms"))
        row["sqnr_db"] = _r(got.get("sqnr_db"))
        out[name] = row
    return out


class HealthProbe:
    """Forward hooks on every Float8Linear of a model that take, when armed, the input's
    max-to-rms ratio (``arm(outliers=True)``) and the output's SQNR against a float32 shadow
    GEMM (``arm(sqnr=True)``). ``take()`` returns the readings and disarms. Read under
    ``no_grad``, detached: the step's values are unchanged. With gradient accumulation the last
    micro-batch's reading is kept."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        self._outliers = self._sqnr = False
        self._readings: dict[str, dict[str, float]] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.layers.items()]

    def arm(self, outliers: bool = True, sqnr: bool = False) -> None:
        self._outliers, self._sqnr = outliers, sqnr

    def take(self) -> dict[str, dict[str, float]]:
        out, self._readings = self._readings, {}
        self._outliers = self._sqnr = False
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, name: str):
        def hook(module: Float8Linear, args: tuple, output: torch.Tensor) -> None:
            if not (self._outliers or self._sqnr) or not module.training or not args:
                return
            x = args[0]
            # autocast off: the shadow GEMM must not itself run in bf16
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                got = self._readings.setdefault(name, {})
                if self._outliers:
                    got["max_to_rms"] = max_to_rms(x.detach())
                # the shadow GEMM: the same x and W in float32 (not for a tensor-parallel layer,
                # whose DTensor weight is a shard of the GEMM: its SQNR is left unmeasured)
                if self._sqnr and not is_tensor_parallel(module.weight):
                    w = module.gemm_weight().detach().float()
                    b = None if module.bias is None else module.bias.detach().float()
                    ref = F.linear(x.detach().float(), w, b)
                    got["sqnr_db"] = sqnr_db(ref, output.detach())

        return hook
