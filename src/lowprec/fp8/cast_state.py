"""What one Float8Linear call reads and writes besides its GEMMs: scales and telemetry.

``_Float8LinearFn`` (linear.py) is the three GEMMs and their casts. Everything stateful that
happens around those casts lives here, behind one object per call that the function asks:

* :class:`CastState` (current scaling): every cast takes its own tensor's amax; nothing is
  written except, with telemetry on, the layer's statistics rows.
* :class:`DelayedCastState` (delayed scaling, TransformerEngine semantics): the forward scales
  come from the layer's amax histories (computed here before the function runs, or replayed
  for an activation-checkpoint recompute), and dY's scale from its history in backward; the
  histories, scales and step counters are updated here. On CUDA with the Triton kernels the
  update runs inside the casts (one pass per operand, :func:`cast_delayed_fused`).

The order of the updates is that of TransformerEngine: input then weight in forward (one step
counter), grad_output in backward (its own counter).
"""

from __future__ import annotations

import torch

from lowprec.fp8 import host_scale, kernels, shared_cast
from lowprec.fp8.formats import saturation_threshold
from lowprec.fp8.quantize import Float8Data, expand_blocks
from lowprec.fp8.recipes import OperandCast, Recipe
from lowprec.fp8.scaling import delayed_scale_step

__all__ = ["CastState", "DelayedCastState", "cast_delayed_fused", "cast_stats", "INPUT", "WEIGHT", "GRAD_OUTPUT"]

# telemetry rows of Float8Linear.fp8_stats
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


_MAGNITUDE = {  # integer view and mask clearing the sign bit: zero exactly for +-0
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7F),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _count_dtype(n: int) -> torch.dtype:
    """A float dtype that sums n zeros and ones exactly (float32 holds every integer < 2**24)."""
    return torch.float32 if n < 2**24 else torch.float64


def _nonzero(t: torch.Tensor) -> torch.Tensor:
    """``count_nonzero(t)`` on the bits: magnitude bits, clamped to 0/1, summed as floats (an
    exact integer; several times faster than ``count_nonzero``, a bool tensor or an integer
    sum, which widens to int64 first, on CPU)."""
    view, mask = _MAGNITUDE[t.dtype]
    return t.view(view).bitwise_and(mask).clamp_(max=1).to(_count_dtype(t.numel())).sum()


def _peak(x: torch.Tensor, q: Float8Data, amax: torch.Tensor) -> float | None:
    """max ``|x * scale|`` in float32 without the scaled tensor, or ``None`` (block scales).
    Rounding is monotonic, so the largest product is that of each slice's amax and its scale."""
    scale = q.scale
    if q.granularity == "tensor" or scale.numel() == 1:
        return (amax.to(torch.float32) * scale).max().item()
    if q.granularity == "axis" and scale.dim() == 2:
        dim = 1 if scale.shape[1] == 1 else 0  # (M, 1): one scale per row
        lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
        return (torch.maximum(lo.neg(), hi).to(torch.float32) * scale).max().item()
    return None


def cast_stats(x: torch.Tensor, q: Float8Data) -> torch.Tensor:
    """(amax, scale, saturated fraction, underflow fraction) of one cast, as a float32 (4,).

    Saturated: ``|x * scale| > saturation_threshold`` in float32, as the cast computes it.
    Underflow: ``x != 0`` cast to a zero byte. Off the CPU these are computed as written. On
    CPU, where bool tensors and the FP8 -> float32 conversion are slow (a telemetry step cost ~8
    casts per operand), with host reads (no device there to sync): saturation is counted only
    when the largest ``|x * scale|`` (:func:`_peak`) is beyond the threshold, which with current
    scaling it never is; with finite scales, where a zero ``x`` always casts to a zero byte,
    underflow is ``nonzero(x) - nonzero(q)`` read on the bits (:func:`_nonzero`). Same values as
    the direct expressions (``tests/test_fp8_module.py``).
    """
    x = x.detach()
    scale = q.scale
    n = max(x.numel(), 1)
    thr = saturation_threshold(q.data.dtype)
    lo, hi = torch.aminmax(x)
    amax = torch.maximum(lo.neg(), hi)  # NaN propagates, as abs().amax() does
    cpu = x.device.type == "cpu" and x.dtype in _MAGNITUDE
    peak = _peak(x, q, amax) if cpu else None
    if peak is not None and peak <= thr:  # nothing beyond the threshold (False for NaN: count)
        saturated = torch.zeros((), dtype=torch.float32)
    else:
        full = expand_blocks(scale, q.tiles, x.shape) if q.granularity == "block" else scale
        scaled = x.to(torch.float32).mul_(full).abs_() if x.dtype != torch.float32 else (x * full).abs_()
        # float sums of zeros and ones: exact counts (below 2**24 elements, a float32 mean)
        saturated = torch.gt(scaled, thr, out=torch.empty_like(scaled)).sum(dtype=_count_dtype(n)) / n
    if cpu and bool(torch.isfinite(scale).all()):
        underflow = (_nonzero(x) - _nonzero(q.data)) / n
    else:
        underflow = ((x != 0) & (q.data.to(torch.float32) == 0)).float().mean()
    return torch.stack([t.to(torch.float32) for t in (amax, scale.amin(), saturated, underflow)])


