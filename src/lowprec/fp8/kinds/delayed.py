"""Delayed scaling (TransformerEngine's ``DelayedScaling``): one scale per tensor, from the amaxes
recorded at earlier steps.

Each operand (input, weight, grad_output) keeps an amax history buffer in the layer. The scale
used at step t is built from amaxes recorded at steps < t and refreshed every ``interval``
steps; while no finite non-zero amax has been recorded (the first step, or after all-zero
inputs) the current tensor's amax is used, so step 0 is exactly tensorwise. The forward scales
come from the histories (computed before the GEMMs run, or replayed for an activation-checkpoint
recompute), dY's from its history in backward. The order of the updates is TransformerEngine's:
input then weight in forward (one step counter), grad_output in backward (its own counter). On
CUDA with the Triton kernels the update runs inside the casts (one pass per operand,
:func:`cast_delayed_fused`).

Grouped expert GEMMs keep these buffers per expert (a leading expert dim) and run in one call
per GEMM where tensorwise's do (``fp8/modules/grouped_fn.py``): :meth:`Delayed.grouped_cast_states`
gives each expert holding tokens the :class:`DelayedCastState` of its own row, the one the
per-expert loop would make, so scales, history updates, step counters and recompute replay are
the loop's; where every expert's cast is written into one buffer per operand its amax is
recorded from that same pass (:meth:`DelayedCastState.cast_into`). An expert without tokens
records nothing.

The casts and GEMMs are tensorwise's (``tensorwise.py``), with the scale handed in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.cast import host_scale
from lowprec.fp8.modules import shared_cast
from lowprec.fp8.modules.autocast import recomputing
from lowprec.fp8.modules.cast_state import GRAD_OUTPUT, INPUT, WEIGHT, CastState, tensor_casts
from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.modules.gathered import Float8GatheredWeight, gathered_scale_and_amax
from lowprec.fp8.kinds import base
from lowprec.fp8.kinds.tensorwise import FINITE, UNSATURATED, Tensorwise, fused_cast_ok
from lowprec.fp8.kinds.plan import OperandCast
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.cast.scaling import delayed_scale_step

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.recipes import Recipe

__all__ = ["Delayed", "DelayedCastState", "cast_delayed_fused", "OPERANDS"]

OPERANDS = ("input", "weight", "grad_output")
_F32_MAX = torch.finfo(torch.float32).max


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
    used = _record(t, amax_now, q, qt, spec, recipe, hist, scale, step)
    pow2 = recipe.power_of_2_scales
    return Float8Data(q, used, "tensor", None, pow2), Float8Data(qt.t(), used, "tensor", None, pow2), used


def _record(t, amax_now, q, qt, spec: OperandCast, recipe: Recipe, hist, scale, step) -> torch.Tensor:
    """After a cast of ``t`` into ``q`` (and ``qt``, its transpose; empty: none) with ``scale``,
    the history's: record ``amax_now`` from that pass (``hist`` and ``scale`` updated in place)
    and re-cast where the scale to use differs (an empty history). Returns the scale used."""
    used, cast_with = kernels.delayed_scale_update(hist, scale, step, amax_now, spec.dtype, recipe)
    kernels.recast_if_changed(t, used, cast_with, q, qt)
    return used


class DelayedCastState(CastState):
    """Delayed scaling over one Float8Linear's buffers (see the module docstring).

    ``mode`` is ``replay`` (an activation-checkpoint recompute: the scales of the last forward,
    no update), ``fused`` (the casts update the state) or ``eager`` (the scales computed here,
    now, from ``x`` and ``weight``). The buffers are taken now, so backward updates the ones
    the forward read.
    """

    def __init__(
        self, layer: Float8Linear, recipe: Recipe, x: torch.Tensor, mode: str, stats: torch.Tensor | None
    ) -> None:
        super().__init__(stats)
        self.fused = mode == "fused"
        self.state = {
            o: (getattr(layer, f"fp8_amax_history_{o}"), getattr(layer, f"fp8_scale_{o}"))
            for o in ("input", "weight", "grad_output")
        }
        self.step, self.step_grad, self.last = layer.fp8_step, layer.fp8_step_grad, layer.fp8_last_scales
        self.used: dict[int, torch.Tensor] = {}  # fused: the scales the grouped casts used (cast_into)
        if mode == "replay":  # same scales as the first forward; its state update already ran
            self.x_scale, self.w_scale = self.last[0], self.last[1]
        elif mode == "eager":
            fwd = recipe.fp8_format.forward_dtype
            self.x_scale = self._update("input", x, fwd, recipe, self.step)
            gathered = gathered_scale_and_amax(layer.weight)
            if gathered is None:
                self.w_scale = self._update("weight", layer.weight, fwd, recipe, self.step)
            else:
                # the FSDP2 FP8 all-gather cast every shard with the scale this update gives
                # (distributed/fsdp_float8.py: DelayedWeightScale) and carries the whole weight's
                # amax: record that amax, cast with the payload's scale (no second cast)
                self.w_scale = gathered[0]
                self._update("weight", layer.weight, fwd, recipe, self.step, amax=gathered[1])
            self._forward_done(self.x_scale, self.w_scale)

    def _update(
        self,
        which: str,
        t: torch.Tensor,
        dtype: torch.dtype,
        recipe: Recipe,
        step: torch.Tensor,
        amax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One delayed-scaling step of operand ``which`` (its amax from ``t``, or ``amax`` as
        given); the state is updated; returns the scale to cast ``t`` with."""
        hist, scale = self.state[which]
        if host_scale.applies(t, recipe.power_of_2_scales) and hist.device.type == "cpu":
            # CPU: the same update in host floats (host_scale.py), not ~25 scalar kernels
            # the input's amax is read once for the Linears that share it (shared_cast.py)
            if amax is not None:
                amax_now = float(amax)
            elif which == "input":
                amax_now = shared_cast.amax(t, host_scale.amax_value)
            else:
                amax_now = host_scale.amax_value(t)
            value = host_scale.delayed_step(hist, scale, step, amax_now, dtype, recipe)
            used = torch.tensor(value, dtype=torch.float32)
            # the product of two float32 values is exact in a Python float: when it is within the
            # format, no element of t saturates and t holds no inf or NaN (its amax is finite), so
            # the cast may skip the two passes that guard against them (same bits: TensorCast)
            if math.isfinite(amax_now) and amax_now * value <= _F32_MAX:  # no inf before or after scaling
                setattr(used, FINITE, True)
                if amax_now * value <= fp8_max(dtype):
                    setattr(used, UNSATURATED, True)
            return used
        amax_t = kernels.amax(t) if amax is None else amax
        used, new_hist, new_scale = delayed_scale_step(hist, scale, step, amax_t, dtype, recipe)
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

    def cast_into(
        self, row: int, t: torch.Tensor, spec: OperandCast, recipe: Recipe, out: torch.Tensor, transpose: bool
    ) -> tuple[Float8Data, Float8Data | None]:
        """The grouped path's cast into a buffer; ``fused``: as :func:`cast_delayed_fused`, one pass
        (cast with the history's scale, its amax recorded, re-cast where the scale changed),
        the input and weight steps counted by :meth:`forward_casts_done`; otherwise with the
        scales handed in (replayed, or computed when this state was made; dY's now)."""
        if not self.fused:
            return super().cast_into(row, t, spec, recipe, out, transpose)
        hist, scale = self.state[OPERANDS[row]]
        qt, amax_now = kernels.cast_into(t, scale, spec.dtype, out, transpose)
        step = self.step_grad if row == GRAD_OUTPUT else self.step
        used = _record(t, amax_now, out, out.new_empty(0, 0) if qt is None else qt, spec, recipe, hist, scale, step)
        if row == GRAD_OUTPUT:
            self.step_grad.add_(1)
        else:
            self.used[row] = used
        return tensor_casts(out, qt, used, recipe)

    def forward_casts_done(self) -> None:
        if self.fused:  # the input's and weight's updates ran in their casts (cast_into)
            self._forward_done(self.used[INPUT], self.used[WEIGHT])


