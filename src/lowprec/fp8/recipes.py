"""Scaling recipes: frozen, validated dataclasses with named constructors.

A recipe answers, for each of the three GEMMs of a Linear layer, which operands are cast to
which FP8 dtype at which granularity. ``Recipe.from_name`` builds the seven named recipes:

================== ========= ================= ============================================
name               scaling   formats           notes
================== ========= ================= ============================================
delayed            per-tensor HYBRID (default) scale from an amax history (TransformerEngine
                                               DelayedScaling); margin, interval, override
tensorwise         per-tensor HYBRID           scale from this tensor's amax (torchao default)
rowwise            per-row    E4M3 everywhere  power-of-two scales (torchao rowwise)
rowwise_with_gw_hp per-row    E4M3             weight-gradient GEMM in high precision; the
                                               weight is tensorwise for grad_input (torchao)
blockwise          tiles      E4M3 everywhere  1x128 activations/gradients, 128x128 weights,
                                               power-of-two scales (DeepSeek-V3)
mxfp8              1x32       E4M3 (HYBRID:    E8M0 power-of-two scale per 32 elements along
                              E5M2 gradients)  the contraction dim, each GEMM orientation cast
                                               from the high-precision source (``fp8/cast/mx.py``)
nvfp4              1x16       E2M1 + E4M3      fp32 tensor scale; 16x16 weight tiles;
                              block scales     stochastic rounding of gradients; Hadamard
                                               transform on the wgrad inputs (``fp8/cast/nvfp4.py``)
================== ========= ================= ============================================
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


from lowprec.catalog import (
    FIELD_DEFAULTS,
    FIELD_MINIMUMS,
    RECIPE_NAMES,
    RECIPE_OPTIONS,
    check_int_field,
    recipe_info,
    unread_recipe_fields,
)
from lowprec.errors import did_you_mean
from lowprec.fp8 import kinds
from lowprec.fp8.cast.formats import Format
from lowprec.fp8.gemm.dispatch import GEMM_PATHS as GEMM_BACKENDS
from lowprec.fp8.kinds.plan import HIGH_PRECISION, GemmCast, LinearPlan, OperandCast

__all__ = ["Recipe", "OperandCast", "GemmCast", "LinearPlan", "RECIPE_NAMES", "as_recipe"]

# names, presets and defaults live in lowprec.catalog (torch-free, shared with the launcher);
# what each scaling kind means for the engine lives in its module, lowprec/fp8/kinds/
SCALE_ROUNDINGS = RECIPE_OPTIONS[
    "scale_rounding"
].choices  # MXFP8's E8M0 rule; fp8/cast/mx.py says why rceil is the default
AMAX_COMPUTE_ALGOS = RECIPE_OPTIONS["amax_compute_algo"].choices
_D = FIELD_DEFAULTS


# (class, every field with its type) -> the Recipe built for it: a request made twice in a
# process (the trainer's schema check, then the settings resolver) gets one object, built once.
_BUILT: dict = {}


def _built_once(cls: type, given: dict[str, Any]) -> "Recipe":
    full = {f.name: f.default for f in dataclasses.fields(cls)} | given
    # the type is part of the key, so margin=True (an error) never finds margin=1's recipe
    key = (cls, tuple((k, type(v), tuple(v) if isinstance(v, list) else v) for k, v in sorted(full.items())))
    try:
        recipe = _BUILT.get(key)
    except TypeError:  # another unhashable value: build it, keep nothing
        return cls(**given)
    if recipe is None:
        recipe = _BUILT[key] = cls(**given)
    return recipe


@dataclass(frozen=True)
class Recipe:
    """An FP8 scaling recipe.

    Fields
    ------
    scaling: a scaling kind, ``delayed`` | ``tensorwise`` | ``rowwise`` | ``blockwise`` | ``mxfp8`` |
        ``nvfp4`` (one module each in ``lowprec/fp8/kinds/``); ``kind`` is its object.
    fp8_format: ``HYBRID`` (E4M3 forward, E5M2 gradients) or ``E4M3``.
    margin: scale = fp8_max / amax / 2**margin (per-tensor recipes).
    amax_history_len, amax_compute_algo, interval: delayed scaling only. The scale used at a
        step comes from the amaxes recorded at earlier steps; it is refreshed every
        ``interval`` steps. The very first step (empty history) uses the current amax.
    override_linear_precision: (fprop, dgrad, wgrad); ``True`` runs that GEMM in high
        precision (TransformerEngine's field).
    power_of_2_scales: round scales down to powers of two.
    dgrad_weight_tensorwise: cast the weight tensorwise for grad_input (rowwise_with_gw_hp).
    block_size: tile edge for blockwise (multiple of 16).
    scale_rounding: MXFP8's E8M0 scale rule, ``rceil`` (default: never saturates; what NVIDIA's
        hardware recipes use) or ``floor`` (the OCP spec's); see ``lowprec/fp8/cast/mx.py``.
    seed: NVFP4's stochastic rounding and Hadamard signs (reproducible from it).
    high_precision_last: NVFP4: the fraction of the convertible Linear layers, the last ones in
        module order, that ``convert`` keeps in high precision (NVIDIA keeps ~15%, mostly the
        last blocks); 0 converts them all.
    gemm: ``auto`` (``torch._scaled_mm`` on FP8 GPUs; on CPU the exact bf16-upcast GEMM unless
        a one-time probe finds ``torch._scaled_mm`` faster; else emulation), ``scaled_mm``
        (require it), ``upcast`` (the CPU path, always) or ``emulate`` (dequantize + float32
        matmul, any device).
    use_fast_accum: fast accumulation in the forward GEMM on Hopper (backward GEMMs always
        accumulate in full precision, as TE and torchao do).
    use_during_eval: keep FP8 on in ``model.eval()`` (off by default, as in TE/Accelerate).
    save_fp8_activations: save the FP8 copy of the input for the weight-gradient GEMM instead
        of the high-precision input (half the activation memory of a bf16 Linear).
    fp8_activations: the non-Linear ops (SwiGLU's ``silu(gate) * up``, RMSNorm) keep E4M3
        copies of their inputs for backward instead of high-precision ones (``fp8/modules/activations.py``;
        outputs unchanged, gradients carry E4M3 rounding of the saved values). Off by default.
        ``convert`` switches it on in the modules that support it and lists them in its report.
    reduce_amax: delayed scaling under data parallelism: the amax histories of every layer are
        MAX-reduced over the data-parallel group once per optimizer step (one collective for
        all layers), so every rank casts with the same scales (TransformerEngine's
        ``DelayedScaling.reduce_amax``, default on there too). ``False`` keeps per-rank
        histories. See :mod:`lowprec.distributed.amax_sync`.
    force_recompute_fp8_weight_in_bwd: what backward keeps of the weight where the forward's FP8
        cast could serve grad_input (per-tensor recipes; nvfp4's 16x16 tiles). ``None`` (auto,
        the default): the FP8 copy, unless FSDP or DeepSpeed ZeRO-3 shards the weight, where a
        reference to the (freed after forward, re-gathered for backward) weight and the forward's
        scale are kept and the weight re-cast in backward (same bits); ``True``: always re-cast
        (1 byte per weight element less held between forward and backward, one more cast in
        backward); ``False``: always keep the FP8 copy (under FSDP: the whole model's weights, in
        FP8, on every rank). torchao's and Accelerate's name. See :mod:`lowprec.fp8.modules.sharding`.
    """

    scaling: str = "tensorwise"
    fp8_format: Format = Format(_D["fp8_format"])
    margin: int = _D["margin"]
    amax_history_len: int = _D["amax_history_len"]
    amax_compute_algo: str = _D["amax_compute_algo"]
    interval: int = _D["interval"]
    override_linear_precision: tuple[bool, bool, bool] = _D["override_linear_precision"]
    power_of_2_scales: bool = False
    dgrad_weight_tensorwise: bool = False
    block_size: int = _D["block_size"]
    gemm: str = "auto"
    use_fast_accum: bool = True
    use_during_eval: bool = _D["use_during_eval"]
    save_fp8_activations: bool = True
    fp8_activations: bool = False
    reduce_amax: bool = True
    force_recompute_fp8_weight_in_bwd: bool | None = None
    scale_rounding: str = _D["scale_rounding"]
    seed: int = 0
    high_precision_last: float = 0.0
    name: str = field(default="", compare=False)
    if TYPE_CHECKING:  # set in __post_init__; not fields at run time (left out of asdict, ==, repr)
        kind: kinds.Kind = field(init=False)  # the scaling kind (lowprec/fp8/kinds/): what the engine asks
        plan: LinearPlan = field(init=False)  # per-GEMM, per-operand casts: Float8Linear's dtype table

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        set_("fp8_format", Format.parse(self.fp8_format))
        set_("scaling", str(self.scaling).lower())
        set_("amax_compute_algo", str(self.amax_compute_algo).lower())
        set_("gemm", str(self.gemm).lower())
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            raise ValueError(
                "override_linear_precision must be three booleans (fprop, dgrad, wgrad), "
                f"got {self.override_linear_precision!r}"
            )
        set_("override_linear_precision", olp)
        kind = kinds.get(self.scaling)  # ValueError naming the known kinds
        set_("kind", kind)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r}; use 'max' or 'most_recent'")
        for name in FIELD_MINIMUMS:  # the catalog's one range check per field
            check_int_field(name, getattr(self, name), convert=False)
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"gemm={self.gemm!r}; use one of {GEMM_BACKENDS}")
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        set_("scale_rounding", str(self.scale_rounding).lower())
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale_rounding={self.scale_rounding!r}; use one of {SCALE_ROUNDINGS}")
        if not isinstance(self.fp8_activations, bool):
            raise ValueError(f"fp8_activations must be true or false, got {self.fp8_activations!r}")
        recompute = self.force_recompute_fp8_weight_in_bwd
        if recompute == "auto":  # YAML's spelling of the default
            set_("force_recompute_fp8_weight_in_bwd", None)
        elif recompute is not None and not isinstance(recompute, bool):
            raise ValueError(f"force_recompute_fp8_weight_in_bwd must be true, false or auto, got {recompute!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        hpl = self.high_precision_last
        if isinstance(hpl, bool) or not isinstance(hpl, (int, float)) or not 0 <= hpl < 1:
            raise ValueError(f"high_precision_last must be a fraction in [0, 1), got {hpl!r}")
        kind.check(self)
        if self.dgrad_weight_tensorwise and "dgrad_weight_tensorwise" not in kind.own_flags:
            raise ValueError("dgrad_weight_tensorwise applies to scaling='rowwise' only")
        if self.margin and not kind.per_tensor:
            raise ValueError(
                f"margin applies to per-tensor scaling; scaling={self.scaling!r} "
                "uses power-of-two per-row/per-block scales: set margin=0"
            )
        if all(olp):
            raise ValueError(
                "override_linear_precision=(True, True, True) runs no GEMM in FP8; "
                "turn FP8 off instead (mixed_precision='bf16')"
            )
        if not self.name:
            set_("name", self.scaling)
        # Built here, once: the fields are frozen, and Float8Linear reads the plan on every
        # call (a plain attribute, which torch.compile traces without a guard on a lock).
        set_("plan", self._build_plan())

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Recipe":
        """One of ``delayed``, ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``,
        ``blockwise``, ``mxfp8``, ``nvfp4``; keyword arguments override single fields."""
        info = recipe_info(name)  # unknown names rejected with the catalog's message
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"unknown recipe field(s) {', '.join(repr(b) + did_you_mean(b, fields) for b in bad)}")
        unread = unread_recipe_fields(info.name, overrides)
        if unread:  # a setting that does nothing is said, never kept silently
            warnings.warn(
                f"Recipe.from_name({info.name!r}): the {info.name} recipe does not read "
                f"{', '.join(unread)}; they have no effect (pick a recipe that reads them, or drop them)",
                UserWarning,
                stacklevel=2,
            )
        return _built_once(cls, {**info.preset, "name": info.name, **overrides})

    def replace(self, **changes: Any) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fp8_format"] = self.fp8_format.value
        d["override_linear_precision"] = list(self.override_linear_precision)
        return d

    # ------------------------------------------------------------------ derived
    @property
    def per_tensor(self) -> bool:
        return self.kind.per_tensor

    def _build_plan(self) -> LinearPlan:
        g = [HIGH_PRECISION if hp else gc for gc, hp in zip(self.kind.gemms(self), self.override_linear_precision)]
        return LinearPlan(g[0], g[1], g[2], save_fp8_input=self.save_fp8_activations)

    def describe(self) -> str:
        """One line per GEMM, e.g. for reports and docs."""
        rows = []
        plan = self.plan
        for gemm in ("fprop", "dgrad", "wgrad"):
            gc: GemmCast = getattr(plan, gemm)
            if gc.high_precision:
                rows.append(f"{gemm}: high precision")
                continue
            a, b = gc.casts
            rows.append(f"{gemm}: {self.kind.describe_operand(a)} x {self.kind.describe_operand(b)}")
        return "; ".join(rows)


def as_recipe(recipe: Any, where: str) -> Recipe:
    """``recipe`` as a :class:`Recipe`: a Recipe as it is, a name (``"delayed"``) through
    :meth:`Recipe.from_name`, None the default (tensorwise); anything else a ``TypeError`` naming
    ``where`` (what was called) and what it takes."""
    if recipe is None or isinstance(recipe, str):
        return Recipe.from_name(recipe or "tensorwise")
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{where}: recipe must be a lowprec.fp8.Recipe or a recipe name ({', '.join(RECIPE_NAMES)}), "
            f"got {type(recipe).__name__}"
        )
    return recipe
