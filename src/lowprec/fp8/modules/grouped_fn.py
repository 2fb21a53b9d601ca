"""The three grouped GEMMs of the per-tensor (tensorwise, delayed), rowwise (rowwise,
rowwise_with_gw_hp) and blockwise kinds in one autograd function, for devices where a one-call
grouped FP8 kernel runs (``grouped_gemm.py``: torch's ``_scaled_grouped_mm``, else lowprec's
Triton grouped GEMM; for blockwise's block scales lowprec's Triton blockwise grouped GEMM).

The casts are the Linear's (``linear_fn.cast`` / ``cast_pair``, per expert: a token group never
shares a scale with another expert's tokens); what changes is how the GEMMs run:

==============  ===========================================  ===================================
GEMM            operands (per expert e)                      how
==============  ===========================================  ===================================
output          x_e cast along K, W_e cast along K           one grouped call (2-D x 3-D)
grad_input      dY_e cast along N, W_e cast along N          one grouped call: torch's kernel when
                (rowwise_with_gw_hp: W_e tensor-scaled)      both are E4M3 (rowwise), the Triton
                                                             one for tensorwise's E5M2 dY (torch's
                                                             takes E4M3 only); per expert where
                                                             neither runs
grad_weight     dY_e^T and x_e cast along the group's rows   one Triton launch for all experts
                                                             (``gemm/grouped_wgrad.py``: tensor or
                                                             column scales, E4M3/E5M2; blockwise's
                                                             128 x 1 tiles per group in its block
                                                             mode), float32 written in place;
                                                             per expert holding tokens where it
                                                             does not run (CPU, its check
                                                             failed). Not yet run on a GPU
grad_weight     dY_e^T x_e in high precision                 one GEMM per expert holding tokens,
(gw_hp)                                                      each writing its float32 slice (on
                                                             CUDA ``torch.mm``'s ``out_dtype``)
==============  ===========================================  ===================================

Backward keeps what the Linear keeps: x_e cast for grad_weight (1 byte per element; x itself for
rowwise_with_gw_hp) and, for per-tensor recipes, the forward's cast of each expert weight (the
rowwise kinds keep grad_input's weight cast made in the forward where their casts pack, below;
else they re-cast it from the Parameter); blockwise keeps each expert weight's transposed
128x128-block cast, written in the same pass as the forward's (``_keeps_weight_cast``: one read
of the float32 weights, all experts in one launch where the blocks do not span experts; 1 byte
per parameter held until backward, where the dense Linear re-casts). On sm_90 blockwise's output
and grad_input run torch's blockwise GEMM per expert (cuBLAS, as the dense layer; the Triton
grouped GEMM has not been timed against it), each writing its rows of one output buffer. The kind
decides when this runs (``SingleCallGrouped.grouped_forward``: every GEMM in FP8 but
rowwise_with_gw_hp's grad_weight, which runs here only where its casts pack; FP8 activations
kept, telemetry off); elsewhere each expert runs the Linear's own function.

Each expert's scales come from one :class:`~lowprec.fp8.modules.cast_state.CastState` per expert
(``SingleCallGrouped.grouped_cast_states``), as a Linear's come from its one: current scaling
hands nothing in (each cast takes its own amax); delayed scaling hands in the scales of the
expert's own row of the amax histories and updates that row exactly as the per-expert loop
does (input then weight, one step, in forward; dY in backward; the last forward's scales
replayed in an activation-checkpoint recompute; nothing for an expert without tokens).

Where the fused casts run (CUDA) the per-tensor recipes write each operand's casts into one
buffer (``_packs``: x's groups (S, K), the experts' weights (E, N, K), dY's groups (S, N), each
with its own scale as above), so the grouped GEMMs read them where they were written, with no
concatenation or stack between; grad_weight reads each group's transposed copies where they were
written (a table of addresses) and writes the whole gradient (the per-expert loop: each GEMM its
expert's slice). Delayed scaling records each group's amax from that same pass and re-casts only
where the scale changed (an empty history), as ``cast_delayed_fused`` does for a Linear: one
pass per operand per group. The rowwise kinds do the same with their axis casts
(``_packs_axes``, :mod:`~lowprec.fp8.modules.grouped_axes`): x's and dY's row-scaled casts into
(S, K) / (S, N) buffers (rowwise: their column-scaled copies beside, for grad_weight), each
expert weight read once after its amax for both its casts: row-scaled into (E, N, K) for the
output GEMM, grad_input's into the column-major (E, K, N) buffer torch's kernel reads, kept for
backward (1 byte per weight element, as the per-tensor recipes keep theirs). The values are
those of the per-group casts bit for bit (the same amax, scale and kernel). Bytes moved around
these GEMMs: ``benchmarks/grouped_traffic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton, grouped_wgrad
from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.modules.sharding import recast_weight_in_backward
from lowprec.fp8.gemm.dispatch import scaled_mm
from lowprec.fp8.gemm.grouped import grouped_mm
from lowprec.fp8.kinds import base
from lowprec.fp8.modules.cast_state import GRAD_OUTPUT, INPUT, WEIGHT, CastState
from lowprec.fp8.modules.grouped_axes import axis_plan_packs, cast_axis_parts, cast_axis_weights, hp_weight_grads
from lowprec.fp8.modules.linear_fn import (
    cast,
    cast_both_layouts,
    cast_experts_both_layouts,
    cast_pair,
    handed_scale,
)
from lowprec.fp8.kinds.plan import LinearPlan, OperandCast
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.modules.saved import save_operands, saved_operands

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = ["GroupedConfig", "GroupedScaledFn", "grouped_scaled_gemms", "fits", "SingleCallGrouped"]


def fits(recipe: Recipe, plan: LinearPlan, telemetry: bool) -> bool:
    """Whether the three GEMMs can run here: all in FP8 from FP8 activations (rowwise_with_gw_hp:
    grad_weight in high precision, where its casts are written into one buffer per operand:
    :func:`_packs_axes`), no telemetry rows to fill (the per-expert path fills them)."""
    return (
        not (plan.fprop.high_precision or plan.dgrad.high_precision)
        and (not plan.wgrad.high_precision or plan.axis_tensor_w)
        and recipe.save_fp8_activations
        and not telemetry
    )


@dataclass(frozen=True)
class GroupedConfig:
    recipe: Recipe
    plan: LinearPlan
    hp_dtype: torch.dtype
    counts: tuple[int, ...]
    single_call: bool  # the device runs a one-call grouped kernel (else the per-expert loop: CPU tests)
    packed: bool  # every cast written into one buffer per operand (_packs)
    packed_axes: bool = False  # the axis (rowwise) casts likewise (_packs_axes, grouped_axes.py)


def _packs(plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every cast can be written into one buffer per operand (``_cast_into``): both
    gradients wanted, per-tensor casts that serve both layouts (tensorwise, delayed), plain
    tensors, and the fused casts running here (CUDA), so a grouped GEMM reads its operands where
    the casts wrote them: no concatenation of the groups' FP8 rows, no stack of the experts' casts."""
    return plan.per_tensor and plan.x_dual and plan.w_reused and plan.dy_dual and _fused_operands(x, weight)


