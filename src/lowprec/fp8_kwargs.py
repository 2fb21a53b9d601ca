"""The FP8 recipe handlers a script passes in ``kwargs_handlers`` (Accelerate's names).

Every field resolves once, in ``__post_init__``: the explicit argument (checked by the field's
one parser, :mod:`lowprec.config.values`), else its ``ACCELERATE_FP8_*`` variable (read by the
one reader, :func:`lowprec.config.env.read_env`), else the one default
(:data:`lowprec.catalog.FIELD_DEFAULTS`). Unlike Accelerate (reference section 8, bug 10),
``to_kwargs()`` returns *every* resolved value. Wrong types fail here, at construction, with
one line naming the field, not later inside ``prepare``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Mapping, Optional, cast

from lowprec.catalog import (
    FIELD_DEFAULTS,
    RECIPE_FIELDS,
    TE_SWITCHES,
    recipe_info,
    te_switch_recipe,
    unread_recipe_fields,
)
from lowprec.config import values as V
from lowprec.kwargs_base import FP8_PREFIX, ForwardEveryField, _alias, env_get, environ
from lowprec.backends.spec import ENGINE_SETTINGS, RECIPE_SETTINGS, recipe_field, get_spec, lookup, spec_or_native
from lowprec.config.env import ENV_VARS, check_fp8_fields, read_env
from lowprec.errors import did_you_mean
from lowprec.guard_settings import (
    GUARD_FIELDS,
    check_act_with_fp8_all_gather,
    check_count,
    check_health_for_guard,
    check_recover_needs_act,
    check_scope_needs_act,
    check_thresholds,
    guard_mode,
    guard_scope,
    health_on,
    python_spelling,
)

__all__ = [
    "RecipeKwargs",
    "TERecipeKwargs",
    "MSAMPRecipeKwargs",
    "AORecipeKwargs",
    "NativeRecipeKwargs",
    "FP8RecipeKwargs",
    "normalize_backend",
    "recipe_kwargs_from_config",
]

_CATALOG = object()  # "the field's default is lowprec.catalog.FIELD_DEFAULTS's"


def _setting(name: str, default: Any = _CATALOG) -> Any:
    """A handler field that is the launch setting ``name`` (it shares its variable and its
    parser): ``None`` until :func:`_resolve_fields` resolves it."""
    return field(default=None, metadata={"setting": name, "default": default})


def _default(f: dataclasses.Field) -> Any:
    default = f.metadata["default"]
    return FIELD_DEFAULTS[recipe_field(f.metadata["setting"])] if default is _CATALOG else default


def _parser(setting: str) -> Callable[[Any], Any]:
    if setting == "fp8_override_linear_precision":
        return V.parse_override_linear_precision
    return next(v.parse for v in ENV_VARS if v.field == setting)


def _resolve_fields(obj: Any) -> None:
    """Each :func:`_setting` field of ``obj``: explicit > ``ACCELERATE_FP8_*`` > default,
    through the setting's one parser."""

    fields = [f for f in dataclasses.fields(obj) if "setting" in f.metadata]
    from_env = read_env(environ(), {f.metadata["setting"] for f in fields})
    for f in fields:
        setting, value = f.metadata["setting"], getattr(obj, f.name)
        if value is None:
            value = from_env.get(setting, _default(f))
        else:
            try:
                value = _parser(setting)(value)
            except ValueError as err:
                raise ValueError(f"{type(obj).__name__}({f.name}={value!r}): {err}") from None
        object.__setattr__(obj, f.name, value)


def _check_type(obj: Any, name: str, ok: bool, expected: str) -> None:
    if not ok:
        value = getattr(obj, name)
        raise TypeError(f"{type(obj).__name__}({name}={value!r}): expected {expected}, got {type(value).__name__}")


def normalize_backend(value: Any, key: str = "fp8_backend") -> Optional[str]:
    """``te`` / ``TE`` / ``transformer_engine`` -> ``te``; ``no`` / empty -> None (any case)."""

    spec = lookup(value, key)
    return None if spec is None else spec.name


