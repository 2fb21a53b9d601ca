"""The three GEMMs of a Float8Linear and their casts, for every kind whose GEMMs are plain
scaled matrix products (tensor, axis and block scales; the microscaling kinds have their own,
``fp8/modules/mx_linear.py``). The table of GEMMs and dtypes is in ``fp8/modules/linear.py``.

Which cast one GEMM hands to another is decided once per recipe (``LinearPlan``, ``fp8/kinds/plan.py``);
the casts themselves are looked up by granularity (the registry below); scales handed in,
scaling-state updates and telemetry go through one per-call object (``fp8/modules/cast_state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lowprec.fp8.modules import shared_cast
from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.modules.cast_state import GRAD_OUTPUT, INPUT, WEIGHT, CastState
from lowprec.fp8.modules.gathered import as_float8_data
from lowprec.fp8.modules.frozen import frozen_weight_cache
from lowprec.fp8.gemm.dispatch import scaled_mm
from lowprec.fp8.kinds import base
from lowprec.fp8.kinds.plan import LinearPlan, OperandCast
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.modules.saved import save_operands, saved_operands
from lowprec.fp8.modules.sharding import SavedWeight, recast_weight_in_backward

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.cast.mx import BlockScaledData
    from lowprec.fp8.recipes import Recipe

__all__ = [
    "ScaledGemmKind",
    "Caster",
    "register_caster",
    "cast",
    "cast_both_layouts",
    "handed_scale",
    "linear_gemms",
    "cast_pair",
    "FnConfig",
    "Float8LinearFn",
]

# Operand casts are keyed by *granularity* (``tensor``, ``axis``, ``block``: how the scales of
# one operand are laid out), since scaling kinds share them: rowwise reads a tensor-scaled weight
# for grad_input under ``rowwise_with_gw_hp``. Each granularity's Caster lives in the module of
# the kind that introduced it (``fp8/kinds/``) and is registered here with register_caster.


class Caster:
    """The casts of one granularity: ``one`` for a GEMM contracting over dim ``contract``
    (1: row-major A, 0: the column-major operand of a backward GEMM), ``both`` for the two
    layouts at once (``(contracting dim 1, contracting dim 0)``; one pass where kernels allow).
    ``scale``: a per-tensor scale handed in (delayed scaling), else ``None``."""

    granularity: ClassVar[str] = ""

    def one(self, t: torch.Tensor, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
        raise NotImplementedError

    def both(self, t: torch.Tensor, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
        return self.one(t, spec, 1, recipe, scale), self.one(t, spec, 0, recipe)

    def experts_both(
        self, w: torch.Tensor, spec: OperandCast, recipe: Recipe
    ) -> tuple[list[Float8Data], list[Float8Data]] | None:
        """Every expert weight of ``w`` (E, N, K) in both layouts at once (one pass over all
        experts, each expert's casts views of one buffer per layout), or None where this
        granularity has no such cast (the caller casts expert by expert)."""
        return None

    def takes_scale(self) -> bool:
        """Whether a per-tensor scale handed in applies to this granularity's casts."""
        return False


_CASTERS: dict[str, Caster] = {}


def register_caster(caster: Caster) -> Caster:
    _CASTERS[caster.granularity] = caster
    return caster


def _caster(spec: OperandCast) -> Caster:
    caster = _CASTERS.get(spec.granularity)
    if caster is None:  # the kind that introduced this granularity registers its cast: load them all
        for name in base.names():
            base.get(name)
        caster = _CASTERS.get(spec.granularity)
    if caster is None:
        raise ValueError(f"no cast registered for granularity {spec.granularity!r}")
    return caster


def cast(t: torch.Tensor, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
    """Quantize a 2-D operand for a GEMM that contracts over dim ``contract``; a weight that the
    FSDP2 FP8 all-gather delivered already cast is taken as it is."""
    pre = as_float8_data(t, spec.dtype, spec.granularity, contract)
    if pre is not None:
        return pre
    return _caster(spec).one(t, spec, contract, recipe, scale)


def cast_both_layouts(t: torch.Tensor, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
    """The casts of ``x``, ``W`` or ``dY`` for two GEMMs: ``(row-major, contracting dim 1;
    column-major, contracting dim 0)``. Values are those of two :func:`cast` calls; where the
    Triton kernels run, one pass writes both and the second comes back as a column-major view,
    the layout ``scaled_mm`` hands cuBLAS, so nothing is copied."""
    pre = as_float8_data(t, spec.dtype, spec.granularity)
    if pre is not None:
        return pre, pre
    return _caster(spec).both(t, spec, recipe, scale)


def cast_experts_both_layouts(
    w: torch.Tensor, spec: OperandCast, recipe: Recipe
) -> tuple[list[Float8Data], list[Float8Data]] | None:
    """:meth:`Caster.experts_both` of ``spec``'s granularity for a plain (E, N, K) weight (no scale
    handed in), else None."""
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 3:
        return None
    return _caster(spec).experts_both(w, spec, recipe)


def handed_scale(spec: OperandCast, scale):
    """A per-tensor scale handed in (delayed scaling) applies to the casts that take one only."""
    return scale if _caster(spec).takes_scale() else None


def cast_pair(
    t: torch.Tensor, spec: OperandCast, recipe: Recipe, scale, dual: bool
) -> tuple[Float8Data, Float8Data | None]:
    """``(cast for the forward GEMM, column-major cast for a backward GEMM or None)``."""
    if dual:
        return cast_both_layouts(t, spec, recipe, scale)
    return cast(t, spec, 1, recipe, scale), None


@dataclass(frozen=True)
class FnConfig:
    recipe: Recipe
    hp_dtype: torch.dtype
    plan: LinearPlan  # recipe.plan, built once per recipe
    weight_cache: Any = None  # a frozen weight's cast store (fp8/modules/frozen.py), or None
    # keep the weight and the forward's scale, not its FP8 cast, for grad_input (fp8/modules/sharding.py)
    recast_weight: bool = False


class Float8LinearFn(torch.autograd.Function):
    """The three GEMMs of the table above and their casts. Scales handed in, state updates and
    telemetry go through ``state`` (:mod:`lowprec.fp8.modules.cast_state`); which cast serves which
    GEMM is decided once, in ``cfg.plan``."""

    @staticmethod
    def forward(ctx, x, weight, cfg: FnConfig, state: CastState):
        recipe, hp, plan = cfg.recipe, cfg.hp_dtype, cfg.plan
        fp = plan.fprop
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch_autocast_off(x.device.type):
            wq = x_col = w_col = None
            if fp.high_precision:
                out = torch.matmul(x.to(hp), weight.to(hp).t())
            else:
                spec_x, spec_w = fp.casts
                if state.fused:  # delayed scaling inside the casts, one pass per operand
                    (xq, x_col), (wq, w_col) = state.fused_forward(x, weight, spec_x, spec_w, recipe)
                else:  # a dual cast writes the layout a backward GEMM reads in the same pass
                    x_dual = need_wgrad and plan.x_dual
                    key = shared_cast.cast_key(spec_x, recipe, state.x_scale, x_dual)
                    shared = shared_cast.lookup(x, key)  # q/k/v, gate/up: one cast of their input
                    xq, x_col = shared or cast_pair(x, spec_x, recipe, state.x_scale, x_dual)
                    if shared is None:
                        shared_cast.store(x, key, (xq, x_col))
                    w_dual = plan.w_dual or (
                        plan.w_square and cfg.weight_cache is not None
                    )  # frozen: both layouts kept
                    make_w = lambda: cast_pair(weight, spec_w, recipe, state.w_scale, need_dgrad and w_dual)  # noqa: E731
                    wq, w_col = cfg.weight_cache(make_w) if cfg.weight_cache is not None else make_w()
                out = scaled_mm(xq, wq.t(), hp, path=recipe.gemm, use_fast_accum=recipe.use_fast_accum)
                state.observe(INPUT, x, xq)
                state.observe(WEIGHT, weight, wq)
            # What grad_input needs: the weight, cast for a GEMM contracting over N.
            w_saved = None
            if need_dgrad:
                reuse = plan.w_reused or (plan.w_square and cfg.weight_cache is not None)
                w_saved = (wq if w_col is None else w_col) if reuse else weight
                if reuse and cfg.recast_weight and wq is not None:  # FSDP / ZeRO-3: no FP8 copy kept
                    w_saved = SavedWeight(weight, wq.scale)
            # What grad_weight needs: the input, cast for a GEMM contracting over M.
            x_saved = None
            if need_wgrad:
                wg = plan.wgrad
                if wg.high_precision or not recipe.save_fp8_activations:
                    x_saved = x.to(hp)
                elif x_col is not None:
                    x_saved = x_col
                else:
                    spec_xw = wg.casts[1]
                    x_saved = cast(x, spec_xw, 0, recipe, handed_scale(spec_xw, state.x_scale))
        save_operands(ctx, (w_saved, x_saved), cfg=cfg, state=state, x_dtype=x.dtype, w_dtype=weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dy):
        w_saved, x_saved = saved_operands(ctx)
        cfg, state = ctx.cfg, ctx.state
        recipe, hp, plan = cfg.recipe, cfg.hp_dtype, cfg.plan
        dg, wg = plan.dgrad, plan.wgrad
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = dyq_col = dy_first = None  # dy_first: dY's first FP8 cast, for telemetry
        with torch_autocast_off(dy.device.type):
            dy_scale = state.grad_scale(dy, recipe)
            if need_dgrad:
                if dg.high_precision:
                    grad_x = torch.matmul(dy.to(hp), w_saved.to(hp))
                else:
                    if need_wgrad and plan.dy_dual:  # grad_weight reads the second layout
                        if state.fused:
                            dyq, dyq_col = state.fused_grad(dy, dg.a, recipe)
                        else:
                            dyq, dyq_col = cast_both_layouts(dy, dg.a, recipe, dy_scale)
                    else:
                        dyq = cast(dy, dg.a, 1, recipe, handed_scale(dg.a, dy_scale))
                    dy_first = dyq
                    if isinstance(w_saved, SavedWeight):  # the forward's cast again: its scale, same bits
                        w_rows, w_col = cast_pair(w_saved.weight, dg.b, recipe, w_saved.scale, plan.w_dual)
                        w_saved = w_rows if w_col is None else w_col
                    wq = w_saved if isinstance(w_saved, Float8Data) else cast(w_saved, dg.b, 0, recipe)
                    grad_x = scaled_mm(dyq, wq, hp, path=recipe.gemm)
                grad_x = grad_x.to(ctx.x_dtype)
            if need_wgrad:
                if wg.high_precision:
                    grad_w = torch.matmul(dy.t().to(hp), x_saved.to(hp))
                else:
                    dyq = dyq_col if dyq_col is not None else cast(dy, wg.a, 0, recipe, handed_scale(wg.a, dy_scale))
                    dy_first = dyq if dy_first is None else dy_first
                    # the input was kept in high precision when save_fp8_activations is off
                    xq = x_saved if isinstance(x_saved, Float8Data) else cast(x_saved, wg.b, 0, recipe)
                    grad_w = scaled_mm(dyq.t(), xq, torch.float32, path=recipe.gemm)
                grad_w = grad_w.to(ctx.w_dtype)
            if dy_first is not None:
                state.observe(GRAD_OUTPUT, dy, dy_first)
        return grad_x, grad_w, None, None


def linear_gemms(
    layer: Float8Linear, x2: torch.Tensor, recipe: Recipe, hp: torch.dtype, state: CastState
) -> torch.Tensor:
    """``layer``'s output for 2-D ``x2`` through :class:`Float8LinearFn` (bias not added)."""
    plan = recipe.plan
    recast = recast_weight_in_backward(layer, layer.weight, recipe)  # sharded weight: no FP8 copy kept
    grads = torch.is_grad_enabled() and x2.requires_grad
    cache = None if recast else frozen_weight_cache(layer, layer.weight, recipe, plan, grads)
    return Float8LinearFn.apply(x2, layer.gemm_weight(), FnConfig(recipe, hp, plan, cache, recast), state)


class ScaledGemmKind(base.Kind):
    """A kind whose three GEMMs are :class:`Float8LinearFn`'s (tensor, axis or block scales)."""

    def cast_state(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe) -> CastState:
        """The per-call object the GEMMs ask for scales handed in and telemetry."""
        return CastState(layer.fp8_stats if layer.fp8_telemetry else None)

    def forward(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe, hp: torch.dtype) -> torch.Tensor:
        return linear_gemms(layer, x2, recipe, hp, self.cast_state(layer, x2, recipe))

    def forward_weight_cast(self, layer: Float8Linear, recipe: Recipe) -> Float8Data | BlockScaledData:
        fp = recipe.plan.fprop
        if self.keeps_history or fp.high_precision:
            return super().forward_weight_cast(layer, recipe)  # the refusal
        with torch.no_grad():
            return cast(layer.gemm_weight(), fp.casts[1], 1, recipe)