def _packs_axes(plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the axis casts (rowwise) can be written into one buffer per operand
    (``grouped_axes.py``): as :func:`_packs`, with axis scales on the output and grad_input
    GEMMs and x's and dY's casts serving grad_weight."""
    return axis_plan_packs(plan) and _fused_operands(x, weight)


def _fused_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Both gradients wanted, plain tensors the fused casts take, the fused casts running here."""
    return (
        torch.is_grad_enabled()
        and x.requires_grad
        and weight.requires_grad
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and fused_casts_here(x.device)
    )


def fused_casts_here(device: torch.device) -> bool:
    """The fused Triton casts run on ``device`` (CUDA; a trace as one). Tests patch it to run
    the packed path on CPU with the torch casts standing in."""
    return kernels.available(device)


def _cast_into(
    row: int,
    parts: list[Optional[torch.Tensor]],
    states: Sequence[CastState],
    spec: OperandCast,
    recipe: Recipe,
    transpose: bool,
) -> tuple[torch.Tensor, list[Optional[Float8Data]], list[Optional[Float8Data]]]:
    """``(buffer, casts, transposed casts)``: each 2-D part (a token group or an expert weight;
    None for an empty group) cast with its own tensor scale by its expert's state
    (:meth:`CastState.cast_into`: its own amax as ``TensorCast`` takes it, or the scale its
    history gives, updated in the same pass), its rows written one after another into one
    buffer; where ``transpose`` also its transposed copy (the layout its second GEMM reads)."""
    live = [t for t in parts if t is not None]
    buf = torch.empty(sum(t.shape[0] for t in live), live[0].shape[1], dtype=spec.dtype, device=live[0].device)
    casts: list[Optional[Float8Data]] = []
    cols: list[Optional[Float8Data]] = []
    start = 0
    for t, state in zip(parts, states):
        if t is None:
            casts.append(None)
            cols.append(None)
            continue
        q, col = state.cast_into(row, t, spec, recipe, buf[start : start + t.shape[0]], transpose)
        casts.append(q)
        cols.append(col)
        start += t.shape[0]
    return buf, casts, cols


def _keeps_weight_cast(plan: LinearPlan) -> bool:
    """Whether the forward casts each expert weight in both layouts and grad_input reads the
    second: one scale per tensor (``w_reused``), or square blocks (blockwise: ``w_square``, one
    128x128 block cast written row-major and transposed from one read). Unlike the dense Linear,
    which re-casts a blockwise weight in backward to keep no FP8 copy, the experts keep theirs (1
    byte per parameter until backward) for one read of the float32 weights instead of two."""
    return plan.w_reused or plan.w_square


def _groups(t: torch.Tensor, counts: tuple[int, ...]) -> list[Optional[torch.Tensor]]:
    out: list[Optional[torch.Tensor]] = []
    start = 0
    for n in counts:
        out.append(t[start : start + n] if n else None)
        start += n
    return out


def _save(ctx, cfg: GroupedConfig, states, x, weight, w_saved, x_saved, w_param, w_packed) -> None:
    """What backward reads: the weight casts grad_input takes (or the Parameter to re-cast), x's
    casts for grad_weight, the packed forward's (E, N, K) weight buffer (or None), and each
    expert's state (dY's scale, delayed scaling's grad_output history)."""
    save_operands(
        ctx,
        [*w_saved, *x_saved, w_param, w_packed],
        cfg=cfg,
        states=states,
        n_w=len(w_saved),
        x_dtype=x.dtype,
        w_dtype=weight.dtype,
        w_shape=tuple(weight.shape),
    )


class GroupedScaledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cfg: GroupedConfig, states: Sequence[CastState]):
        recipe, plan, hp = cfg.recipe, cfg.plan, cfg.hp_dtype
        spec_x, spec_w = plan.fprop.casts
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts = weight.shape[0]
        if cfg.packed:
            return GroupedScaledFn._packed_forward(ctx, x, weight, cfg, states)
        if cfg.packed_axes:
            return GroupedScaledFn._axes_forward(ctx, x, weight, cfg, states)
        with torch_autocast_off(x.device.type):
            xq: list[Optional[Float8Data]] = []  # per expert: None where it holds no token
            x_saved: list[Optional[Float8Data]] = []
            for g, state in zip(_groups(x, cfg.counts), states):
                if g is None:
                    xq.append(None)
                    x_saved.append(None)
                    continue
                q, col = cast_pair(g, spec_x, recipe, state.x_scale, need_wgrad and plan.x_dual)
                xq.append(q)
                if need_wgrad and col is None:
                    spec_xw = plan.wgrad.casts[1]
                    col = cast(g, spec_xw, 0, recipe, handed_scale(spec_xw, state.x_scale))
                x_saved.append(col if need_wgrad else None)
            keep_w = need_dgrad and _keeps_weight_cast(plan)
            # square blocks: all experts in one pass, each one's casts views of one buffer per layout
            both = cast_experts_both_layouts(weight, spec_w, recipe) if keep_w and plan.w_square else None
            wq, w_col = both or ([], [])
            for e in range(0 if both else experts):
                q, col = cast_pair(weight[e], spec_w, recipe, states[e].w_scale, keep_w)
                wq.append(q)
                w_col.append(col if col is not None else q)
            out = grouped_mm(xq, [w.t() for w in wq], hp, single_call=cfg.single_call, path=recipe.gemm)
            # grad_input reads the forward's weight casts where one scale serves both orientations
            w_saved = w_col if keep_w else []
        # rowwise: grad_input re-casts the weight from the Parameter (a reference, as the Linear)
        w_param = weight if (need_dgrad and not keep_w) else None
        _save(ctx, cfg, states, x, weight, w_saved, x_saved, w_param, None)
        return out

    @staticmethod
    def _packed_forward(ctx, x, weight, cfg: GroupedConfig, states: Sequence[CastState]):
        """The forward where every cast writes into one buffer per operand (``_packs``): x's
        groups into one (S, K) FP8 buffer (their transposed copies kept for grad_weight), the
        experts' weights into one (E, N, K) buffer, which the output GEMM reads transposed and
        grad_input reads as it is where the Triton grouped GEMM runs it (torch's grouped kernel
        takes E4M3 only: an E4M3 dY gets the weights' transposed copies, stacked there)."""
        recipe, plan, hp = cfg.recipe, cfg.plan, cfg.hp_dtype
        spec_x, spec_w = plan.fprop.casts
        experts, n, k = weight.shape
        native_dgrad = all(o.dtype == torch.float8_e4m3fn for o in plan.dgrad.casts)
        with torch_autocast_off(x.device.type):
            xbuf, xq, x_saved = _cast_into(INPUT, _groups(x, cfg.counts), states, spec_x, recipe, True)
            wbuf, wq, w_t = _cast_into(WEIGHT, list(weight.unbind(0)), states, spec_w, recipe, native_dgrad)
            for state in states:
                state.forward_casts_done()
            wbuf = wbuf.view(experts, n, k)
            out = grouped_mm(
                xq,
                [w.t() for w in wq if w is not None],  # every expert has a weight
                hp,
                single_call=cfg.single_call,
                path=recipe.gemm,
                packed_a=xbuf,
                packed_b=wbuf.transpose(-2, -1),
            )
        w_saved = [c if c is not None else q for c, q in zip(w_t, wq)]
        _save(ctx, cfg, states, x, weight, w_saved, x_saved, None, wbuf)
        return out

    @staticmethod
    def _axes_forward(ctx, x, weight, cfg: GroupedConfig, states: Sequence[CastState]):
        """The forward where the axis casts write into one buffer per operand (``_packs_axes``,
        ``grouped_axes.py``): x's groups row-scaled into one (S, K) buffer (their column-scaled
        copies kept for grad_weight), the experts' weights row-scaled into one (E, N, K) buffer
        and column-scaled into one (E, K, N) buffer from the same read, kept for grad_input,
        which reads it as torch's grouped kernel takes its ``mat_b`` (column-major)."""
        recipe, plan, hp = cfg.recipe, cfg.plan, cfg.hp_dtype
        spec_x, spec_w = plan.fprop.casts
        hp_wgrad = plan.wgrad.high_precision  # rowwise_with_gw_hp: x kept in high precision
        with torch_autocast_off(x.device.type):
            xbuf, xq, x_saved = cast_axis_parts(_groups(x, cfg.counts), spec_x, recipe, not hp_wgrad)
            wbuf, wq, wtbuf, w_dgrad = cast_axis_weights(weight, spec_w, recipe, plan.axis_tensor_w)
            out = grouped_mm(
                xq,
                [w.t() for w in wq],
                hp,
                single_call=cfg.single_call,
                path=recipe.gemm,
                packed_a=xbuf,
                packed_b=wbuf.transpose(-2, -1),
            )
        x_kept = [x.to(hp)] if hp_wgrad else x_saved  # a reference where x is in hp already, as the Linear's
        _save(ctx, cfg, states, x, weight, w_dgrad, x_kept, None, wtbuf.transpose(-2, -1))
        return out

    @staticmethod
    def backward(ctx, dy):
        saved = saved_operands(ctx)
        w_saved, x_saved, w_param, w_packed = saved[: ctx.n_w], saved[ctx.n_w : -2], saved[-2], saved[-1]
        cfg, states = ctx.cfg, ctx.states
        recipe, plan, hp = cfg.recipe, cfg.plan, cfg.hp_dtype
        dg, wg = plan.dgrad, plan.wgrad
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        with torch_autocast_off(dy.device.type):
            dyq, dy_col = [], []
            dy_packed = None
            if w_packed is not None and cfg.packed_axes:  # _axes_forward ran: dY's axis casts into one buffer
                dy_packed, dyq, dy_col = cast_axis_parts(_groups(dy, cfg.counts), dg.a, recipe, not wg.high_precision)
            elif w_packed is not None:  # the packed forward ran (_packs): dY's casts into one buffer too
                dy_packed, dyq, dy_col = _cast_into(GRAD_OUTPUT, _groups(dy, cfg.counts), states, dg.a, recipe, True)
            for g, state in zip(_groups(dy, cfg.counts), states) if dy_packed is None else ():
                if g is None:
                    dyq.append(None)
                    dy_col.append(None)
                    continue
                dy_scale = state.grad_scale(g, recipe)  # delayed scaling: this expert's dY history
                if need_wgrad and plan.dy_dual:
                    q, col = cast_both_layouts(g, dg.a, recipe, dy_scale)
                    dyq.append(q)
                    dy_col.append(col)
                else:
                    dyq.append(cast(g, dg.a, 1, recipe, handed_scale(dg.a, dy_scale)) if need_dgrad else None)
                    dy_col.append(cast(g, wg.a, 0, recipe, handed_scale(wg.a, dy_scale)) if need_wgrad else None)
            if need_dgrad:
                experts = len(cfg.counts)
                w_dgrad = w_saved or [cast(w_param[e], dg.b, 0, recipe) for e in range(experts)]
                grad_x = grouped_mm(
                    dyq,
                    w_dgrad,
                    hp,
                    single_call=cfg.single_call,
                    path=recipe.gemm,
                    packed_a=dy_packed,
                    packed_b=w_packed,
                ).to(ctx.x_dtype)
            if need_wgrad:  # float32 as the Linear's: one Triton launch for all experts where it runs
                grad_w = torch.empty(ctx.w_shape, dtype=torch.float32, device=dy.device)
                if wg.high_precision:  # rowwise_with_gw_hp: its bf16 GEMMs, each writing its expert's slice
                    hp_weight_grads(dy, x_saved[0], cfg.counts, hp, grad_w)
                elif not (cfg.single_call and grouped_wgrad.run_into(dy_col, x_saved, grad_w, dy.device)):
                    # per expert holding tokens, zero elsewhere; each GEMM writes its expert's slice
                    # where torch's kernel can (else a copy into it)
                    for e, (d, xs) in enumerate(zip(dy_col, x_saved)):
                        if d is not None and xs is not None:
                            scaled_mm(d.t(), xs, torch.float32, path=recipe.gemm, out=grad_w[e])
                        else:
                            grad_w[e].zero_()
                grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None


