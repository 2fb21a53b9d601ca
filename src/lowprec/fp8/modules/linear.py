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

from typing import Iterable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.autocast import (
    current_eval_override,
    current_recipe_override,
    fp8_enabled,
    recomputing_unmarked,
    torch_autocast_dtype,
)
from lowprec.fp8.gemm import compile_guard
from lowprec.fp8.modules.frozen import drop_frozen_cache
from lowprec.fp8.kinds.delayed import OPERANDS
from lowprec.fp8.cast.mx import BlockScaledData
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.recipes import Recipe, as_recipe
from lowprec.fp8.cast.scaling import delayed_scale_step
from lowprec.fp8.modules.sharding import reshape_output
from lowprec.fp8.modules.state_dtype import Float32State
from lowprec.fp8.state_epoch import bump_state_epoch, state_epoch
from lowprec.fp8.modules.tp_linear import is_tensor_parallel, tp_forward
from lowprec.guard_moves import GEMMS as GEMM_NAMES

__all__ = [
    "Float8Linear",
    "FP8Switch",
    "bump_state_epoch",
    "delayed_scale_step",
    "plain_module",
    "state_epoch",
    "OPERANDS",
]


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


class FP8Switch:
    """Whether a converted module's next call runs FP8, and with which recipe: shared by
    :class:`Float8Linear` and the grouped experts (``fp8/modules/experts.py``). Conversion is the switch;
    ``fp8.autocast`` regions and eval mode override it (see ``_active_recipe``)."""

    recipe: Recipe
    training: bool
    high_precision: bool

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
        if recipe is not self.recipe:  # a region's recipe: this layer must keep its kind's state
            self._check_region(recipe)
        hp_gemms = self.__dict__.get("_hp_gemms")
        return recipe if hp_gemms is None else self._gemm_recipe(recipe, hp_gemms)

    def _gemm_recipe(self, recipe: Recipe, hp_gemms: tuple[bool, bool, bool]) -> Recipe | None:
        """``recipe`` with this layer's own GEMMs in high precision (the guard's per-GEMM moves,
        :meth:`Float8Linear.set_high_precision_gemms`) added to its ``override_linear_precision``:
        a recipe of this layer's, built once per recipe and kept (the shared one is not changed);
        None when no GEMM is left in FP8."""
        kept = self.__dict__.setdefault("_gemm_recipes", {})
        hit = kept.get(id(recipe))
        if hit is not None and hit[0] is recipe:
            return hit[1]
        olp = tuple(a or b for a, b in zip(recipe.override_linear_precision, hp_gemms))
        derived = None if all(olp) else recipe.replace(override_linear_precision=olp)
        kept[id(recipe)] = (recipe, derived)
        return derived

    def _check_region(self, recipe: Recipe) -> None:
        """A region's recipe of another kind: refused where this module lacks its state."""
        recipe.kind.check_layer(self, recipe)  # type: ignore[arg-type]


