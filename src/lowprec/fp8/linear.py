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
and blockwise recipes, the FP8 weight from the forward GEMM (a tensor scale and square blocks
serve both orientations). Rowwise re-casts the weight from the Parameter in backward (a
reference, no extra memory), since its grad_input GEMM needs scales along the other axis.

Delayed scaling (per-tensor, TransformerEngine semantics): each operand keeps an amax history
buffer. The scale used at step t is built from amaxes recorded at steps < t and refreshed
every ``interval`` steps; while no finite non-zero amax has been recorded (the first step, or
after all-zero inputs) the current tensor's amax is used, so step 0 is exactly tensorwise.
Gradient histories are updated in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8 import kernels
from lowprec.fp8.autocast import (
    current_eval_override,
    current_recipe_override,
    fp8_enabled,
    recomputing,
    torch_autocast_dtype,
    torch_autocast_off,
)
from lowprec.fp8.formats import saturation_threshold
from lowprec.fp8.gemm import scaled_mm
from lowprec.fp8.mx_linear import MX_STATE_BUFFER, init_mx_state, mx_linear
from lowprec.fp8.quantize import Float8Data, expand_blocks, quantize
from lowprec.fp8.recipes import BLOCK_SCALED, OperandCast, Recipe
from lowprec.fp8.scaling import amax_to_scale, history_to_amax, record_amax

__all__ = ["Float8Linear", "delayed_scale_step"]

OPERANDS = ("input", "weight", "grad_output")
_STATE_BUFFERS = tuple(f"fp8_amax_history_{o}" for o in OPERANDS) + tuple(
    f"fp8_scale_{o}" for o in OPERANDS
) + ("fp8_step", "fp8_step_grad", MX_STATE_BUFFER)


