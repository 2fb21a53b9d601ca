"""Kwargs handlers: the Accelerate-named dataclasses a script passes in ``kwargs_handlers``.

Every field resolves once, in ``__post_init__``, in this order: the explicit argument, then the
``ACCELERATE_FP8_*`` environment variable, then the documented default. Unlike Accelerate
(reference section 8, bug 10), ``to_kwargs()`` returns *every* resolved value, so the value a
user reads in the docs is the value the backend receives, not the backend library's default.

All environment reading goes through :func:`environ` (one place, so the CLI's config module can
later supply the mapping instead of ``os.environ``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Mapping, Optional

__all__ = [
    "environ",
    "env_flag",
    "env_int",
    "parse_bool",
    "parse_override_linear_precision",
    "KwargsHandler",
    "AutocastKwargs",
    "GradScalerKwargs",
    "DistributedDataParallelKwargs",
    "InitProcessGroupKwargs",
    "GradientAccumulationPlugin",
    "FullyShardedDataParallelPlugin",
    "DeepSpeedPlugin",
    "RecipeKwargs",
    "TERecipeKwargs",
    "MSAMPRecipeKwargs",
    "AORecipeKwargs",
    "NativeRecipeKwargs",
    "FP8RecipeKwargs",
    "BACKEND_ALIASES",
    "normalize_backend",
    "recipe_kwargs_from_config",
]

FP8_PREFIX = "ACCELERATE_FP8_"


# --------------------------------------------------------------------------- environment
def environ() -> Mapping[str, str]:
    """The one source of environment values for lowprec's Accelerate surface."""
    return os.environ


def env_get(name: str) -> Optional[str]:
    value = environ().get(name)
    return None if value is None or value == "" else value


def env_int(name: str, default: int) -> int:
    """An integer variable; a bad value is an error naming the variable."""
    raw = env_get(name)
    return default if raw is None else _int(f"environment variable {name}")(raw)


_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}


def parse_bool(value: Any, key: str) -> bool:
    """``y/yes/t/true/on/1`` and ``n/no/f/false/off/0`` (any case), as Accelerate's str_to_bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{key}={value!r} is not a boolean; use true or false")


def env_flag(name: str, default: bool = False) -> bool:
    value = env_get(name)
    return default if value is None else parse_bool(value, name)


def parse_override_linear_precision(value: Any, key: str = "override_linear_precision") -> tuple:
    """Accept a tuple, a list, or a string such as ``"(false, false, true)"`` / ``"false,false,true"``.

    Accelerate indexes the string per character (reference section 3.4, bug 6); we parse it.
    """
    if isinstance(value, str):
        text = value.strip().strip("()[]")
        parts = [p for p in (s.strip() for s in text.split(",")) if p]
        value = parts
    if isinstance(value, bool):
        raise ValueError(
            f"{key}={value!r}: give three booleans (fprop, dgrad, wgrad), e.g. (false, false, true)"
        )
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{key}={value!r}: give three booleans (fprop, dgrad, wgrad)") from None
    if len(items) != 3:
        raise ValueError(
            f"{key}={value!r} has {len(items)} entries; give three booleans (fprop, dgrad, wgrad)"
        )
    return tuple(parse_bool(v, key) for v in items)


def _resolve(explicit: Any, env_name: str, default: Any, convert: Callable[[Any], Any] = lambda v: v) -> Any:
    """explicit > ``ACCELERATE_FP8_<env_name>`` > default, converted; an env error names the variable."""
    if explicit is not None:
        return convert(explicit)
    raw = env_get(FP8_PREFIX + env_name)
    if raw is None:
        return convert(default)
    try:
        return convert(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {FP8_PREFIX + env_name}={raw!r}: {err}") from None


def _int(key: str) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {value!r}") from None

    return convert


def _bool(key: str) -> Callable[[Any], bool]:
    return lambda value: parse_bool(value, key)


def _choice(value: Any, key: str, choices: tuple[str, ...], upper: bool = True) -> str:
    text = str(value).upper() if upper else str(value).lower()
    if text not in choices:
        raise ValueError(f"{key}={value!r} is not known; use one of {', '.join(choices)}")
    return text


def _one_of(key: str, choices: tuple[str, ...], upper: bool = True) -> Callable[[Any], str]:
    return lambda value: _choice(value, key, choices, upper)


def _alias(obj: Any, name: str, alias: str, value: Any) -> None:
    """Fold a wizard-spelt alias (``amax_history_length``) into the real field."""
    if value is None:
        return
    if getattr(obj, name) is not None and getattr(obj, name) != value:
        raise ValueError(f"both {name}= and its alias {alias}= were given; keep {name}=")
    object.__setattr__(obj, name, value)


# --------------------------------------------------------------------------- base
@dataclass(frozen=True)
class KwargsHandler:
    """Base of every handler: ``to_dict`` and ``to_kwargs`` return all resolved fields."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}

    def to_kwargs(self) -> dict[str, Any]:
        # Deliberately every field: forwarding only non-defaults lets the backend library's own
        # defaults win silently (Accelerate's TE amax_compute_algo='max' vs documented 'most_recent').
        return self.to_dict()