@dataclass(frozen=True)
class RecipeKwargs(ForwardEveryField):
    """Base of the FP8 recipe handlers; ``backend`` names the backend it asks for."""

    backend = "native"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # the FP8 guard watches lowprec's own layers (their telemetry): a handler of another
        # library's backend has no such fields, and asking for them is one line, not a TypeError
        fields = getattr(cls, "__dataclass_fields__", {})
        asked = [k for k in GUARD_FIELDS if k in kwargs and k not in fields]
        if asked:
            raise ValueError(
                f"{cls.__name__}({asked[0]}=...): the FP8 guard and health signals read lowprec's telemetry, "
                f"which {cls.__name__}'s backend's layers do not have; drop {asked[0]} or use "
                "NativeRecipeKwargs (lowprec's engine)"
            )
        return super().__new__(cls)


@dataclass(frozen=True)
class TERecipeKwargs(RecipeKwargs):
    """TransformerEngine ``DelayedScaling`` recipe (runs on the native engine without TE).

    ``use_mxfp8_block_scaling`` asks for TE's MXFP8BlockScaling, ``use_nvfp4_block_scaling``
    (lowprec's name for TE's ``NVFP4BlockScaling``; env ``ACCELERATE_FP8_USE_NVFP4_BLOCK_SCALING``)
    for NVFP4: TE runs them where installed, the native ``mxfp8`` / ``nvfp4`` recipes elsewhere."""

    use_autocast_during_eval: Optional[bool] = _setting("fp8_use_autocast_during_eval")
    margin: Optional[int] = _setting("fp8_margin")
    interval: Optional[int] = _setting("fp8_interval")
    fp8_format: Optional[str] = _setting("fp8_format")
    amax_history_len: Optional[int] = _setting("fp8_amax_history_len")
    amax_compute_algo: Optional[str] = _setting("fp8_amax_compute_algo")
    override_linear_precision: Optional[Any] = _setting("fp8_override_linear_precision")
    use_mxfp8_block_scaling: Optional[bool] = None
    use_nvfp4_block_scaling: Optional[bool] = None
    # spellings written by the `accelerate config` wizard (reference section 3.4, bug 5)
    amax_history_length: InitVar[Optional[int]] = None
    amax_compute_algorithm: InitVar[Optional[str]] = None

    backend = "te"

    def __post_init__(self, amax_history_length=None, amax_compute_algorithm=None) -> None:
        _alias(self, "amax_history_len", "amax_history_length", amax_history_length)
        _alias(self, "amax_compute_algo", "amax_compute_algorithm", amax_compute_algorithm)
        self._resolve_te_fields()

    def _resolve_te_fields(self) -> None:
        _resolve_fields(self)
        for name in TE_SWITCHES:
            value = getattr(self, name)
            if value is None:
                value = env_get(FP8_PREFIX + name.upper()) or False
                key = f"environment variable {FP8_PREFIX}{name.upper()}"
            else:
                key = name
            try:
                object.__setattr__(self, name, V.parse_bool(value))
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
        te_switch_recipe(vars(self))  # both on: one message


@dataclass(frozen=True)
class MSAMPRecipeKwargs(RecipeKwargs):
    """MS-AMP optimisation level: O1 (FP8 weight gradients and all-reduce) or O2 (also FP8/FP16
    Adam moments). Runs on lowprec's own O1/O2 when MS-AMP is not installed."""

    opt_level: Optional[str] = _setting("fp8_opt_level", "O2")
    optimization_level: InitVar[Optional[str]] = None  # the docs' and the wizard's spelling

    backend = "msamp"

    def __post_init__(self, optimization_level=None) -> None:
        _alias(self, "opt_level", "optimization_level", optimization_level)
        _resolve_fields(self)


_PLAIN_DATA = (bool, int, float, str, bytes, list, tuple, dict, set)


