"""FP8 health signals per layer and operand, cheap enough to leave on.

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

A layer the guard moved to high precision (``Float8Linear.high_precision``) casts nothing, so
its telemetry keeps the values of the last step it ran in FP8 and its output is a bf16 GEMM's.
For the guard to see it recover, a probe built with ``side=True`` measures such a layer *on the
side*, at the same armed checks: it casts the layer's x and W as its recipe's forward GEMM would
(``linear_fn.cast``, or the microscaling codec; each operand scaled from its own amax, as the
first step after a move back does, and without NVFP4's stochastic rounding) and, from a hook on
the output's gradient, dY as grad_input's GEMM would, and records the same four statistics per
operand (``cast_stats`` / ``block_stats``) in place of the stale telemetry; on a sampled step
the SQNR is that of the emulated FP8 GEMM (the dequantized operands' float32 product, rounded to
the output's dtype) against the float32 shadow GEMM. Such a row carries ``side_cast: true``.
This costs three casts (and, sampled, one more GEMM) per moved layer per check: the casts the
layer itself stopped making, at the cadence telemetry already runs; the step's values are
unchanged. A tensor-parallel layer (a sharded weight) is not measured on the side. A grouped
expert projection the guard moved runs ``grouped_mm_hp`` outside its module, so the experts call
the probe's callback (``SIDE_PROBE``) there: x_e, W_e and dY_e cast per expert holding tokens, the
row its worst expert's, as its telemetry row is (no SQNR, no max-to-rms for experts).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.cast_state import cast_stats
from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.modules.grouped import SIDE_PROBE, Float8GroupedGemm
from lowprec.fp8.modules.grouped_mx import expert_groups
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.modules.linear_fn import cast
from lowprec.fp8.modules.mx_linear import block_stats
from lowprec.fp8.kinds.plan import OperandCast
from lowprec.fp8.cast.quantize import dequantize
from lowprec.fp8.observe.telemetry import STAT_FIELDS, worst_expert
from lowprec.fp8.modules.tp_linear import is_tensor_parallel

__all__ = [
    "sqnr_db",
    "max_to_rms",
    "headroom_bits",
    "guarded_layers",
    "operand_max",
    "signals",
    "health_scalars",
    "HealthProbe",
]


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


def guarded_layers(model: nn.Module) -> dict[str, Any]:
    """What the health signals and the guard watch, by name: every Float8Linear and every FP8
    grouped expert projection (``...experts.fp8_<projection>``, judged by its worst routed expert)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (Float8Linear, Float8GroupedGemm))}


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
    readings: dict[str, dict[str, Any]],
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
        got = readings.get(name, {})
        row: dict[str, Any] = {}
        side = got.get("side")  # a moved layer measured on the side: its stale telemetry is not read
        for op, st in (ops if side is None else side).items():
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
        row["max_to_rms"] = _r(got.get("max_to_rms"))
        row["sqnr_db"] = _r(got.get("sqnr_db"))
        if side is not None:
            row["side_cast"] = True
        out[name] = row
    return out


def health_scalars(layers: dict[str, Any]) -> dict[str, float]:
    """A check's signals (:func:`signals`) as tracker scalars: ``fp8_health/<layer>/<signal>``
    (``.../<operand>/<signal>`` per operand); None (not measured) and inf (exact) are left out."""
    out: dict[str, float] = {}
    for layer, row in layers.items():
        for key, v in row.items():
            items = v.items() if isinstance(v, dict) else [(None, v)]
            for name, x in items:
                if isinstance(x, (int, float)) and math.isfinite(x):
                    out[f"fp8_health/{layer}/{key}" + (f"/{name}" if name else "")] = x
    return out


def side_cast(layer: Float8Linear, t: torch.Tensor, spec: OperandCast, contract: int, weight: bool = False):
    """``(statistics, dequantized)`` of the cast ``layer``'s recipe would make of 2-D ``t`` for a
    GEMM contracting over dim ``contract``, scaled from ``t``'s own amax: the statistics as
    telemetry reports them (``{"amax", "scale", "saturated", "underflow"}``), the dequantized
    operand in float32 (the probe multiplies the forward's, ``contract`` 1)."""
    recipe = layer.recipe
    codec = getattr(recipe.kind, "codec", None)
    if codec is None:  # tensor, axis and block scales: the casts Float8LinearFn makes
        q = cast(t, spec, contract, recipe)
        stats, deq = cast_stats(t, q), dequantize(q)
    else:  # microscaled: along the contraction dim (no stochastic rounding, no Hadamard transform)
        src = t if contract == 1 else t.t()
        q = codec.quantize_weight(src, recipe, spec.dtype) if weight else codec.quantize(src, recipe, spec.dtype)
        stats, deq = block_stats(src, q), q.dequantize()
    return dict(zip(STAT_FIELDS, stats.tolist())), deq