def delayed_scale_step(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    amax_now: torch.Tensor,
    dtype: torch.dtype,
    recipe: Recipe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of delayed scaling for one operand; pure.

    Returns ``(scale_used, new_history, new_scale)``: the scale to cast this step's tensor
    with (from earlier steps, or from ``amax_now`` while the history holds nothing), the
    history with ``amax_now`` recorded, and the scale for the next step (refreshed when
    ``(step + 1) % interval == 0``, otherwise kept).
    """
    have_history = history_to_amax(history, "max") > 0
    pow2 = recipe.power_of_2_scales
    scale_now = amax_to_scale(amax_now, dtype, margin=recipe.margin, power_of_2=pow2)
    scale_used = torch.where(have_history, scale, scale_now)
    # A non-finite tensor casts with a NaN scale, as current scaling does (scaling.py): the
    # history keeps it out, and the NaN reaches the GEMM output on every kernel path, including
    # the CPU upcast, which does not decode NaN bytes (cpu_gemm.py).
    scale_used = torch.where(torch.isfinite(amax_now), scale_used, torch.full_like(scale_used, float("nan")))
    new_history = record_amax(history, amax_now)
    refresh = ((step + 1) % recipe.interval == 0) | ~have_history
    candidate = amax_to_scale(
        history_to_amax(new_history, recipe.amax_compute_algo), dtype, margin=recipe.margin, power_of_2=pow2
    )
    new_scale = torch.where(refresh, candidate, scale_used)
    return scale_used, new_history, new_scale


def _cast(x: torch.Tensor, spec: OperandCast, contract: int, recipe: Recipe, scale=None) -> Float8Data:
    """Quantize a 2-D operand for a GEMM that contracts over dim ``contract``."""
    if spec.granularity == "block":
        bs = recipe.block_size
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
    for the column amaxes). The second is handed over as a column-major view, so the other
    GEMM finds its operand already in the layout ``scaled_mm`` asks cuBLAS for, and nothing is
    copied. Elsewhere: one per-tensor cast serving both, or two axis casts. Values are
    identical either way; only the memory layout differs.
    """
    fused = t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.dim() == 2 and kernels.available(t.device)
    pow2 = recipe.power_of_2_scales
    if spec.granularity == "tensor" and fused:
        if scale is None:
            scale = amax_to_scale(kernels.amax(t), spec.dtype, margin=recipe.margin, power_of_2=pow2)
        q, qt, _ = kernels.cast_transpose_amax(t, scale, spec.dtype)
        return Float8Data(q, scale, "tensor", None, pow2), Float8Data(qt.t(), scale, "tensor", None, pow2)
    if spec.granularity == "axis" and fused:
        col_scale = amax_to_scale(kernels.amax_cols(t), spec.dtype, power_of_2=pow2)
        q, row_scale, qt = kernels.cast_rowwise_dual(t, col_scale, spec.dtype, pow2)
        return Float8Data(q, row_scale, "axis", None, pow2), Float8Data(qt.t(), col_scale, "axis", None, pow2)
    q = _cast(t, spec, 1, recipe, scale)
    return q, (_cast(t, spec, 0, recipe) if spec.granularity == "axis" else q)


_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cast_delayed_fused(t, spec: OperandCast, recipe: Recipe, hist, scale, step) -> tuple[Float8Data, Float8Data, torch.Tensor]:
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


def _stats(x: torch.Tensor, q: Float8Data) -> torch.Tensor:
    """(amax, scale, saturated fraction, underflow fraction) of one cast, as a float32 (4,)."""
    scale = q.scale
    full = expand_blocks(scale, q.block, x.shape) if q.granularity == "block" else scale
    x32 = x.detach().to(torch.float32)
    scaled = (x32 * full).abs()
    saturated = (scaled > saturation_threshold(q.data.dtype)).float().mean()
    underflow = ((x32 != 0) & (q.data.to(torch.float32) == 0)).float().mean()
    return torch.stack([x32.abs().amax(), scale.amin().to(torch.float32), saturated, underflow])


@dataclass(frozen=True)
class _FnConfig:
    recipe: Recipe
    hp_dtype: torch.dtype
    stats: bool


def _pack(ctx, items: list) -> None:
    """Save tensors and Float8Data through save_for_backward (so saved-tensor hooks see them)."""
    tensors, meta = [], []
    for it in items:
        if isinstance(it, Float8Data):
            meta.append(("fp8", it.granularity, (it.block, it.pow2_scale)))
            tensors += [it.data, it.scale]
        else:
            meta.append(("t" if it is not None else "none", None, None))
            if it is not None:
                tensors.append(it)
    ctx.save_for_backward(*tensors)
    ctx.meta = meta


def _unpack(ctx) -> list:
    tensors = list(ctx.saved_tensors)
    out = []
    for kind, gran, layout in ctx.meta:
        if kind == "fp8":
            data, scale = tensors.pop(0), tensors.pop(0)
            out.append(Float8Data(data, scale, gran, *layout))  # layout: (block, pow2_scale)
        elif kind == "t":
            out.append(tensors.pop(0))
        else:
            out.append(None)
    return out


class _Float8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cfg: _FnConfig, x_scale, w_scale, grad_state, stats, fwd_state=None):
        recipe, hp = cfg.recipe, cfg.hp_dtype
        plan = recipe.plan()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch_autocast_off(x.device.type):
            fp = plan.fprop
            xq = wq = w_col = x_col = None
            if fp.high_precision:
                out = torch.matmul(x.to(hp), weight.to(hp).t())
            else:
                wg = plan.wgrad
                x_both = need_wgrad and recipe.save_fp8_activations and not wg.high_precision and (
                    wg.b == fp.a and wg.b.granularity in ("tensor", "axis")
                )
                if fwd_state is not None:  # delayed scaling, fused (Float8Linear._fused_delayed)
                    hx, sx, hw, sw, step, last = fwd_state
                    xq, x_col, x_used = _cast_delayed_fused(x, fp.a, recipe, hx, sx, step)
                    wq, w_col, w_used = _cast_delayed_fused(weight, fp.b, recipe, hw, sw, step)
                    step.add_(1)
                    last.copy_(torch.stack([x_used, w_used]))
                elif x_both:  # the weight-gradient GEMM reuses this cast: write both layouts at once
                    xq, x_col = _cast_both_layouts(x, fp.a, recipe, x_scale)
                else:
                    xq = _cast(x, fp.a, 1, recipe, x_scale)
                dg = plan.dgrad
                if fwd_state is None and need_dgrad and not dg.high_precision and dg.b == fp.b and fp.b.granularity == "tensor":
                    wq, w_col = _cast_both_layouts(weight, fp.b, recipe, w_scale)  # dgrad reads w_col
                elif fwd_state is None:
                    wq = w_col = _cast(weight, fp.b, 1, recipe, w_scale)
                out = scaled_mm(xq, wq.t(), hp, path=recipe.gemm, use_fast_accum=recipe.use_fast_accum)
                if cfg.stats:
                    stats.index_copy_(0, torch.arange(2, device=stats.device),
                                      torch.stack([_stats(x, xq), _stats(weight, wq)]))

            # What grad_input needs: the weight, cast for a GEMM contracting over N.
            w_saved = None
            if need_dgrad:
                dg = plan.dgrad
                reusable = wq is not None and not dg.high_precision and dg.b == fp.b and (
                    dg.b.granularity == "tensor" or dg.b.block_2d
                )
                w_saved = w_col if reusable else weight
            # What grad_weight needs: the input, cast for a GEMM contracting over M.
            x_saved = None
            if need_wgrad:
                wg = plan.wgrad
                if wg.high_precision or not recipe.save_fp8_activations:
                    x_saved = x.to(hp)
                elif x_col is not None:
                    x_saved = x_col
                else:
                    x_saved = _cast(x, wg.b, 0, recipe, x_scale if wg.b.granularity == "tensor" else None)
        _pack(ctx, [w_saved, x_saved])
        ctx.cfg, ctx.grad_state, ctx.stats = cfg, grad_state, stats
        ctx.fused_delayed = fwd_state is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        w_saved, x_saved = _unpack(ctx)
        cfg = ctx.cfg
        recipe, hp = cfg.recipe, cfg.hp_dtype
        plan = recipe.plan()
        grad_x = grad_w = None
        with torch_autocast_off(dy.device.type):
            dy_scale = None
            if ctx.grad_state is not None and not ctx.fused_delayed:  # delayed: record dY's amax, use the history
                hist, scale, step = ctx.grad_state
                dtype = recipe.fp8_format.backward_dtype
                dy_scale, new_hist, new_scale = delayed_scale_step(hist, scale, step, kernels.amax(dy), dtype, recipe)
                hist.copy_(new_hist)
                scale.copy_(new_scale)
                step.add_(1)
            first_cast: list = []  # (dY, its first FP8 cast), for telemetry

            def cast_dy(spec, contract):
                q = _cast(dy, spec, contract, recipe, dy_scale if spec.granularity == "tensor" else None)
                if not first_cast:
                    first_cast.append(q)
                return q

            dyq_tensor = None  # the cast of dY the weight-gradient GEMM reads, when one pass wrote it
            if ctx.needs_input_grad[0]:
                dg = plan.dgrad
                if dg.high_precision:
                    grad_x = torch.matmul(dy.to(hp), w_saved.to(hp))
                else:
                    wg = plan.wgrad
                    dy_both = dg.a.granularity in ("tensor", "axis") and ctx.needs_input_grad[1] and not wg.high_precision and (
                        wg.a == dg.a
                    )
                    if dy_both and ctx.fused_delayed:  # one pass: cast, amax into the history
                        hist, scale, step = ctx.grad_state
                        dyq, dyq_tensor, _ = _cast_delayed_fused(dy, dg.a, recipe, hist, scale, step)
                        step.add_(1)
                        first_cast.append(dyq)
                    elif dy_both:  # the weight-gradient GEMM reuses this cast: write both layouts at once
                        dyq, dyq_tensor = _cast_both_layouts(dy, dg.a, recipe, dy_scale)
                        first_cast.append(dyq)
                    else:
                        dyq = cast_dy(dg.a, 1)
                        if dg.a.granularity == "tensor":
                            dyq_tensor = dyq
                    wq = w_saved if isinstance(w_saved, Float8Data) else _cast(w_saved, dg.b, 0, recipe)
                    grad_x = scaled_mm(dyq, wq, hp, path=recipe.gemm)
                grad_x = grad_x.to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                wg = plan.wgrad
                if wg.high_precision:
                    grad_w = torch.matmul(dy.t().to(hp), x_saved.to(hp))
                else:
                    reuse = dyq_tensor is not None and wg.a == plan.dgrad.a
                    dyq = dyq_tensor if reuse else cast_dy(wg.a, 0)
                    # the input was kept in high precision when save_fp8_activations is off
                    xq = x_saved if isinstance(x_saved, Float8Data) else _cast(x_saved, wg.b, 0, recipe)
                    grad_w = scaled_mm(dyq.t(), xq, torch.float32, path=recipe.gemm)
                grad_w = grad_w.to(ctx.w_dtype)
            if cfg.stats and first_cast:
                ctx.stats.index_copy_(0, torch.arange(2, 3, device=dy.device), _stats(dy, first_cast[0])[None])
        return grad_x, grad_w, None, None, None, None, None, None


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