class Float8Linear(Float32State, FP8Switch, nn.Linear):
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
        recipe: Recipe | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(as_recipe(recipe, "Float8Linear"))

    def _init_fp8(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.fp8_telemetry = False
        self.high_precision = False
        device = self.weight.device
        recipe.kind.init_state(self)  # the state its scaling kind keeps (delayed: amax histories)
        # (amax, scale, saturated fraction, underflow fraction) x (input, weight, grad_output)
        self.register_buffer("fp8_stats", torch.zeros(3, 4, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str | None = None) -> "Float8Linear":
        recipe = as_recipe(recipe, f"{cls.__name__}.from_linear")
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

    def set_high_precision_gemms(self, gemms: Iterable[str] = ()) -> None:
        """Run these of the layer's GEMMs (``fprop``, ``dgrad``, ``wgrad``) in high precision on
        top of its recipe's ``override_linear_precision`` (the FP8 guard's per-GEMM moves); the
        others keep the recipe's casts and scaling state. ``()``: the recipe's GEMMs again. The
        recipe (shared by every layer) is not changed: the layer keeps its own. Not a field of
        ``state_dict``: the guard's checkpointed moves restore it."""
        names = set(gemms)
        bad = names - set(GEMM_NAMES)
        if bad:
            raise ValueError(f"unknown GEMM(s) {sorted(bad)}; use {', '.join(GEMM_NAMES)}")
        flags = tuple(g in names for g in GEMM_NAMES)
        self.__dict__["_hp_gemms"] = flags if any(flags) else None
        self.__dict__["_gemm_recipes"] = {}

    @property
    def high_precision_gemms(self) -> tuple[str, ...]:
        """The GEMMs :meth:`set_high_precision_gemms` moved (not the recipe's own overrides)."""
        flags = self.__dict__.get("_hp_gemms") or (False, False, False)
        return tuple(g for g, hp in zip(GEMM_NAMES, flags) if hp)

    def gemm_precision(self) -> dict[str, bool]:
        """Each GEMM's effective precision in training under the layer's own recipe: True = high
        precision (``high_precision``, the recipe's override or a per-GEMM move), False = FP8."""
        if self.high_precision:
            return dict.fromkeys(GEMM_NAMES, True)
        moved = self.high_precision_gemms
        return {g: hp or g in moved for g, hp in zip(GEMM_NAMES, self.recipe.override_linear_precision)}

    def reset_fp8_state(self) -> None:
        drop_frozen_cache(self)
        bump_state_epoch()
        with torch.no_grad():
            self.fp8_stats.zero_()
            self.recipe.kind.reset_state(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"

    # ------------------------------------------------------------------ forward
    def gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMMs read it, (out, in); a layer that stores it otherwise
        (``Float8Conv1D``) returns a view or copy here, so autograd carries the layout back."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self._active_recipe()
        if recipe is None or x.numel() == 0:  # an empty batch (e.g. an MoE expert with no tokens)
            return F.linear(x, self.gemm_weight(), self.bias)
        if not x.is_floating_point() or (x.shape[-1] != self.in_features and not is_tensor_parallel(self.weight)):
            return F.linear(x, self.gemm_weight(), self.bias)  # raises nn.Linear's own error
        if torch.compiler.is_compiling():  # LOWPREC_COMPILE_FP8=0, or a kind that cannot compile here
            why = compile_guard.eager_reason(recipe.kind.compile_break(x.device))
            if why is not None:
                return compile_guard.run_eagerly(self._fp8_forward, x, recipe, why=why)
        return self._fp8_forward(x, recipe)

    def _fp8_forward(self, x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        hp = torch_autocast_dtype(x.device.type, x.dtype)
        if is_tensor_parallel(self.weight):  # DTensor weight: local GEMMs, whole-tensor scales
            return tp_forward(self, x, recipe, hp)
        x2 = x.reshape(-1, x.shape[-1])
        out = recipe.kind.forward(self, x2, recipe, hp)  # its scaling kind's GEMMs (fp8/kinds/)
        out = reshape_output(out, (*x.shape[:-1], self.out_features))  # not a view (FSDP2 warns)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def forward_weight_cast(self) -> Float8Data | BlockScaledData:
        """The FP8 (FP4) weight, (out, in), that this layer's forward GEMM reads under its own
        recipe: cast now from the current weight by the function the forward calls, so its values
        and scales are the forward's (what ``lowprec.export`` writes as trained scales): a
        ``Float8Data`` for per-tensor, rowwise and blockwise recipes, a ``BlockScaledData`` for
        MXFP8 / NVFP4. Delayed scaling takes its weight scale from an amax history, and a forward
        GEMM in high precision casts nothing (``ValueError``)."""
        return self.recipe.kind.forward_weight_cast(self, self.recipe)

    # ------------------------------------------------------------------ checkpoints
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        bump_state_epoch()
        # A plain nn.Linear state dict has no scaling state: keep this layer's (fresh) state
        # rather than failing, so `model.load_state_dict(plain_sd)` works after conversion.
        ours = {prefix + name for name in self.recipe.kind.state_buffers if hasattr(self, name)}
        missing_ours = [k for k in missing_keys if k in ours]
        if missing_ours and len(missing_ours) == len(ours):
            for k in missing_ours:
                missing_keys.remove(k)