@dataclass(frozen=True)
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass(frozen=True)
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass(frozen=True)
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def to_kwargs(self) -> dict[str, Any]:
        d = self.to_dict()
        d.pop("check_reduction")  # accepted for Accelerate scripts; DDP deprecated it
        if d["broadcast_buffers"]:
            # DDP's own default; passing it explicitly triggers torch's deprecation warning
            d.pop("broadcast_buffers")
        return d


@dataclass(frozen=True)
class InitProcessGroupKwargs(KwargsHandler):
    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[Any] = None  # datetime.timedelta


@dataclass(frozen=True)
class GradientAccumulationPlugin(KwargsHandler):
    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"gradient accumulation num_steps must be an integer >= 1, got {self.num_steps!r}")


@dataclass(frozen=True)
class FullyShardedDataParallelPlugin(KwargsHandler):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``). ``fsdp_version`` 1 is not supported.

    ``auto_wrap_policy``: ``TRANSFORMER_BASED_WRAP`` (shard each module whose class name is in
    ``transformer_cls_names_to_wrap``), ``SIZE_BASED_WRAP`` (each module holding at least
    ``min_num_params`` parameters of its own subtree) or ``NO_WRAP``; the root is always sharded.
    ``offload_params``: parameters live on CPU between uses (``CPUOffloadPolicy``). Env, as
    ``lowprec launch`` writes them: ``FSDP_VERSION``, ``FSDP_AUTO_WRAP_POLICY``,
    ``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``FSDP_MIN_NUM_PARAMS``, ``FSDP_RESHARD_AFTER_FORWARD``,
    ``FSDP_OFFLOAD_PARAMS``. Checkpoints are always full state dicts.
    """

    fsdp_version: Optional[int] = None
    transformer_cls_names_to_wrap: Optional[tuple] = None
    reshard_after_forward: Optional[bool] = None
    auto_wrap_policy: Optional[str] = None
    min_num_params: Optional[int] = None
    offload_params: Optional[bool] = None

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        version = self.fsdp_version if self.fsdp_version is not None else env_int("FSDP_VERSION", 2)
        if _int("fsdp_version")(version) != 2:
            raise ValueError(
                f"fsdp_version={version}: lowprec supports FSDP2 (fully_shard) only; set fsdp_version: 2"
            )
        s("fsdp_version", 2)
        names = self.transformer_cls_names_to_wrap
        explicit_names = names is not None
        if names is None:
            names = env_get("FSDP_TRANSFORMER_CLS_TO_WRAP") or ()
        if isinstance(names, str):
            names = tuple(n.strip() for n in names.split(",") if n.strip())
        s("transformer_cls_names_to_wrap", tuple(names))
        policy = self.auto_wrap_policy
        if policy is None and not explicit_names:  # explicit class names imply their policy
            policy = env_get("FSDP_AUTO_WRAP_POLICY")
        if policy is None:
            policy = "TRANSFORMER_BASED_WRAP" if names else "NO_WRAP"
        policy = str(policy).upper()
        if policy not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"):
            raise ValueError(f"auto_wrap_policy={policy!r}; use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
        s("auto_wrap_policy", policy)
        min_params = self.min_num_params if self.min_num_params is not None else env_int("FSDP_MIN_NUM_PARAMS", 100_000_000)
        s("min_num_params", _int("min_num_params")(min_params))
        reshard = self.reshard_after_forward
        s("reshard_after_forward", env_flag("FSDP_RESHARD_AFTER_FORWARD", True) if reshard is None
          else parse_bool(reshard, "reshard_after_forward"))
        offload = self.offload_params
        s("offload_params", env_flag("FSDP_OFFLOAD_PARAMS", False) if offload is None
          else parse_bool(offload, "offload_params"))
        for env in ("FSDP_ACTIVATION_CHECKPOINTING", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
            if env_flag(env):
                import logging

                logging.getLogger("lowprec").warning("lowprec: %s=true is not supported by lowprec's FSDP2 path; ignored", env)


@dataclass(frozen=True)
class DeepSpeedPlugin(KwargsHandler):
    """DeepSpeed ZeRO 1-3 (optional extra). Env (as ``lowprec launch`` writes them):
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``,
    ``ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE``, ``ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE``,
    ``ACCELERATE_GRADIENT_CLIPPING``. ``hf_ds_config`` is a dict or a JSON file path."""

    zero_stage: Optional[int] = None
    gradient_clipping: Optional[float] = None
    hf_ds_config: Optional[Any] = None
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        stage = self.zero_stage if self.zero_stage is not None else env_int("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)
        if _int("zero_stage")(stage) not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={stage!r}; use 0, 1, 2 or 3")
        s("zero_stage", int(stage))
        clip = self.gradient_clipping if self.gradient_clipping is not None else env_get("ACCELERATE_GRADIENT_CLIPPING")
        s("gradient_clipping", None if clip is None else float(clip))
        cfg = self.hf_ds_config if self.hf_ds_config is not None else env_get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if isinstance(cfg, str):
            import json

            try:
                with open(cfg) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as err:
                raise ValueError(f"DeepSpeed config file {cfg!r} could not be read: {err}") from None
        s("hf_ds_config", cfg)
        for name, env in (("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                          ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
            value = getattr(self, name) if getattr(self, name) is not None else env_get(env)
            if value is not None and str(value).lower() not in ("none", "cpu", "nvme"):
                raise ValueError(f"{name}={value!r}; use none, cpu or nvme")
            s(name, None if value is None else str(value).lower())


# --------------------------------------------------------------------------- FP8 recipe kwargs
BACKEND_ALIASES = {
    "native": "native",
    "lowprec": "native",
    "ao": "torchao",
    "torchao": "torchao",
    "te": "te",
    "transformer_engine": "te",
    "transformerengine": "te",
    "msamp": "msamp",
    "ms-amp": "msamp",
    "ms_amp": "msamp",
}


def normalize_backend(value: Any, key: str = "fp8_backend") -> Optional[str]:
    """``te`` / ``TE`` / ``transformer_engine`` -> ``te``; ``no`` / empty -> None (any case)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "no", "none", "auto"):
        return None
    if text not in BACKEND_ALIASES:
        raise ValueError(f"{key}={value!r} is not known; use one of native, ao, te, msamp (any case)")
    return BACKEND_ALIASES[text]