class Delayed(Tensorwise):
    """Delayed per-tensor scaling (see the module docstring)."""

    name = "delayed"
    keeps_history = True
    state_buffers = (
        *(f"fp8_amax_history_{o}" for o in OPERANDS),
        *(f"fp8_scale_{o}" for o in OPERANDS),
        "fp8_step",
        "fp8_step_grad",
    )
    state_what = "amax history"

    def init_state(self, layer: Float8Linear) -> None:
        device = layer.weight.device
        for o in OPERANDS:
            layer.register_buffer(f"fp8_amax_history_{o}", torch.zeros(layer.recipe.amax_history_len, device=device))
            layer.register_buffer(f"fp8_scale_{o}", torch.ones((), device=device))
        layer.register_buffer("fp8_step", torch.zeros((), dtype=torch.int64, device=device))
        layer.register_buffer("fp8_step_grad", torch.zeros((), dtype=torch.int64, device=device))
        # the (input, weight) scales of the last forward, replayed by an activation-checkpoint
        # recompute (fp8.recompute) so it casts exactly as the first forward did
        layer.register_buffer("fp8_last_scales", torch.ones(2, device=device), persistent=False)

    def reset_state(self, layer: Float8Linear) -> None:
        for o in OPERANDS:
            getattr(layer, f"fp8_amax_history_{o}").zero_()
            getattr(layer, f"fp8_scale_{o}").fill_(1.0)
        layer.fp8_step.zero_()
        layer.fp8_step_grad.zero_()

    def cast_state(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe) -> CastState:
        stats = layer.fp8_stats if layer.fp8_telemetry else None
        # replay: the scales of the first forward (its state update already ran)
        mode = "replay" if recomputing() else "fused" if _fused(layer, x2, recipe) else "eager"
        return DelayedCastState(layer, recipe, x2, mode, stats)

    def grouped_cast_states(self, call: base.GroupedCall, packed: bool) -> list[CastState]:
        """Per expert holding tokens, the :class:`DelayedCastState` of its slot (its row of each
        buffer), as the per-expert loop makes it: replaying in a recompute, the update inside
        the casts where they are written into one buffer per operand (``packed``), else the
        scales computed now (input then weight, then the step counted). An expert without
        tokens records nothing, as in the loop (not even its weight's amax): its weight, which
        no token reads, is cast with its own amax."""
        mode = "replay" if recomputing() else "fused" if packed else "eager"
        states: list[CastState] = []
        with torch.no_grad():  # the updates read amaxes only
            experts, groups = call.weight.unbind(0), call.x.split(list(call.counts))
            for e, n in enumerate(call.counts):
                slot = call.gemm.slot(e, experts[e]) if n else None
                states.append(
                    CastState() if slot is None else DelayedCastState(slot, call.recipe, groups[e], mode, None)
                )
        return states


def _fused(layer: Float8Linear, x2: torch.Tensor, recipe: Recipe) -> bool:
    """Whether this step's update runs inside the fused casts (one pass per operand,
    :func:`cast_delayed_fused`): CUDA with the Triton kernels, every GEMM in FP8, both gradients
    wanted and the FP8 input kept, so that each operand's one cast serves both of its GEMMs.
    Otherwise the scales are computed first (an amax read per operand)."""
    w = layer.weight
    return (
        not isinstance(w, Float8GatheredWeight)  # arrives cast: the eager update records its amax
        and fused_cast_ok(x2)
        and fused_cast_ok(w)
        and torch.is_grad_enabled()
        and x2.requires_grad
        and w.requires_grad
        and recipe.save_fp8_activations
        and not any(recipe.override_linear_precision)
    )


base.register(Delayed())
