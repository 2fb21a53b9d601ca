"""What one Float8Linear call reads and writes besides its GEMMs: scales and telemetry.

``Float8LinearFn`` (linear_fn.py) is the three GEMMs and their casts. Everything stateful that
happens around those casts lives here, behind one object per call that the function asks:

* :class:`CastState` (current scaling): every cast takes its own tensor's amax; nothing is
  written except, with telemetry on, the layer's statistics rows.
* a scaling kind with state subclasses it: ``DelayedCastState`` (``fp8/kinds/delayed.py``)
  hands in the scales of the layer's amax histories and updates them.

The grouped expert path (``fp8/modules/grouped_fn.py``) holds one such object per expert and
asks it the same things, plus :meth:`CastState.cast_into` where every expert's cast is written
into one buffer per operand.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from lowprec.fp8 import kernels
from lowprec.fp8.cast.formats import saturation_threshold
from lowprec.fp8.cast.quantize import Float8Data, expand_blocks
from lowprec.fp8.cast.scaling import amax_to_scale

if TYPE_CHECKING:
    from lowprec.fp8.kinds.plan import OperandCast
    from lowprec.fp8.recipes import Recipe

__all__ = ["CastState", "cast_stats", "tensor_casts", "INPUT", "WEIGHT", "GRAD_OUTPUT"]

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

    def cast_into(
        self, row: int, t: torch.Tensor, spec: OperandCast, recipe: Recipe, out: torch.Tensor, transpose: bool
    ) -> tuple[Float8Data, Float8Data | None]:
        """Operand ``row`` (INPUT, WEIGHT or GRAD_OUTPUT) cast with one tensor scale into ``out``
        (its rows of a buffer holding several casts: the grouped path) and, where ``transpose``,
        its transposed copy: with the scale handed in (:attr:`x_scale`, :attr:`w_scale`,
        :meth:`grad_scale`), else one from ``t``'s own amax (``TensorCast``'s amax, scale and
        kernel). Returns ``(cast, transposed cast or None)``."""
        scale = self.grad_scale(t, recipe) if row == GRAD_OUTPUT else self.x_scale if row == INPUT else self.w_scale
        if scale is None:
            scale = amax_to_scale(
                kernels.amax(t), spec.dtype, margin=recipe.margin, power_of_2=recipe.power_of_2_scales
            )
        qt, _ = kernels.cast_into(t, scale, spec.dtype, out, transpose)
        return tensor_casts(out, qt, scale, recipe)

    def forward_casts_done(self) -> None:
        """The forward's :meth:`cast_into` calls have run (delayed scaling counts its step here)."""


def tensor_casts(
    q: torch.Tensor, qt: torch.Tensor | None, scale: torch.Tensor, recipe: Recipe
) -> tuple[Float8Data, Float8Data | None]:
    """``(q, qt.t())`` as tensor-scaled :class:`Float8Data` (``qt``: a contiguous transposed
    copy, read column-major; ``None`` where none was written)."""
    pow2 = recipe.power_of_2_scales
    col = None if qt is None else Float8Data(qt.t(), scale, "tensor", None, pow2)
    return Float8Data(q, scale, "tensor", None, pow2), col