def _copy_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Carry every per-module hook across a swap, so conversion is invisible to hook users."""
    for name in _HOOK_DICTS:
        if hasattr(src, name) and hasattr(dst, name):
            getattr(dst, name).update(getattr(src, name))


class Float8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs inside ``lowprec.fp8.autocast()`` (see module docstring).

    Build it with :meth:`from_linear` (what ``fp8.convert`` does): the new module holds the
    *same* ``weight`` and ``bias`` Parameter objects, so an optimizer built before conversion
    keeps training them, and ``state_dict`` keys are those of ``nn.Linear`` plus, for delayed
    scaling, the scaling state (amax histories, scales, step counters).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *, recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe or Recipe.from_name("tensorwise"))

    def _init_fp8(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.fp8_telemetry = False
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

    def to_linear(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the same Parameter objects (and the same hooks)."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        _copy_hooks(self, lin)
        return lin

    def reset_parameters(self) -> None:
        """Re-initialise weight and bias (as nn.Linear) *and* the FP8 scaling state, so a model
        converted on the meta device and materialised with ``to_empty`` starts clean."""
        super().reset_parameters()
        if hasattr(self, "fp8_stats"):  # nn.Linear.__init__ calls this before _init_fp8
            self.reset_fp8_state()

    def reset_fp8_state(self) -> None:
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
        override = current_recipe_override()
        recipe = override if override is not None else self.recipe
        eval_override = current_eval_override()
        in_eval = recipe.use_during_eval if eval_override is None else eval_override
        if not fp8_enabled() or not (self.training or in_eval):
            return None
        if recipe.scaling == "delayed" and not hasattr(self, "fp8_amax_history_input"):
            raise ValueError(
                f"fp8.autocast(recipe={recipe.name!r}) asks for delayed scaling, but this layer was "
                f"converted with {self.recipe.name!r} and has no amax history; convert the model "
                "with a delayed recipe instead"
            )
        return recipe

    def _delayed_scale(self, which: str, t: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> torch.Tensor:
        hist = getattr(self, f"fp8_amax_history_{which}")
        scale = getattr(self, f"fp8_scale_{which}")
        used, new_hist, new_scale = delayed_scale_step(hist, scale, self.fp8_step, kernels.amax(t), dtype, recipe)
        hist.copy_(new_hist)
        scale.copy_(new_scale)
        return used

    def _fused_delayed(self, x2: torch.Tensor, recipe: Recipe) -> bool:
        """Whether this step's delayed scaling runs inside the fused casts (one pass per operand,
        :func:`_cast_delayed_fused`): CUDA with the Triton kernels, every GEMM in FP8, both
        gradients wanted and the FP8 input kept, so that each operand's one cast serves both of
        its GEMMs. Otherwise the scales are computed here first (an amax read per operand)."""
        w = self.weight
        return (
            kernels.available(x2.device) and x2.dtype in _HP_DTYPES and w.dtype in _HP_DTYPES and w.dim() == 2
            and torch.is_grad_enabled() and x2.requires_grad and w.requires_grad
            and recipe.save_fp8_activations and not any(recipe.override_linear_precision)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self._active_recipe()
        if recipe is None or x.numel() == 0:  # an empty batch (e.g. an MoE expert with no tokens)
            return F.linear(x, self.weight, self.bias)
        dev = x.device.type
        hp = torch_autocast_dtype(dev, x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = w_scale = grad_state = fwd_state = None
        if recipe.scaling == "delayed":
            fwd = recipe.fp8_format.forward_dtype
            if recomputing():  # same scales as the first forward; its state update already ran
                x_scale, w_scale = self.fp8_last_scales[0], self.fp8_last_scales[1]
            elif self._fused_delayed(x2, recipe):  # the casts update the state (one pass each)
                fwd_state = (self.fp8_amax_history_input, self.fp8_scale_input, self.fp8_amax_history_weight,
                             self.fp8_scale_weight, self.fp8_step, self.fp8_last_scales)
            else:
                x_scale = self._delayed_scale("input", x2, fwd, recipe)
                w_scale = self._delayed_scale("weight", self.weight, fwd, recipe)
                self.fp8_step.add_(1)
                self.fp8_last_scales.copy_(torch.stack([x_scale, w_scale]))
            grad_state = (self.fp8_amax_history_grad_output, self.fp8_scale_grad_output, self.fp8_step_grad)
        if recipe.scaling in BLOCK_SCALED:  # MXFP8 / NVFP4: their own GEMMs (fp8/mx_linear.py)
            out = mx_linear(self, x2, recipe, hp)
        else:
            cfg = _FnConfig(recipe, hp, self.fp8_telemetry)
            out = _Float8LinearFn.apply(x2, self.weight, cfg, x_scale, w_scale, grad_state, self.fp8_stats, fwd_state)
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    # ------------------------------------------------------------------ checkpoints
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        # A plain nn.Linear state dict has no scaling state: keep this layer's (fresh) state
        # rather than failing, so `model.load_state_dict(plain_sd)` works after conversion.
        ours = {prefix + name for name in _STATE_BUFFERS if hasattr(self, name)}
        missing_ours = [k for k in missing_keys if k in ours]
        if missing_ours and len(missing_ours) == len(ours):
            for k in missing_ours:
                missing_keys.remove(k)
