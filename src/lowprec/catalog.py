"""FP8 recipe names, what they mean and which fields they read: the one torch-free table.

Layer 0: imports nothing of lowprec and no torch, so the launcher, the wizard, the trainer's
schema and the engine (:class:`lowprec.fp8.Recipe`) all read the same names, presets and
messages. Each recipe runs one scaling *kind* (``RecipeInfo.scaling``: tensorwise, delayed,
rowwise, blockwise, mxfp8, nvfp4), whose engine side is one module, ``lowprec/fp8/kinds/<kind>.py``;
each kind has a row of its own name here, which also says what the torch-free layers check
(FP8 all-gather, tensor parallelism, export). Adding a kind means that module plus one row;
adding a recipe of an existing kind means one row (a preset).

A recipe's scale comes from an amax history or from the tensor itself (:class:`ScaleSource`), at a
*granularity* (how many elements share one scale: tensor, row, block, microblock); the table of
them is generated into ``docs/backends.md`` (:func:`recipes_markdown`).

The microscaling recipes (``mxfp8``: 1x32 blocks with E8M0 scales; ``nvfp4``: E2M1 with 1x16
E4M3-scaled blocks) are named here like the others; TE's switches
(``use_mxfp8_block_scaling``, ``use_nvfp4_block_scaling``) map to them through
:func:`te_switch_recipe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Iterable, Mapping
from lowprec.errors import did_you_mean

__all__ = [
    "ScaleSource",
    "Granularity",
    "RecipeInfo",
    "RECIPES",
    "RECIPE_NAMES",
    "SCALING_FIELDS",
    "FIELD_DEFAULTS",
    "FIELD_MINIMUMS",
    "FIELD_MAXIMUMS",
    "RECIPE_FIELDS",
    "RecipeOption",
    "RECIPE_OPTIONS",
    "check_int_field",
    "FSDP_FP8_ALL_GATHER_UNSUPPORTED",
    "check_fsdp_fp8_all_gather",
    "check_tensor_parallel",
    "TE_SWITCHES",
    "te_switch_recipe",
    "recipe_info",
    "kind_info",
    "export_holds",
    "register_recipe",
    "unregister_recipe",
    "unread_recipe_fields",
    "recipes_reading",
    "recipes_markdown",
]


class ScaleSource(str, Enum):
    """Where a scale comes from."""

    DELAYED = "delayed"  # from the amaxes of earlier steps (an amax history)
    DYNAMIC = "dynamic"  # from the tensor being cast, at cast time


class Granularity(str, Enum):
    """How many elements share one scale."""

    TENSOR = "tensor"  # one scale per tensor
    AXIS = "axis"  # one scale per row (slice across the contraction dim)
    BLOCK = "block"  # one scale per tile
    MICRO = "microblock"  # one scale per 32 (MXFP8) or 16 (NVFP4) elements, hardware block formats


# One default per field, for every entry point (Recipe, TERecipeKwargs, launch, wizard, docs).
# amax_compute_algo: Accelerate documents "most_recent" for TERecipeKwargs and has always
# forwarded it there; the engine's Recipe said "max" (TransformerEngine's DelayedScaling
# default). The engine now takes Accelerate's documented default too; a recipe built by name
# without the field therefore uses "most_recent" (docs/LOG.md, settings entry records the change).
FIELD_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "fp8_format": "HYBRID",
        "margin": 0,
        "amax_history_len": 1024,
        "amax_compute_algo": "most_recent",
        "interval": 1,
        "override_linear_precision": (False, False, False),
        "use_during_eval": False,
        "block_size": 128,
        "scale_rounding": "rceil",  # MXFP8's E8M0 rule: never saturates (fp8/cast/mx.py says why)
    }
)

# Every field of lowprec.fp8.Recipe (a test keeps this equal to the dataclass's fields).
RECIPE_FIELDS = (
    *FIELD_DEFAULTS,
    "scaling",
    "power_of_2_scales",
    "dgrad_weight_tensorwise",
    "gemm",
    "use_fast_accum",
    "save_fp8_activations",
    "fp8_activations",
    "reduce_amax",
    "force_recompute_fp8_weight_in_bwd",
    "seed",
    "high_precision_last",
    "name",
)

# The one range check of each integer field (Recipe, kwargs, launch flags/YAML/env, wizard).
FIELD_MINIMUMS: Mapping[str, int] = MappingProxyType({"amax_history_len": 1, "interval": 1, "margin": 0})
# every FP8 tensor keeps amax_history_len float32 amaxes (TransformerEngine's default is 1024):
# 10**9 allocated 4 GB per tensor and ran out of memory a minute into the run
FIELD_MAXIMUMS: Mapping[str, int] = MappingProxyType({"amax_history_len": 16384})


def check_int_field(name: str, value: Any, convert: bool = True) -> int:
    """``value`` as an integer within its field's range; ``ValueError`` naming the field.
    ``convert=False`` (the engine's dataclass) takes ints only, not ``"3"``."""
    minimum = FIELD_MINIMUMS[name]
    if isinstance(value, bool) or (not convert and not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not isinstance(value, int):
        try:
            value = int(str(value).strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{value} is too small; {name} must be an integer >= {minimum}")
    maximum = FIELD_MAXIMUMS.get(name)
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{value} is too large; {name} must be at most {maximum} (each FP8 tensor keeps that "
            "many float32 amaxes; 16 to 1024 is usual)"
        )
    return value


@dataclass(frozen=True)
class RecipeOption:
    """A scaling field users choose by name: the launch flag ``--fp8_<name>``, the launch
    YAML's ``fp8_config.<name>``, its variable, and the question ``lowprec config`` asks when
    the chosen backend and recipe read it (the wizard's questions are generated from
    :data:`RECIPE_OPTIONS`). ``choices`` empty: an integer with its :data:`FIELD_MINIMUMS`
    floor. ``accelerate``: Accelerate/TransformerEngine know it (``ACCELERATE_FP8_<NAME>``);
    else lowprec's engine alone reads it (``LOWPREC_FP8_<NAME>``)."""

    name: str
    question: str
    choices: tuple[str, ...] = ()
    accelerate: bool = True

    @property
    def default(self) -> Any:
        return FIELD_DEFAULTS[self.name]

    @property
    def setting(self) -> str:
        """The launch setting's name (flag, ``LaunchSettings`` field)."""
        return f"fp8_{self.name}"


# In the order the wizard asks them. interval is a launch setting the wizard leaves at its default.
RECIPE_OPTIONS: Mapping[str, RecipeOption] = MappingProxyType(
    {
        o.name: o
        for o in (
            RecipeOption("margin", "Scaling margin (powers of two of headroom)?"),
            RecipeOption("amax_history_len", "Amax history length?"),
            RecipeOption("amax_compute_algo", "Amax compute algorithm?", ("max", "most_recent")),
            RecipeOption(
                "scale_rounding",
                "MXFP8 scale rounding (rceil: never saturates; floor: the OCP spec's)?",
                ("rceil", "floor"),
                accelerate=False,
            ),
        )
    }
)


# Fields that mean something for some scaling kinds only; a recipe that does not read one of
# them gets an error (trainer, launch) or a warning (Python API) when it is set.
SCALING_FIELDS = (
    "margin",
    "amax_history_len",
    "amax_compute_algo",
    "interval",
    "block_size",
    "reduce_amax",
    "scale_rounding",
    "seed",
    "high_precision_last",
)
_DELAYED_FIELDS = ("margin", "amax_history_len", "amax_compute_algo", "interval", "reduce_amax")

# TransformerEngine's recipe switches (TERecipeKwargs fields, ACCELERATE_FP8_* variables) and the
# native recipe each one names
TE_SWITCHES: Mapping[str, str] = MappingProxyType(
    {
        "use_mxfp8_block_scaling": "mxfp8",
        "use_nvfp4_block_scaling": "nvfp4",
    }
)


def te_switch_recipe(switches: Mapping[str, Any]) -> str | None:
    """The native recipe named by TE's switches that are on (``None``: DelayedScaling);
    ``ValueError`` when more than one is on."""
    on = [k for k in TE_SWITCHES if switches.get(k)]
    if len(on) > 1:
        raise ValueError(f"{' and '.join(on)} are both set; TransformerEngine runs one recipe: keep one")
    return TE_SWITCHES[on[0]] if on else None


FSDP_FP8_ALL_GATHER_UNSUPPORTED = (
    "fp8_enable_fsdp_float8_all_gather works with the tensorwise, delayed, rowwise, blockwise and mxfp8 "
    "recipes on lowprec's engine, not {recipe!r} (NVFP4's per-tensor scale and stochastically rounded "
    "tiles are not built for it); use one of those recipes or drop fp8_enable_fsdp_float8_all_gather"
)


def _kind_row(recipe: str, scaling: str | None) -> "RecipeInfo":
    """The catalog row of a recipe's kind: ``scaling`` where a built Recipe is at hand, else
    read from the recipe's name."""
    return kind_info(scaling if scaling is not None else recipe_info(recipe).scaling)


def check_fsdp_fp8_all_gather(recipe: str, scaling: str | None = None) -> None:
    """The one rule "FP8 all-gather needs scales a shard can compute" (tensorwise, delayed, rowwise,
    blockwise, mxfp8), for every caller (the YAML
    trainer, the launch flags, the native backend, the FSDP2 wrapper). ``recipe``: the recipe's
    name; ``scaling``: its scaling kind where a built Recipe is at hand (else read from the
    name). ``ValueError`` with the one message otherwise."""
    if not _kind_row(recipe, scaling).fp8_all_gather:
        raise ValueError(FSDP_FP8_ALL_GATHER_UNSUPPORTED.format(recipe=recipe))


def check_tensor_parallel(recipe: str, scaling: str | None = None, what: str = "tensor parallel FP8") -> None:
    """The one rule "tensor (and sequence) parallel FP8 needs whole-tensor scales", for every
    caller (launch flags, the YAML trainer, the engine's TP layers). ``what`` names the setting
    for the message; ``ValueError`` otherwise."""
    if not _kind_row(recipe, scaling).tensor_parallel:
        raise ValueError(
            f"{what} needs whole-tensor scales agreed across the shards, which fp8_recipe {recipe!r} does not "
            "have; set fp8_recipe: tensorwise"
        )


@dataclass(frozen=True)
class RecipeInfo:
    """A named recipe: its meaning and the :class:`lowprec.fp8.Recipe` field values it sets
    (``preset``, plain values: no torch here). The capabilities (``fp8_all_gather`` and on) are
    read from the row of the recipe's kind (:func:`kind_info`)."""

    name: str
    source: ScaleSource
    granularity: Granularity
    summary: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()  # which SCALING_FIELDS it reads
    scaling: str = ""  # the engine's Recipe.scaling: its kind (lowprec/fp8/kinds/); empty: the name
    # FSDP2 can all-gather the weight in FP8: one scale for the whole weight, agreed by every rank
    fp8_all_gather: bool = False
    # tensor-parallel and sequence-parallel FP8 (local GEMMs with whole-tensor scales)
    tensor_parallel: bool = False
    # the compressed-tensors weight scheme that holds this kind's forward weight cast as trained
    # ("tensor", "channel", "block" FP8; "mxfp8", "nvfp4": its microscaled schemes, which hf-fp8
    # does not hold); None: no export layout holds it
    export_scheme: str | None = None

    def __post_init__(self) -> None:
        if not self.scaling:
            object.__setattr__(self, "scaling", self.name)


_ROWWISE = {"fp8_format": "E4M3", "power_of_2_scales": True}
_RECIPES: dict[str, RecipeInfo] = dict(
    {
        r.name: r
        for r in (
            RecipeInfo(
                "delayed",
                ScaleSource.DELAYED,
                Granularity.TENSOR,
                "per-tensor scale from an amax history (TransformerEngine DelayedScaling)",
                {"scaling": "delayed"},
                _DELAYED_FIELDS,
                fp8_all_gather=True,
                export_scheme="tensor",
            ),
            RecipeInfo(
                "tensorwise",
                ScaleSource.DYNAMIC,
                Granularity.TENSOR,
                "per-tensor scale from this tensor's amax (torchao default)",
                {"scaling": "tensorwise"},
                ("margin",),
                fp8_all_gather=True,
                tensor_parallel=True,
                export_scheme="tensor",
            ),
            RecipeInfo(
                "rowwise",
                ScaleSource.DYNAMIC,
                Granularity.AXIS,
                "per-row power-of-two scales, E4M3 everywhere (torchao rowwise)",
                {"scaling": "rowwise", **_ROWWISE},
                fp8_all_gather=True,
                export_scheme="channel",
            ),
            RecipeInfo(
                "rowwise_with_gw_hp",
                ScaleSource.DYNAMIC,
                Granularity.AXIS,
                "rowwise; weight-gradient GEMM in high precision, weight tensorwise for dgrad",
                {
                    "scaling": "rowwise",
                    **_ROWWISE,
                    "dgrad_weight_tensorwise": True,
                    "override_linear_precision": (False, False, True),
                },
                scaling="rowwise",
            ),
            RecipeInfo(
                "blockwise",
                ScaleSource.DYNAMIC,
                Granularity.BLOCK,
                "1x128 activation/gradient tiles, 128x128 weight tiles, power-of-two scales (DeepSeek-V3)",
                {"scaling": "blockwise", **_ROWWISE},
                ("block_size",),
                fp8_all_gather=True,
                export_scheme="block",
            ),
            RecipeInfo(
                "mxfp8",
                ScaleSource.DYNAMIC,
                Granularity.MICRO,
                "MXFP8 (OCP MX v1.0): E4M3, one E8M0 power-of-two scale per 32 elements along the "
                "contraction dim, each GEMM orientation cast from the source (TE MXFP8BlockScaling)",
                {"scaling": "mxfp8", "fp8_format": "E4M3"},
                ("scale_rounding",),
                fp8_all_gather=True,
                export_scheme="mxfp8",
            ),
            RecipeInfo(
                "nvfp4",
                ScaleSource.DYNAMIC,
                Granularity.MICRO,
                "NVFP4: E2M1 + E4M3 scale per 16 + fp32 tensor scale, 16x16 weight tiles, stochastic "
                "rounding of gradients, Hadamard on wgrad inputs, last 15% of layers high precision "
                "(TE NVFP4BlockScaling)",
                {"scaling": "nvfp4", "fp8_format": "E4M3", "high_precision_last": 0.15},
                ("seed", "high_precision_last"),
                export_scheme="nvfp4",
            ),
        )
    }
)
RECIPES: Mapping[str, RecipeInfo] = MappingProxyType(_RECIPES)  # read-only; register_recipe adds
RECIPE_NAMES: tuple[str, ...] = tuple(RECIPES)  # the built-in recipes
# other spellings users write (TE's class names, torchao's recipe names)
_ALIASES = {
    "mx_fp8": "mxfp8",
    "mxfp8_block_scaling": "mxfp8",
    "mx": "mxfp8",
    "mxfp8_rceil": "mxfp8",
    "nv_fp4": "nvfp4",
    "nvfp4_block_scaling": "nvfp4",
}


def recipe_info(name: Any) -> RecipeInfo:
    """The recipe called ``name`` (any case, ``-`` or ``_``); ``ValueError`` with a hint."""

    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in RECIPES:
        raise ValueError(
            f"unknown FP8 recipe {name!r}{did_you_mean(key, RECIPES)}; choose one of {', '.join(RECIPE_NAMES)}"
        )
    return RECIPES[key]


def kind_info(scaling: str) -> RecipeInfo:
    """The row of the scaling kind ``scaling`` (a Recipe's ``scaling``): each kind has one of its
    own name, which says what the torch-free layers may do with it."""
    info = RECIPES.get(scaling)
    if info is None or info.scaling != scaling:
        raise ValueError(f"scaling kind {scaling!r} has no catalog row of its own name")
    return info


def export_holds(fmt: str, info: RecipeInfo) -> bool:
    """Whether the export format ``fmt`` can hold the weights a kind trains (``info``: its row):
    compressed-tensors every kind with an ``export_scheme`` (MXFP8 / NVFP4 in its microscaled
    schemes), hf-fp8 (FP8 in 128x128 blocks) only the FP8 ones, not the microscaled."""
    return info.export_scheme is not None and (fmt == "compressed-tensors" or info.granularity is not Granularity.MICRO)


def register_recipe(info: RecipeInfo) -> None:
    """Add a recipe row (a new kind's, with its module in ``lowprec/fp8/kinds/``, or a preset of
    an existing kind); ``ValueError`` if the name is taken. ``RECIPE_NAMES`` lists the built-ins."""
    if info.name in _RECIPES:
        raise ValueError(f"recipe {info.name!r} is already in the catalog")
    _RECIPES[info.name] = info


def unregister_recipe(name: str) -> None:
    if name in RECIPE_NAMES:
        raise ValueError(f"recipe {name!r} is built in")
    _RECIPES.pop(name, None)


def unread_recipe_fields(name: str, fields: Iterable[str]) -> list[str]:
    """Which of ``fields`` (engine field names) the recipe ``name`` never reads."""
    reads = set(recipe_info(name).reads)
    return sorted(f for f in fields if f in SCALING_FIELDS and f not in reads)


def recipes_reading(field: str) -> list[str]:
    """The built-in recipes that read the engine field ``field`` (for "read by ..." in errors)."""
    return [name for name, info in RECIPES.items() if field in info.reads]


def recipes_markdown() -> str:
    """The docs table of recipes, generated from :data:`RECIPES`."""
    rows = [
        "| recipe | kind (`fp8/kinds/`) | scale from | granularity | reads | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in RECIPES.values():
        reads = ", ".join(r.reads) or "-"
        rows.append(f"| {r.name} | {r.scaling} | {r.source.value} | {r.granularity.value} | {reads} | {r.summary} |")
    return "\n".join(rows)