def _worst(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-expert side statistics as one row (``telemetry.worst_expert``)."""
    return worst_expert(torch.tensor([[r[f] for f in STAT_FIELDS] for r in rows], dtype=torch.float64))


def _grad_cast(layer: Float8Linear) -> Optional[tuple[OperandCast, int]]:
    """dY's first FP8 cast in backward (what telemetry reports): grad_input's, else grad_weight's."""
    plan = layer.recipe.plan
    if not plan.dgrad.high_precision:
        return plan.dgrad.casts[0], 1
    if not plan.wgrad.high_precision:
        return plan.wgrad.casts[0], 0
    return None


class HealthProbe:
    """Forward hooks on every Float8Linear of a model that take, when armed, the input's
    max-to-rms ratio (``arm(outliers=True)``) and the output's SQNR against a float32 shadow
    GEMM (``arm(sqnr=True)``). ``take()`` returns the readings and disarms. Read under
    ``no_grad``, detached: the step's values are unchanged. With gradient accumulation the last
    micro-batch's reading is kept. ``side=True``: a layer in high precision is also measured on
    the side at each armed step (its operands' would-be FP8 casts; see the module docstring)."""

    def __init__(self, model: nn.Module, side: bool = False) -> None:
        self.model = model
        self.side = side
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        self._outliers = self._sqnr = False
        self._readings: dict[str, dict[str, Any]] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.layers.items()]
        # a grouped expert projection the guard moved runs outside its module (grouped_mm_hp): the
        # experts call this probe's callback there instead of a hook
        self.grouped = {n: m for n, m in model.named_modules() if isinstance(m, Float8GroupedGemm)} if side else {}
        for n, m in self.grouped.items():
            m.__dict__[SIDE_PROBE] = self._grouped_side(n)

    def arm(self, outliers: bool = True, sqnr: bool = False) -> None:
        self._outliers, self._sqnr = outliers, sqnr

    def take(self) -> dict[str, dict[str, Any]]:
        out, self._readings = self._readings, {}
        self._outliers = self._sqnr = False
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.grouped.values():
            m.__dict__.pop(SIDE_PROBE, None)
        self.grouped = {}

    def _grouped_side(self, name: str):
        """A moved grouped expert projection measured on the side at an armed step: each
        operand's would-be FP8 cast per expert holding tokens (x_e and W_e as the forward GEMM
        casts them, dY_e from a hook on the output's gradient), the projection's row that of its
        worst expert per operand, as its telemetry row is (``telemetry.worst_expert``)."""

        def probe(gemm: Float8GroupedGemm, x, weight, counts, out: torch.Tensor) -> None:
            if not (self._outliers or self._sqnr) or not gemm.training:
                return
            side = self._readings.setdefault(name, {}).setdefault("side", {})
            groups = list(expert_groups(counts))
            fp = gemm.recipe.plan.fprop
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                if groups and not fp.high_precision:
                    spec_x, spec_w = fp.casts
                    xs = [side_cast(gemm, x[a : a + n].detach(), spec_x, 1)[0] for _, a, n in groups]  # type: ignore[arg-type]
                    ws = [side_cast(gemm, weight[e].detach(), spec_w, 1, weight=True)[0] for e, _, _ in groups]  # type: ignore[arg-type]
                    side["input"], side["weight"] = _worst(xs), _worst(ws)
            spec = _grad_cast(gemm)  # type: ignore[arg-type]
            if spec is None or not groups or not out.requires_grad:
                return

            def on_grad(dy: torch.Tensor) -> None:
                with torch.no_grad(), torch.autocast(dy.device.type, enabled=False):
                    rows = [side_cast(gemm, dy[a : a + n].detach(), *spec)[0] for _, a, n in groups]  # type: ignore[arg-type]
                    side["grad_output"] = _worst(rows)

            out.register_hook(on_grad)

        return probe

    def _hook(self, name: str):
        def hook(module: Float8Linear, args: tuple, output: torch.Tensor) -> None:
            if not (self._outliers or self._sqnr) or not module.training or not args:
                return
            x = args[0].detach()
            # autocast off: the shadow GEMM must not itself run in bf16
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                got = self._readings.setdefault(name, {})
                if self._outliers:
                    got["max_to_rms"] = max_to_rms(x)
                # the shadow GEMM: the same x and W in float32 (not for a tensor-parallel layer,
                # whose DTensor weight is a shard of the GEMM: its SQNR is left unmeasured)
                if is_tensor_parallel(module.weight):
                    return
                out: Optional[torch.Tensor] = output.detach()
                if self.side and (module.high_precision or module.high_precision_gemms):  # what FP8 would do
                    out = self._side_forward(module, x, output.detach(), got)
                    self._side_grad(module, output, got)
                if self._sqnr and out is not None:
                    w = module.gemm_weight().detach().float()
                    b = None if module.bias is None else module.bias.detach().float()
                    got["sqnr_db"] = sqnr_db(F.linear(x.float(), w, b), out)

        return hook

    def _side_forward(
        self, module: Float8Linear, x: torch.Tensor, out: torch.Tensor, got: dict
    ) -> Optional[torch.Tensor]:
        """x's and W's would-be casts into ``got["side"]``; on a sampled step, the emulated FP8
        GEMM's output (None when the recipe runs the forward GEMM in high precision)."""
        side = got.setdefault("side", {})
        fp = module.recipe.plan.fprop
        if fp.high_precision:
            return None
        spec_x, spec_w = fp.casts
        side["input"], dx = side_cast(module, x.reshape(-1, x.shape[-1]), spec_x, 1)
        side["weight"], dw = side_cast(module, module.gemm_weight().detach(), spec_w, 1, weight=True)
        if not self._sqnr:
            return None
        y = F.linear(dx, dw).to(out.dtype)
        if module.bias is not None:
            y = y + module.bias.detach().to(y.dtype)
        return y.reshape(out.shape)

    def _side_grad(self, module: Float8Linear, output: torch.Tensor, got: dict) -> None:
        """dY's would-be cast into ``got["side"]``, from a hook on the output's gradient."""
        spec = _grad_cast(module)
        if spec is None or not output.requires_grad:
            return

        def on_grad(dy: torch.Tensor) -> None:
            with torch.no_grad(), torch.autocast(dy.device.type, enabled=False):
                got["side"]["grad_output"] = side_cast(module, dy.detach().reshape(-1, dy.shape[-1]), *spec)[0]

        output.register_hook(on_grad)