@dataclass(frozen=True)
class AORecipeKwargs(RecipeKwargs):
    """torchao ``Float8Linear`` training (runs the same tensorwise recipe natively without torchao).

    ``enable_fsdp_float8_all_gather`` only takes effect under FSDP2: elsewhere it would replace
    the weights with new Parameter objects behind the optimizer's back (reference bug 1).
    ``recipe``: a torchao recipe name (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``);
    lowprec's extension, used when ``config`` is not given. ``use_autocast_during_eval``
    (lowprec's extension, env ``ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL``): FP8 in
    ``model.eval()`` too; off by default as for TE (Accelerate's AO path had no switch, bug 15).
    ``force_recompute_fp8_weight_in_bwd`` (env ``ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD``,
    Accelerate PR 4109's name): ``None`` (auto) / ``True`` / ``False``, the native engine's
    :class:`~lowprec.fp8.Recipe` field; torchao's own layers always keep the high-precision weight
    for backward, so only ``False`` there is a request it cannot honour (logged once).
    """

    config: Optional[Any] = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = _setting("fp8_pad_inner_dim", True)
    enable_fsdp_float8_all_gather: Optional[bool] = _setting("fp8_enable_fsdp_float8_all_gather", True)
    recipe: Optional[str] = None
    use_autocast_during_eval: Optional[bool] = _setting("fp8_use_autocast_during_eval")
    force_recompute_fp8_weight_in_bwd: Optional[bool] = _setting("fp8_force_recompute_fp8_weight_in_bwd", None)

    backend = "torchao"

    def __post_init__(self) -> None:
        _resolve_fields(self)
        _check_type(
            self, "config", not isinstance(self.config, _PLAIN_DATA), "a torchao.float8.Float8LinearConfig (or None)"
        )
        if self.recipe is not None:
            try:
                object.__setattr__(
                    self, "recipe", V.choice(self.recipe, ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
                )
            except ValueError as err:
                raise ValueError(f"AORecipeKwargs(recipe=...): {err}") from None
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError("module_filter_func must be a callable (module, fqn) -> bool")


@dataclass(frozen=True)
class NativeRecipeKwargs(RecipeKwargs):
    """lowprec's own engine, by recipe name: ``delayed``, ``tensorwise``, ``rowwise``,
    ``rowwise_with_gw_hp``, ``blockwise`` (env ``LOWPREC_FP8_RECIPE``). ``overrides`` sets single
    :class:`lowprec.fp8.Recipe` fields (``reduce_amax=False`` keeps per-rank delayed-scaling
    amaxes); ``enable_fsdp_float8_all_gather`` (env ``ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER``,
    default off) all-gathers FSDP2 weights in FP8 (tensorwise only); ``force_recompute_fp8_weight_in_bwd``
    (env ``ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD``, default auto: where FSDP / ZeRO-3 shards
    the weight) re-casts the weight in backward instead of keeping its FP8 copy (the
    :class:`~lowprec.fp8.Recipe` field; an explicit ``overrides`` entry wins); ``ACCELERATE_FP8_*`` variables that are *set* (as
    ``lowprec launch`` writes them) override the named preset too, explicit ``overrides`` win.
    A field the named recipe accepts but does not read (``amax_history_len`` for
    ``tensorwise``) is kept, as Accelerate would, with one warning. ``module_filter_func(module,
    fqn) -> bool`` picks layers; ``skip_first_last`` / ``skip_patterns`` are the engine's
    conversion defaults. The engine's :class:`~lowprec.fp8.Recipe` is built once, here (so a bad
    combination fails at construction with the engine's message); :meth:`to_recipe` returns it."""

    recipe: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    module_filter_func: Optional[Callable] = None
    skip_first_last: bool = True
    skip_patterns: tuple = ("lm_head", "router", "gate")
    # the fix named when no layer converts (None: this class's skip_first_last field); a caller
    # with its own settings (lowprec train) names those instead
    nothing_converted_hint: Optional[str] = None
    use_autocast_during_eval: Optional[bool] = _setting("fp8_use_autocast_during_eval")
    # off unless asked for on the native engine (torchao's handler defaults it on): it changes
    # what FSDP2 gathers and needs the tensorwise recipe, so it is never switched on silently
    enable_fsdp_float8_all_gather: Optional[bool] = _setting("fp8_enable_fsdp_float8_all_gather", False)
    # None (auto): re-cast the weight in backward where FSDP / ZeRO-3 shards it (Recipe field)
    force_recompute_fp8_weight_in_bwd: Optional[bool] = _setting("fp8_force_recompute_fp8_weight_in_bwd", None)
    # the FP8 guard (lowprec train's keys, same names, defaults and rules: lowprec.guard_settings),
    # checked every fp8_health_every optimizer steps (the trainer: at its logging steps)
    fp8_guard: Any = "off"
    fp8_guard_patience: int = 3
    fp8_guard_recover_after: Optional[int] = None
    fp8_guard_scope: str = "layer"
    fp8_guard_thresholds: Optional[Mapping[str, float]] = None
    fp8_health: Optional[bool] = None
    fp8_health_sqnr_every: int = 50
    fp8_health_every: int = 10

    backend = "native"

    def __post_init__(self) -> None:
        self._check_guard()
        name = self.recipe if self.recipe is not None else (env_get("LOWPREC_FP8_RECIPE") or "tensorwise")
        object.__setattr__(self, "recipe", recipe_info(name).name)  # unknown names / MXFP8: one message
        _check_type(self, "overrides", isinstance(self.overrides, Mapping), "a mapping of Recipe fields")
        _check_type(self, "skip_first_last", isinstance(self.skip_first_last, bool), "True or False")
        _check_type(
            self,
            "skip_patterns",
            isinstance(self.skip_patterns, (list, tuple)) and all(isinstance(p, str) for p in self.skip_patterns),
            "a list of strings",
        )
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError("module_filter_func must be a callable (module, fqn) -> bool")
        object.__setattr__(self, "overrides", {**_env_recipe_overrides(), **dict(self.overrides)})
        object.__setattr__(self, "skip_patterns", tuple(self.skip_patterns))
        _resolve_fields(self)
        try:
            all_gather = self.enable_fsdp_float8_all_gather
            check_act_with_fp8_all_gather(self.fp8_guard, all_gather, python_spelling, "enable_fsdp_float8_all_gather")
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self._check_overrides()
        # torch: the launcher reads the backends' declarations, and so these classes, without it
        from lowprec.fp8.recipes import Recipe

        overrides = dict(self.overrides)
        overrides.setdefault("use_during_eval", self.use_autocast_during_eval)
        overrides.setdefault("force_recompute_fp8_weight_in_bwd", self.force_recompute_fp8_weight_in_bwd)
        with warnings.catch_warnings():  # _check_overrides said it in this handler's own words
            warnings.filterwarnings("ignore", message=r"Recipe\.from_name.*does not read", category=UserWarning)
            object.__setattr__(self, "_recipe", Recipe.from_name(self._name, **overrides))

    def _check_guard(self) -> None:
        """The guard's fields, by the rules ``lowprec train``'s schema applies to its keys."""
        spell = python_spelling
        try:
            guard = guard_mode(self.fp8_guard, spell)
            for key in ("fp8_guard_patience", "fp8_health_sqnr_every", "fp8_health_every"):
                check_count(key, getattr(self, key), spell)
            if self.fp8_guard_recover_after is not None:
                check_count("fp8_guard_recover_after", self.fp8_guard_recover_after, spell)
            if self.fp8_health is not None and not isinstance(self.fp8_health, bool):
                raise ValueError(f"{spell('fp8_health', self.fp8_health)} is not True, False or None")
            thresholds = check_thresholds(self.fp8_guard_thresholds)
            check_recover_needs_act(self.fp8_guard_recover_after, guard, spell)
            guard_scope(self.fp8_guard_scope, spell)
            check_scope_needs_act(self.fp8_guard_scope, guard, spell)
            check_health_for_guard(guard, self.fp8_health, spell)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        object.__setattr__(self, "fp8_guard", guard)
        object.__setattr__(self, "fp8_guard_thresholds", thresholds)

    @property
    def fp8_health_on(self) -> bool:
        """The Accelerator records health signals (and runs the guard, unless ``off``)."""
        return health_on(self.fp8_guard, self.fp8_health)

    @property
    def _name(self) -> str:
        """``recipe`` from ``__post_init__`` on: a preset's name (None became the default there)."""
        return cast(str, self.recipe)

    def _check_overrides(self) -> None:
        known = set(RECIPE_FIELDS)
        for key in self.overrides:
            if key not in known:
                raise ValueError(f"unknown recipe field(s) {key!r}{did_you_mean(key, known)}")
        unread = unread_recipe_fields(self._name, self.overrides)
        if unread:
            warnings.warn(
                f"NativeRecipeKwargs: the {self.recipe} recipe does not read {', '.join(unread)}; "
                "they have no effect (pick a recipe that reads them, or drop them)",
                UserWarning,
                stacklevel=3,
            )

    def to_recipe(self):
        """The engine recipe (built once, in ``__post_init__``)."""
        return self._recipe


def _env_recipe_overrides() -> dict[str, Any]:
    """Recipe fields from the ``ACCELERATE_FP8_*`` variables that are set (unset ones leave the
    named preset's own values, e.g. rowwise's E4M3)."""

    # use_autocast_during_eval is the handler's own field, resolved in __post_init__
    tuning = tuple(s for s in (*RECIPE_SETTINGS, *ENGINE_SETTINGS) if s != "fp8_use_autocast_during_eval")
    return {recipe_field(k): v for k, v in read_env(environ(), tuning).items()}


_FP8_WARNED = [False]


@dataclass(frozen=True)
class FP8RecipeKwargs(TERecipeKwargs):
    """Deprecated (as in Accelerate): ``backend="te"`` or ``"msamp"`` plus that backend's fields.

    Unlike Accelerate it validates ``opt_level``, does not need TE for MS-AMP, and never leaks
    ``backend`` into the TE recipe (reference bug 9). :meth:`to_handler` gives the modern class.
    """

    backend: Optional[str] = None  # type: ignore[assignment]
    opt_level: Optional[str] = _setting("fp8_opt_level", "O2")
    optimization_level: InitVar[Optional[str]] = None

    def __post_init__(self, amax_history_length=None, amax_compute_algorithm=None, optimization_level=None) -> None:
        if not _FP8_WARNED[0]:
            _FP8_WARNED[0] = True
            warnings.warn(
                "FP8RecipeKwargs is deprecated; use TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs "
                "or NativeRecipeKwargs",
                FutureWarning,
                stacklevel=3,
            )
        _alias(self, "amax_history_len", "amax_history_length", amax_history_length)
        _alias(self, "amax_compute_algo", "amax_compute_algorithm", amax_compute_algorithm)
        _alias(self, "opt_level", "optimization_level", optimization_level)
        legacy = (TERecipeKwargs, MSAMPRecipeKwargs)  # the two classes Accelerate's FP8RecipeKwargs covered
        raw = self.backend if self.backend is not None else env_get(FP8_PREFIX + "BACKEND")
        if raw is None:  # Accelerate's rule: MS-AMP when installed, else TE
            raw = (
                MSAMPRecipeKwargs.backend if get_spec(MSAMPRecipeKwargs.backend).available() else TERecipeKwargs.backend
            )
        spec = lookup(raw, "backend")
        if spec is None or spec.kwargs_class not in legacy:
            raise ValueError(f"FP8RecipeKwargs backend={raw!r}; use 'te' or 'msamp' (or AORecipeKwargs for torchao)")
        object.__setattr__(self, "backend", spec.name)
        self._resolve_te_fields()  # its fields and MSAMPRecipeKwargs's opt_level

    def to_handler(self) -> RecipeKwargs:
        cls = get_spec(cast(str, self.backend)).kwargs_class  # a backend name from __post_init__ on
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def recipe_kwargs_from_config(config: Mapping[str, Any]) -> RecipeKwargs:
    """The handler for a YAML ``fp8_config:`` block, parsed by the launch schema
    (:class:`lowprec.config.launch_config.FP8Config`, the one ``fp8_config`` parser) and mapped
    by the backend's declaration; unknown keys and keys the backend does not read are errors."""
    # pydantic and PyYAML: the engine (lowprec.optim) imports this module and stays free of them
    from lowprec.config.launch_config import parse_fp8_config

    fields = parse_fp8_config(config)
    backend = fields.pop("fp8_backend", None)
    fields.pop("fp8_fallback", None)  # the Accelerator's fp8_fallback=, not a recipe field
    check_fp8_fields(backend, fields.get("fp8_recipe"), fields, lambda k: f"fp8_config.{k.removeprefix('fp8_')}")
    return spec_or_native(backend).handler_from_fields(fields)
