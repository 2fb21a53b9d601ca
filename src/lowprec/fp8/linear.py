"""Float8Linear: a drop-in ``nn.Linear`` whose three GEMMs run in FP8.

GEMMs and dtypes (``x``: input (M, K), ``W``: weight (N, K), ``dY``: grad of output (M, N)):

==============  =====================  ======================  =========================  =======
GEMM            A operand              B operand               per-tensor recipes         output
==============  =====================  ======================  =========================  =======
output          x      (contract K)    W^T   (contract K)      E4M3 x E4M3                hp [1]
grad_input      dY     (contract N)    W     (contract N)      E5M2 [2] x E4M3            hp [1]
grad_weight     dY^T   (contract M)    x     (contract M)      E5M2 [2] x E4M3            float32
==============  =====================  ======================  =========================  =======

[1] hp = the autocast dtype inside ``torch.autocast`` (bf16), else the input's dtype.
[2] E5M2 with ``Format.HYBRID``; E4M3 with ``Format.E4M3`` and for rowwise/blockwise.
Rowwise casts each operand with one scale per slice across its contraction dim; blockwise
with 1x128 tiles along the contraction dim (128x128 blocks for W). ``override_linear_precision``
runs a GEMM in hp instead. The bias is added in hp outside the FP8 GEMM.

What backward keeps (the memory story): the FP8 copy of ``x`` quantized for the weight-
gradient GEMM (1 byte/element, against 2 for a bf16 Linear's saved input) and, for per-tensor
recipes, the FP8 weight from the forward GEMM (a tensor scale serves both orientations).
Rowwise re-casts the weight from the Parameter in backward (a reference, no extra memory),
since its grad_input GEMM needs scales along the other axis; blockwise does too (same values:
the cast is deterministic), so that backward keeps no FP8 weight. Linears that read one
input (q/k/v, gate/up) share its cast, so they keep one FP8 copy of it between them
(``shared_cast.py``).

Delayed scaling (per-tensor, TransformerEngine semantics): each operand keeps an amax history
buffer. The scale used at step t is built from amaxes recorded at steps < t and refreshed
every ``interval`` steps; while no finite non-zero amax has been recorded (the first step, or
after all-zero inputs) the current tensor's amax is used, so step 0 is exactly tensorwise.
Gradient histories are updated in backward.

Layout of the code: ``_Float8LinearFn`` is the three GEMMs and their casts; which cast one GEMM
hands to another is decided once per recipe (``LinearPlan``); scales handed in, scaling-state
updates and telemetry go through one per-call object (``cast_state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8 import kernels, shared_cast
from lowprec.fp8.autocast import (
    current_eval_override,
    current_recipe_override,
    fp8_enabled,
    recomputing,
    recomputing_unmarked,
    torch_autocast_dtype,
    torch_autocast_off,
)
from lowprec.fp8.block_cast import cast_block_both, quantize_square_transposed
from lowprec.fp8.cast_state import GRAD_OUTPUT, INPUT, WEIGHT, CastState, DelayedCastState
from lowprec.fp8.frozen import drop_frozen_cache, frozen_weight_cache
from lowprec.fp8.gathered import as_float8_data
from lowprec.fp8.tp_linear import is_tensor_parallel, tp_forward
from lowprec.fp8.gemm import scaled_mm
from lowprec.fp8.mx_linear import MX_STATE_BUFFER, init_mx_state, mx_linear
from lowprec.fp8.quantize import Float8Data, quantize
from lowprec.fp8.recipes import BLOCK_SCALED, LinearPlan, OperandCast, Recipe
from lowprec.fp8.saved import save_operands, saved_operands
from lowprec.fp8.sharding import SavedWeight, recast_weight_in_backward, reshape_output
from lowprec.fp8.scaling import amax_to_scale, delayed_scale_step

__all__ = ["Float8Linear", "delayed_scale_step", "plain_module", "state_epoch"]

OPERANDS = ("input", "weight", "grad_output")
# the scaling state a layer keeps across steps (in its state_dict)
STATE_BUFFERS = (
    tuple(f"fp8_amax_history_{o}" for o in OPERANDS)
    + tuple(f"fp8_scale_{o}" for o in OPERANDS)
    + ("fp8_step", "fp8_step_grad", MX_STATE_BUFFER)
)


_EPOCH = [0]  # bumped by every write of scaling state from outside a step (load, reset)


def state_epoch() -> int:
    """A counter that changes whenever any layer's scaling state is loaded or reset, so that a
    copy of the state (``step_stage.py``) knows it is stale without reading every layer."""
    return _EPOCH[0]


def _cast(x: torch.Tensor, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
    """Quantize a 2-D operand for a GEMM that contracts over dim ``contract``."""
    pre = as_float8_data(x, spec.dtype, spec.granularity)  # FSDP2 FP8 all-gather: already cast
    if pre is not None:
        return pre
    if spec.granularity == "block":
        bs = recipe.block_size
        if spec.block_2d and contract == 0:  # W for grad_input: written transposed on CUDA
            return quantize_square_transposed(x, spec.dtype, bs, recipe.power_of_2_scales)
        block = (bs, bs) if spec.block_2d else ((1, bs) if contract == 1 else (bs, 1))
        return quantize(x, spec.dtype, "block", block=block, power_of_2=recipe.power_of_2_scales)
    return quantize(
        x,
        spec.dtype,
        spec.granularity,
        dim=contract,
        scale=scale,
        margin=recipe.margin,
        power_of_2=recipe.power_of_2_scales,
    )


def _cast_both_layouts(t: torch.Tensor, spec: OperandCast, recipe: Recipe, scale=None) -> tuple[Float8Data, Float8Data]:
    """The casts of ``x``, ``W`` or ``dY`` for two GEMMs: ``(row-major, contracting dim 1;
    column-major, contracting dim 0)``.

    On CUDA with the Triton kernels (``lowprec.fp8.kernels``) one pass writes both: for a
    per-tensor scale the FP8 tensor and its transpose (TransformerEngine's cast_transpose),
    for axis scales the row-scaled cast and the column-scaled one, transposed (after one read
    for the column amaxes), for 1-D blocks the 1x128 and the 128x1 tiles (``block_cast.py``).
    The second is handed over as a column-major view, so the other GEMM finds its operand
    already in the layout ``scaled_mm`` asks cuBLAS for, and nothing is copied. Elsewhere: one per-tensor cast serving both, or two axis casts. Values are
    identical either way; only the memory layout differs.
    """
    pre = as_float8_data(t, spec.dtype, spec.granularity)  # FSDP2 FP8 all-gather: already cast
    if pre is not None:
        return pre, pre
    pow2 = recipe.power_of_2_scales
    if spec.granularity == "block":  # 1x128 + 128x1 tiles, or square blocks and their transpose, in one pass
        return cast_block_both(t, spec.dtype, recipe.block_size, pow2, square=spec.block_2d)
    fused = t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.dim() == 2 and kernels.available(t.device)
    if spec.granularity == "tensor" and fused:
        if scale is None:
            scale = amax_to_scale(kernels.amax(t), spec.dtype, margin=recipe.margin, power_of_2=pow2)
        q, qt, _ = kernels.cast_transpose_amax(t, scale, spec.dtype)
        return Float8Data(q, scale, "tensor", None, pow2), Float8Data(qt.t(), scale, "tensor", None, pow2)
    if spec.granularity == "axis" and fused:
        col_scale = amax_to_scale(kernels.amax_cols(t), spec.dtype, power_of_2=pow2)
        q, row_scale, qt = kernels.cast_rowwise_dual(t, col_scale, spec.dtype, pow2)
        return Float8Data(q, row_scale, "axis", None, pow2), Float8Data(qt.t(), col_scale, "axis", None, pow2)
    rows = _cast(t, spec, 1, recipe, scale)
    return rows, (_cast(t, spec, 0, recipe) if spec.granularity == "axis" else rows)


_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cast_pair(
    t: torch.Tensor, spec: OperandCast, recipe: Recipe, scale, dual: bool
) -> tuple[Float8Data, Float8Data | None]:
    """``(cast for the forward GEMM, column-major cast for a backward GEMM or None)``."""
    if dual:
        return _cast_both_layouts(t, spec, recipe, scale)
    return _cast(t, spec, 1, recipe, scale), None


def _tensor_scale(spec: OperandCast, scale):
    """A per-tensor scale handed in (delayed scaling) applies to tensor-granularity casts only."""
    return scale if spec.granularity == "tensor" else None


@dataclass(frozen=True)
class _FnConfig:
    recipe: Recipe
    hp_dtype: torch.dtype
    plan: LinearPlan  # recipe.plan(), built once per recipe
    weight_cache: Any = None  # a frozen weight's cast store (fp8/frozen.py), or None
    # keep the weight and the forward's scale, not its FP8 cast, for grad_input (fp8/sharding.py)
    recast_weight: bool = False


class _Float8LinearFn(torch.autograd.Function):
    """The three GEMMs of the table above and their casts. Scales handed in, state updates and
    telemetry go through ``state`` (:mod:`lowprec.fp8.cast_state`); which cast serves which
    GEMM is decided once, in ``cfg.plan``."""

    @staticmethod
    def forward(ctx, x, weight, cfg: _FnConfig, state: CastState):
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
                    xq, x_col = shared or _cast_pair(x, spec_x, recipe, state.x_scale, x_dual)
                    if shared is None:
                        shared_cast.store(x, key, (xq, x_col))
                    w_dual = plan.w_dual or (
                        plan.w_square and cfg.weight_cache is not None
                    )  # frozen: both layouts kept
                    make_w = lambda: _cast_pair(weight, spec_w, recipe, state.w_scale, need_dgrad and w_dual)  # noqa: E731
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
                    x_saved = _cast(x, spec_xw, 0, recipe, _tensor_scale(spec_xw, state.x_scale))
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
                            dyq, dyq_col = _cast_both_layouts(dy, dg.a, recipe, dy_scale)
                    else:
                        dyq = _cast(dy, dg.a, 1, recipe, _tensor_scale(dg.a, dy_scale))
                    dy_first = dyq
                    if isinstance(w_saved, SavedWeight):  # the forward's cast again: its scale, same bits
                        w_rows, w_col = _cast_pair(w_saved.weight, dg.b, recipe, w_saved.scale, plan.w_dual)
                        w_saved = w_rows if w_col is None else w_col
                    wq = w_saved if isinstance(w_saved, Float8Data) else _cast(w_saved, dg.b, 0, recipe)
                    grad_x = scaled_mm(dyq, wq, hp, path=recipe.gemm)
                grad_x = grad_x.to(ctx.x_dtype)
            if need_wgrad:
                if wg.high_precision:
                    grad_w = torch.matmul(dy.t().to(hp), x_saved.to(hp))
                else:
                    dyq = dyq_col if dyq_col is not None else _cast(dy, wg.a, 0, recipe, _tensor_scale(wg.a, dy_scale))
                    dy_first = dyq if dy_first is None else dy_first
                    # the input was kept in high precision when save_fp8_activations is off
                    xq = x_saved if isinstance(x_saved, Float8Data) else _cast(x_saved, wg.b, 0, recipe)
                    grad_w = scaled_mm(dyq.t(), xq, torch.float32, path=recipe.gemm)
                grad_w = grad_w.to(ctx.w_dtype)
            if dy_first is not None:
                state.observe(GRAD_OUTPUT, dy, dy_first)
        return grad_x, grad_w, None, None


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


M = TypeVar("M", bound=nn.Module)


def plain_module(src: nn.Module, cls: type[M], **dims: int) -> M:
    """A ``cls`` module (its ``__init__`` not run: no fresh weights) holding ``src``'s weight and
    bias Parameters, its train/eval mode and its hooks; ``dims`` are ``cls``'s size attributes."""
    mod = cls.__new__(cls)
    nn.Module.__init__(mod)
    for name, value in dims.items():
        setattr(mod, name, value)
    mod.weight, mod.bias = src.weight, src.bias
    mod.train(src.training)
    _copy_hooks(src, mod)
    return mod


def _copy_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Carry every per-module hook across a swap, so conversion is invisible to hook users."""
    for name in _HOOK_DICTS:
        if hasattr(src, name) and hasattr(dst, name):
            getattr(dst, name).update(getattr(src, name))


class Float8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs (see module docstring); ``fp8.autocast(enabled=False)`` turns
    them off for a region.

    Build it with :meth:`from_linear` (what ``fp8.convert`` does): the new module holds the
    *same* ``weight`` and ``bias`` Parameter objects, so an optimizer built before conversion
    keeps training them, and ``state_dict`` keys are those of ``nn.Linear`` plus, for delayed
    scaling, the scaling state (amax histories, scales, step counters).
    """

    # buffers (register_buffer in _init_fp8), declared for type checkers; the delayed ones exist
    # under delayed scaling only
    fp8_stats: torch.Tensor
    fp8_step: torch.Tensor
    fp8_step_grad: torch.Tensor
    fp8_last_scales: torch.Tensor
    fp8_amax_history_input: torch.Tensor
    fp8_amax_history_weight: torch.Tensor
    fp8_amax_history_grad_output: torch.Tensor
    fp8_scale_input: torch.Tensor
    fp8_scale_weight: torch.Tensor
    fp8_scale_grad_output: torch.Tensor
    recipe: Recipe
    fp8_telemetry: bool
    # True: all three GEMMs of this layer run in high precision (the autocast dtype, bf16), as if
    # it were a plain nn.Linear; what fp8.guard sets to move one unhealthy layer out of FP8 (a
    # Recipe cannot override all three GEMMs: it rejects that as "turn FP8 off instead")
    high_precision: bool

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe or Recipe.from_name("tensorwise"))

    def _init_fp8(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.fp8_telemetry = False
        self.high_precision = False
        device = self.weight.device
        if recipe.scaling == "delayed":
            for o in OPERANDS:
                self.register_buffer(f"fp8_amax_history_{o}", torch.zeros(recipe.amax_history_len, device=device))
                self.register_buffer(f"fp8_scale_{o}", torch.ones((), device=device))
            self.register_buffer("fp8_step", torch.zeros((), dtype=torch.int64, device=device))
            self.register_buffer("fp8_step_grad", torch.zeros((), dtype=torch.int64, device=device))
            # the (input, weight) scales of the last forward, replayed by an activation-checkpoint
            # recompute (fp8.checkpoint) so it casts exactly as the first forward did
            self.register_buffer("fp8_last_scales", torch.ones(2, device=device), persistent=False)
        init_mx_state(self, recipe)  # block-scaled recipes (fp8/mx_linear.py)
        # (amax, scale, saturated fraction, underflow fraction) x (input, weight, grad_output)
        self.register_buffer("fp8_stats", torch.zeros(3, 4, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> "Float8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        _copy_hooks(linear, new)
        new._init_fp8(recipe)
        return new

    def to_linear(self) -> nn.Module:
        """The plain ``nn.Linear`` with the same Parameter objects (and the same hooks)."""
        return plain_module(self, nn.Linear, in_features=self.in_features, out_features=self.out_features)

    def reset_parameters(self) -> None:
        """Re-initialise weight and bias (as nn.Linear) *and* the FP8 scaling state, so a model
        converted on the meta device and materialised with ``to_empty`` starts clean."""
        super().reset_parameters()
        if hasattr(self, "fp8_stats"):  # nn.Linear.__init__ calls this before _init_fp8
            self.reset_fp8_state()

    def reset_fp8_state(self) -> None:
        drop_frozen_cache(self)
        _EPOCH[0] += 1
        with torch.no_grad():
            self.fp8_stats.zero_()
            if self.recipe.scaling == "delayed":
                for o in OPERANDS:
                    getattr(self, f"fp8_amax_history_{o}").zero_()
                    getattr(self, f"fp8_scale_{o}").fill_(1.0)
                self.fp8_step.zero_()
                self.fp8_step_grad.zero_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"

    # ------------------------------------------------------------------ forward
    def _active_recipe(self) -> Recipe | None:
        """The recipe this call runs, or None for high precision: FP8 unless an enclosing
        ``fp8.autocast(enabled=False)`` turns it off or the layer is in eval mode and neither
        its recipe nor a region says ``use_during_eval`` (conversion is the switch)."""
        if recomputing_unmarked():  # a checkpoint recompute: the same GEMMs as the first forward
            return self.__dict__.get("_fp8_forward_recipe", self.recipe if self.training else None)
        recipe = self._decide_recipe()
        if not torch.compiler.is_compiling():  # a plain attribute: no module __setattr__, no compile guard
            self.__dict__["_fp8_forward_recipe"] = recipe
        return recipe

    def _decide_recipe(self) -> Recipe | None:
        override = current_recipe_override()
        recipe = override if override is not None else self.recipe
        eval_override = current_eval_override()
        in_eval = recipe.use_during_eval if eval_override is None else eval_override
        if not fp8_enabled() or not (self.training or in_eval) or self.high_precision:
            return None
        if recipe.scaling == "delayed" and not hasattr(self, "fp8_amax_history_input"):
            raise ValueError(
                f"fp8.autocast(recipe={recipe.name!r}) asks for delayed scaling, but this layer was "
                f"converted with {self.recipe.name!r} and has no amax history; convert the model "
                "with a delayed recipe instead"
            )
        return recipe

    def _fused_delayed(self, x2: torch.Tensor, recipe: Recipe) -> bool:
        """Whether this step's delayed scaling runs inside the fused casts (one pass per operand,
        :func:`_cast_delayed_fused`): CUDA with the Triton kernels, every GEMM in FP8, both
        gradients wanted and the FP8 input kept, so that each operand's one cast serves both of
        its GEMMs. Otherwise the scales are computed here first (an amax read per operand)."""
        w = self.weight
        return (
            kernels.available(x2.device)
            and x2.dtype in _HP_DTYPES
            and w.dtype in _HP_DTYPES
            and w.dim() == 2
            and torch.is_grad_enabled()
            and x2.requires_grad
            and w.requires_grad
            and recipe.save_fp8_activations
            and not any(recipe.override_linear_precision)
        )

    def gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMMs read it, (out, in); a layer that stores it otherwise
        (``Float8Conv1D``) returns a view or copy here, so autograd carries the layout back."""
        return self.weight

    def _cast_state(self, x2: torch.Tensor, recipe: Recipe) -> CastState:
        stats = self.fp8_stats if self.fp8_telemetry else None
        if recipe.scaling != "delayed":
            return CastState(stats)
        # replay: the scales of the first forward (its state update already ran)
        mode = "replay" if recomputing() else "fused" if self._fused_delayed(x2, recipe) else "eager"
        return DelayedCastState(self, recipe, x2, mode, stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self._active_recipe()
        if recipe is None or x.numel() == 0:  # an empty batch (e.g. an MoE expert with no tokens)
            return F.linear(x, self.gemm_weight(), self.bias)
        hp = torch_autocast_dtype(x.device.type, x.dtype)
        if is_tensor_parallel(self.weight):  # DTensor weight: local GEMMs, whole-tensor scales
            return tp_forward(self, x, recipe, hp)
        x2 = x.reshape(-1, x.shape[-1])
        if recipe.scaling in BLOCK_SCALED:  # MXFP8 / NVFP4: their own GEMMs (fp8/mx_linear.py)
            out = mx_linear(self, x2, recipe, hp)
        else:
            plan = recipe.plan()
            recast = recast_weight_in_backward(self, self.weight, recipe)  # sharded weight: no FP8 copy kept
            grads = torch.is_grad_enabled() and x2.requires_grad
            cache = None if recast else frozen_weight_cache(self, self.weight, recipe, plan, grads)
            cfg = _FnConfig(recipe, hp, plan, cache, recast)
            out = _Float8LinearFn.apply(x2, self.gemm_weight(), cfg, self._cast_state(x2, recipe))
        out = reshape_output(out, (*x.shape[:-1], self.out_features))  # not a view (FSDP2 warns)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def forward_weight_cast(self) -> Float8Data:
        """The FP8 weight, (out, in), that this layer's forward GEMM reads under its own recipe:
        cast now from the current weight by the function the forward calls, so its values and
        scales are the forward's (what ``lowprec.export`` writes as trained scales). Per-tensor,
        rowwise and blockwise recipes only: delayed scaling takes its weight scale from an amax
        history, MXFP8 / NVFP4 have their own casts (``ValueError``)."""
        recipe = self.recipe
        fp = recipe.plan().fprop if recipe.scaling not in BLOCK_SCALED else None
        if recipe.scaling == "delayed" or fp is None or fp.high_precision:
            raise ValueError(
                f"recipe {recipe.name or recipe.scaling!r}: its forward weight cast is not a "
                "function of the weight alone; quantize the weight with a format's rule instead"
            )
        with torch.no_grad():
            return _cast(self.gemm_weight(), fp.casts[1], 1, recipe)

    # ------------------------------------------------------------------ checkpoints
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        _EPOCH[0] += 1
        # A plain nn.Linear state dict has no scaling state: keep this layer's (fresh) state
        # rather than failing, so `model.load_state_dict(plain_sd)` works after conversion.
        ours = {prefix + name for name in STATE_BUFFERS if hasattr(self, name)}
        missing_ours = [k for k in missing_keys if k in ours]
        if missing_ours and len(missing_ours) == len(ours):
            for k in missing_ours:
                missing_keys.remove(k)