def cast_delayed_fused(
    t, spec: OperandCast, recipe: Recipe, hist, scale, step
) -> tuple[Float8Data, Float8Data, torch.Tensor]:
    """Delayed scaling on CUDA with the Triton kernels: one pass over ``t`` (TE semantics).

    Cast (both layouts) with the scale the history holds, take this step's amax from that same
    pass into the history, and re-cast only if the scale to use differs: it does exactly when
    the history had nothing in it (the first step), where the scale comes from this amax; the
    re-cast kernel returns at once otherwise. Same values as :func:`delayed_scale_step` followed
    by a cast with its ``scale_used``. Updates ``hist`` and ``scale`` in place; returns
    ``(row-major cast, column-major cast, scale_used)``.
    """
    q, qt, amax_now = kernels.cast_transpose_amax(t, scale, spec.dtype)
    used, cast_with = kernels.delayed_scale_update(hist, scale, step, amax_now, spec.dtype, recipe)
    kernels.recast_if_changed(t, used, cast_with, q, qt)
    pow2 = recipe.power_of_2_scales
    return Float8Data(q, used, "tensor", None, pow2), Float8Data(qt.t(), used, "tensor", None, pow2), used


class CastState:
    """Current scaling: no scales handed in, no state. ``stats`` is the layer's telemetry
    buffer (3, 4), or ``None`` while telemetry is off."""

    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    # True when the delayed-scaling update runs inside the casts (fused_forward/fused_grad)
    fused = False

    def __init__(self, stats: torch.Tensor | None = None) -> None:
        self.stats = stats

    def fused_forward(self, x, weight, spec_x: OperandCast, spec_w: OperandCast, recipe: Recipe):
        """Delayed scaling's casts with the state update inside (``fused`` is True there only)."""
        raise NotImplementedError("current scaling does not fuse a state update into its casts")

    def observe(self, row: int, t: torch.Tensor, q: Float8Data) -> None:
        """Telemetry for the cast ``q`` of ``t`` (row: INPUT, WEIGHT or GRAD_OUTPUT)."""
        if self.stats is not None:
            self.stats[row].copy_(cast_stats(t, q))

    def grad_scale(self, dy: torch.Tensor, recipe: Recipe) -> torch.Tensor | None:
        """The per-tensor scale for dY's casts; ``None``: from dY's own amax."""
        return None


class DelayedCastState(CastState):
    """Delayed scaling over one Float8Linear's buffers (see the module docstring).

    ``mode`` is ``replay`` (an activation-checkpoint recompute: the scales of the last forward,
    no update), ``fused`` (the casts update the state) or ``eager`` (the scales computed here,
    now, from ``x`` and ``weight``). The buffers are taken now, so backward updates the ones
    the forward read.
    """

    def __init__(self, layer, recipe: Recipe, x: torch.Tensor, mode: str, stats: torch.Tensor | None) -> None:
        super().__init__(stats)
        self.fused = mode == "fused"
        self.state = {
            o: (getattr(layer, f"fp8_amax_history_{o}"), getattr(layer, f"fp8_scale_{o}"))
            for o in ("input", "weight", "grad_output")
        }
        self.step, self.step_grad, self.last = layer.fp8_step, layer.fp8_step_grad, layer.fp8_last_scales
        if mode == "replay":  # same scales as the first forward; its state update already ran
            self.x_scale, self.w_scale = self.last[0], self.last[1]
        elif mode == "eager":
            fwd = recipe.fp8_format.forward_dtype
            self.x_scale = self._update("input", x, fwd, recipe, self.step)
            self.w_scale = self._update("weight", layer.weight, fwd, recipe, self.step)
            self._forward_done(self.x_scale, self.w_scale)

    def _update(
        self, which: str, t: torch.Tensor, dtype: torch.dtype, recipe: Recipe, step: torch.Tensor
    ) -> torch.Tensor:
        hist, scale = self.state[which]
        if host_scale.applies(t, recipe.power_of_2_scales) and hist.device.type == "cpu":
            # CPU: the same update in host floats (host_scale.py), not ~25 scalar kernels
            # the input's amax is read once for the Linears that share it (shared_cast.py)
            amax_now = shared_cast.amax(t, host_scale.amax_value) if which == "input" else host_scale.amax_value(t)
            return torch.tensor(
                host_scale.delayed_step(hist, scale, step, amax_now, dtype, recipe), dtype=torch.float32
            )
        used, new_hist, new_scale = delayed_scale_step(hist, scale, step, kernels.amax(t), dtype, recipe)
        hist.copy_(new_hist)
        scale.copy_(new_scale)
        return used

    def _forward_done(self, x_used: torch.Tensor, w_used: torch.Tensor) -> None:
        self.step.add_(1)
        # the scales an activation-checkpoint recompute replays (fp8.checkpoint)
        self.last.copy_(torch.stack([x_used, w_used]))

    def fused_forward(self, x, weight, spec_x: OperandCast, spec_w: OperandCast, recipe: Recipe):
        """``((xq, x_col), (wq, w_col))``: both layouts of each, the state updated in the casts."""
        xq, x_col, x_used = cast_delayed_fused(x, spec_x, recipe, *self.state["input"], self.step)
        wq, w_col, w_used = cast_delayed_fused(weight, spec_w, recipe, *self.state["weight"], self.step)
        self._forward_done(x_used, w_used)
        return (xq, x_col), (wq, w_col)

    def fused_grad(self, dy: torch.Tensor, spec: OperandCast, recipe: Recipe) -> tuple[Float8Data, Float8Data]:
        """dY cast in both layouts, its amax recorded in the same pass."""
        dyq, dyq_col, _ = cast_delayed_fused(dy, spec, recipe, *self.state["grad_output"], self.step_grad)
        self.step_grad.add_(1)
        return dyq, dyq_col

    def grad_scale(self, dy: torch.Tensor, recipe: Recipe) -> torch.Tensor | None:
        if self.fused:  # fused_grad records dY's amax in its cast
            return None
        used = self._update("grad_output", dy, recipe.fp8_format.backward_dtype, recipe, self.step_grad)
        self.step_grad.add_(1)
        return used