def grouped_scaled_gemms(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: tuple[int, ...],
    recipe: Recipe,
    hp: torch.dtype,
    single_call: bool,
    states: Callable[[bool], Sequence[CastState]],
) -> torch.Tensor:
    """``(S, N)``: the grouped output through :class:`GroupedScaledFn`; ``states(packed)``: each
    expert's :class:`CastState`, made once the path is known (delayed scaling updates its
    histories inside the casts where they are written into one buffer per operand)."""
    if not any(counts):
        return x.new_zeros((0, weight.shape[1]), dtype=hp)
    plan = recipe.plan
    packed = _packs(plan, x, weight)
    cfg = GroupedConfig(recipe, plan, hp, counts, single_call, packed, not packed and _packs_axes(plan, x, weight))
    return GroupedScaledFn.apply(x, weight, cfg, states(packed))


class SingleCallGrouped(base.Kind):
    """What the tensor-, row- and block-scaled kinds (``tensorwise``, ``delayed``, ``rowwise``,
    ``blockwise``) add to a kind: their grouped GEMMs in :class:`GroupedScaledFn` with a one-call
    grouped kernel (torch's, or lowprec's Triton one; ``blockwise``: the Triton blockwise one)
    where one runs and passed its check (:meth:`grouped_kernel_ready`), each expert's scales and
    state from :meth:`grouped_cast_states`; elsewhere the per-expert loop every kind has."""

    def _grouped_eligible(self, recipe: Recipe, telemetry: bool) -> bool:
        """A recipe a one-call grouped kernel can run: its GEMM path, its casts."""
        return recipe.gemm in ("auto", "scaled_mm") and fits(recipe, recipe.plan, telemetry)

    def grouped_kernel_ready(self, device: torch.device) -> bool:
        """A one-call grouped kernel for this kind's operands runs on ``device`` (checked once)."""
        return grouped_gemm.single_call_ready(device)

    def grouped_single_call(self, recipe: Recipe, device: torch.device, telemetry: bool) -> bool:
        return self._grouped_eligible(recipe, telemetry) and self.grouped_kernel_ready(device)

    def grouped_forward(self, call: base.GroupedCall) -> torch.Tensor:
        gemm, x, weight, counts, recipe, hp = call.gemm, call.x, call.weight, call.counts, call.recipe, call.hp
        hp_wgrad = recipe.plan.wgrad.high_precision  # only where its casts pack (_axes_forward)
        # FSDP / ZeRO-3 shard the experts (force_recompute_fp8_weight_in_bwd auto), or asked: the
        # one-call path keeps the experts' weight casts until backward; each expert as a Linear
        # keeps a reference and casts again (the loop), as the dense layer does
        recast = recast_weight_in_backward(gemm, weight, recipe)
        if (
            not recast
            and self.grouped_single_call(recipe, x.device, gemm.fp8_telemetry)
            and (not hp_wgrad or _packs_axes(recipe.plan, x, weight))
        ):
            states = partial(self.grouped_cast_states, call)  # given `packed`
            return grouped_scaled_gemms(x, weight, counts, recipe, hp, True, states)
        return super().grouped_forward(call)

    def grouped_cast_states(self, call: base.GroupedCall, packed: bool) -> list[CastState]:
        """Per expert, what :class:`GroupedScaledFn` asks for the scales handed in and the state
        to update (as :meth:`ScaledGemmKind.cast_state` for a Linear); ``packed``: the casts are
        written into one buffer per operand. Current scaling: nothing handed in, nothing kept."""
        return [CastState()] * len(call.counts)

    def grouped_note(self, recipe: Recipe, device: torch.device) -> str:
        plan = recipe.plan
        eligible = self._grouped_eligible(recipe, False)
        triton = eligible and grouped_triton.may_run(device)  # no kernel runs for a note
        rest = f"grad_weight per expert: {self.gemm_note(recipe, device)}"
        if eligible and plan.wgrad.high_precision:
            rest = (
                "grad_weight in high precision, one GEMM per expert holding tokens writing its float32 slice "
                "(where the fused casts run; else each expert as a Linear)"
            )
        elif eligible and grouped_wgrad.may_run(device) and grouped_wgrad.takes_granularities(plan.wgrad.casts):
            rest = f"grad_weight of all experts in one launch of the {grouped_wgrad.KERNEL} (self-checked at first use)"
        if self.keeps_history:
            rest += (
                "; each expert's scales from its own row of the amax histories "
                "(updated inside the fused casts where they run)"
            )
        if eligible and grouped_gemm.native_grouped_available(device):
            e4m3 = all(o.dtype == torch.float8_e4m3fn for o in plan.dgrad.casts)  # else E5M2 dY
            dgrad = (
                "and grad_input GEMMs"
                if e4m3
                else (f"GEMM ({grouped_triton.KERNEL} for grad_input's E5M2 dY)" if triton else "GEMM")
            )
            return (
                f"torch._scaled_grouped_mm on {device.type}: the output {dgrad} of all experts in one call "
                f"(checked against its reference before first use; per expert where a check fails); {rest}"
            )
        if triton:
            return (
                f"{grouped_triton.KERNEL} on {device.type}: the output and grad_input GEMMs of all experts in one "
                f"launch each (self-checked at first use; per expert where the check fails); {rest}"
            )
        return super().grouped_note(recipe, device)