@dataclass(frozen=True)
class RecipeKwargs(KwargsHandler):
    """Base of the FP8 recipe handlers; ``backend`` names the engine family it asks for."""

    backend = "native"


@dataclass(frozen=True)
class TERecipeKwargs(RecipeKwargs):
    """TransformerEngine ``DelayedScaling`` recipe (runs on the native engine without TE)."""

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[Any] = None
    use_mxfp8_block_scaling: Optional[bool] = None
    # spellings written by the `accelerate config` wizard (reference section 3.4, bug 5)
    amax_history_length: InitVar[Optional[int]] = None
    amax_compute_algorithm: InitVar[Optional[str]] = None

    backend = "te"

    def __post_init__(self, amax_history_length=None, amax_compute_algorithm=None) -> None:
        _alias(self, "amax_history_len", "amax_history_length", amax_history_length)
        _alias(self, "amax_compute_algo", "amax_compute_algorithm", amax_compute_algorithm)
        self._resolve_te_fields()

    def _resolve_te_fields(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        s("use_autocast_during_eval", _resolve(
            self.use_autocast_during_eval, "USE_AUTOCAST_DURING_EVAL", False, _bool("use_autocast_during_eval")))
        s("margin", _resolve(self.margin, "MARGIN", 0, _int("margin")))
        s("interval", _resolve(self.interval, "INTERVAL", 1, _int("interval")))
        s("fp8_format", _resolve(self.fp8_format, "FORMAT", "HYBRID", _one_of("fp8_format", ("HYBRID", "E4M3", "E5M2"))))
        s("amax_history_len", _resolve(self.amax_history_len, "AMAX_HISTORY_LEN", 1024, _int("amax_history_len")))
        s("amax_compute_algo", _resolve(
            self.amax_compute_algo, "AMAX_COMPUTE_ALGO", "most_recent",
            _one_of("amax_compute_algo", ("max", "most_recent"), upper=False)))
        olp = self.override_linear_precision
        if olp is None:
            olp = tuple(env_flag(FP8_PREFIX + f"OVERRIDE_{g}") for g in ("FPROP", "DGRAD", "WGRAD"))
        s("override_linear_precision", parse_override_linear_precision(olp))
        s("use_mxfp8_block_scaling", _resolve(
            self.use_mxfp8_block_scaling, "USE_MXFP8_BLOCK_SCALING", False, _bool("use_mxfp8_block_scaling")))
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")


@dataclass(frozen=True)
class MSAMPRecipeKwargs(RecipeKwargs):
    """MS-AMP optimisation level: O1 (FP8 weight gradients and all-reduce) or O2 (also FP8/FP16
    Adam moments). Runs on lowprec's own O1/O2 when MS-AMP is not installed."""

    opt_level: Optional[str] = None
    optimization_level: InitVar[Optional[str]] = None  # the docs' and the wizard's spelling

    backend = "msamp"

    def __post_init__(self, optimization_level=None) -> None:
        _alias(self, "opt_level", "optimization_level", optimization_level)
        self._resolve_opt_level()

    def _resolve_opt_level(self) -> None:
        object.__setattr__(self, "opt_level", _resolve(self.opt_level, "OPT_LEVEL", "O2", _one_of("opt_level", ("O1", "O2"))))


@dataclass(frozen=True)
class AORecipeKwargs(RecipeKwargs):
    """torchao ``Float8Linear`` training (runs the same tensorwise recipe natively without torchao).

    ``enable_fsdp_float8_all_gather`` only takes effect under FSDP2: elsewhere it would replace
    the weights with new Parameter objects behind the optimizer's back (reference bug 1).
    ``recipe``: a torchao recipe name (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``);
    lowprec's extension, used when ``config`` is not given. ``use_autocast_during_eval``
    (lowprec's extension, env ``ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL``): FP8 in
    ``model.eval()`` too; off by default as for TE (Accelerate's AO path had no switch, bug 15).
    """

    config: Optional[Any] = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None
    recipe: Optional[str] = None
    use_autocast_during_eval: Optional[bool] = None

    backend = "torchao"

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        s("pad_inner_dim", _resolve(self.pad_inner_dim, "PAD_INNER_DIM", True, _bool("pad_inner_dim")))
        s("enable_fsdp_float8_all_gather", _resolve(
            self.enable_fsdp_float8_all_gather, "ENABLE_FSDP_FLOAT8_ALL_GATHER", True,
            _bool("enable_fsdp_float8_all_gather")))
        s("use_autocast_during_eval", _resolve(
            self.use_autocast_during_eval, "USE_AUTOCAST_DURING_EVAL", False, _bool("use_autocast_during_eval")))
        if self.recipe is not None:
            s("recipe", _choice(self.recipe, "recipe", ("tensorwise", "rowwise", "rowwise_with_gw_hp"), upper=False))
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError("module_filter_func must be a callable (module, fqn) -> bool")


@dataclass(frozen=True)
class NativeRecipeKwargs(RecipeKwargs):
    """lowprec's own engine, by recipe name: ``delayed``, ``tensorwise``, ``rowwise``,
    ``rowwise_with_gw_hp``, ``blockwise`` (env ``LOWPREC_FP8_RECIPE``). ``overrides`` sets single
    :class:`lowprec.fp8.Recipe` fields; ``ACCELERATE_FP8_*`` variables that are *set* (as
    ``lowprec launch`` writes them) override the named preset too, explicit ``overrides`` win.
    ``module_filter_func(module, fqn) -> bool`` picks layers; ``skip_first_last`` /
    ``skip_patterns`` are the engine's conversion defaults."""

    recipe: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    module_filter_func: Optional[Callable] = None
    skip_first_last: bool = True
    skip_patterns: tuple = ("lm_head", "router", "gate")
    use_autocast_during_eval: Optional[bool] = None

    backend = "native"

    def __post_init__(self) -> None:
        name = self.recipe if self.recipe is not None else (env_get("LOWPREC_FP8_RECIPE") or "tensorwise")
        object.__setattr__(self, "recipe", str(name).lower().replace("-", "_"))
        object.__setattr__(self, "overrides", {**_env_recipe_overrides(), **dict(self.overrides)})
        object.__setattr__(self, "skip_patterns", tuple(self.skip_patterns))
        object.__setattr__(self, "use_autocast_during_eval", _resolve(
            self.use_autocast_during_eval, "USE_AUTOCAST_DURING_EVAL", False, _bool("use_autocast_during_eval")))
        self.to_recipe()  # validate name and overrides now, with the engine's own messages

    def to_recipe(self):
        from lowprec.fp8.recipes import Recipe

        overrides = dict(self.overrides)
        overrides.setdefault("use_during_eval", self.use_autocast_during_eval)
        return Recipe.from_name(self.recipe, **overrides)


def _env_recipe_overrides() -> dict[str, Any]:
    """Recipe fields from the ``ACCELERATE_FP8_*`` variables that are set (unset ones leave the
    named preset's own values, e.g. rowwise's E4M3)."""
    table = {"FORMAT": ("fp8_format", str), "AMAX_HISTORY_LEN": ("amax_history_len", _int("amax_history_len")),
             "AMAX_COMPUTE_ALGO": ("amax_compute_algo", str), "MARGIN": ("margin", _int("margin")),
             "INTERVAL": ("interval", _int("interval"))}
    out: dict[str, Any] = {}
    for suffix, (name, convert) in table.items():
        if env_get(FP8_PREFIX + suffix) is not None:
            out[name] = _resolve(None, suffix, None, convert)
    flags = [env_get(FP8_PREFIX + f"OVERRIDE_{g}") for g in ("FPROP", "DGRAD", "WGRAD")]
    if any(f is not None for f in flags):
        out["override_linear_precision"] = tuple(
            env_flag(FP8_PREFIX + f"OVERRIDE_{g}") for g in ("FPROP", "DGRAD", "WGRAD"))
    return out


_FP8_WARNED = [False]


@dataclass(frozen=True)
class FP8RecipeKwargs(TERecipeKwargs):
    """Deprecated (as in Accelerate): ``backend="te"`` or ``"msamp"`` plus that backend's fields.

    Unlike Accelerate it validates ``opt_level``, does not need TE for MS-AMP, and never leaks
    ``backend`` into the TE recipe (reference bug 9). :meth:`to_handler` gives the modern class.
    """

    backend: Optional[str] = None  # type: ignore[assignment]
    opt_level: Optional[str] = None
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
        raw = self.backend if self.backend is not None else env_get(FP8_PREFIX + "BACKEND")
        if raw is None:
            from lowprec.backends.availability import is_available

            raw = "msamp" if is_available("msamp") else "te"
        backend = normalize_backend(raw, "backend")
        if backend not in ("te", "msamp"):
            raise ValueError(f"FP8RecipeKwargs backend={raw!r}; use 'te' or 'msamp' (or AORecipeKwargs for torchao)")
        object.__setattr__(self, "backend", backend)
        self._resolve_te_fields()
        MSAMPRecipeKwargs._resolve_opt_level(self)  # type: ignore[arg-type]

    def to_handler(self) -> RecipeKwargs:
        if self.backend == "msamp":
            return MSAMPRecipeKwargs(opt_level=self.opt_level)
        te = {f.name: getattr(self, f.name) for f in dataclasses.fields(TERecipeKwargs)}
        return TERecipeKwargs(**te)


# --------------------------------------------------------------------------- YAML fp8_config
_CONFIG_CLASSES = {"te": TERecipeKwargs, "msamp": MSAMPRecipeKwargs, "torchao": AORecipeKwargs, "native": NativeRecipeKwargs}
_CONFIG_ALIASES = {
    "amax_history_length": "amax_history_len",
    "amax_compute_algorithm": "amax_compute_algo",
    "optimization_level": "opt_level",
    "format": "fp8_format",
}


def recipe_kwargs_from_config(config: Mapping[str, Any]) -> RecipeKwargs:
    """Build the handler for a YAML ``fp8_config:`` block; unknown keys are errors with a hint."""
    cfg = {str(k): v for k, v in dict(config).items()}
    backend = normalize_backend(cfg.pop("backend", None), "fp8_config.backend") or "native"
    cls = _CONFIG_CLASSES[backend]
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in cfg.items():
        name = _CONFIG_ALIASES.get(key, key)
        name = name[len("fp8_"):] if name.startswith("fp8_") and name != "fp8_format" else name
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"fp8_config key {key!r} is not a {cls.__name__} field{hint}; known: {', '.join(sorted(known))}"
            )
        if isinstance(value, str) and name != "override_linear_precision" and value.strip().startswith(("(", "[")):
            try:
                value = ast.literal_eval(value)
            except (SyntaxError, ValueError):
                raise ValueError(
                    f"fp8_config key {key!r}={value!r} is not a valid Python literal list/tuple; "
                    "write e.g. [\"lm_head\", \"router\"] or a YAML list"
                ) from None
        kwargs[name] = value
    return cls(**kwargs)
