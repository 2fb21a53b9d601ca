"""The launch contract: resolved settings and the environment variables that carry them.

``lowprec launch`` resolves flags > YAML > defaults into one :class:`LaunchSettings`, exports
it with :meth:`LaunchSettings.to_env` and runs the script; inside the script the Accelerator
reads it back with :meth:`LaunchSettings.from_env`. Names are Hugging Face Accelerate's where
Accelerate has one, so a script launched by ``accelerate launch`` configures lowprec too.

Environment variables (only the ones in this table are written; ``launch`` removes stale
copies inherited from the parent shell so the child sees exactly the resolved settings)

============================================== ====================== =====================================
variable                                       when written           meaning / values
============================================== ====================== =====================================
ACCELERATE_MIXED_PRECISION                     always                 no | fp16 | bf16 | fp8
ACCELERATE_USE_CPU                             always                 true | false: run on CPU even with GPUs
ACCELERATE_USE_FSDP                            always                 true | false: FSDP2 (fully_shard)
FSDP_VERSION                                   FSDP                   2 (FSDP1 is rejected at launch)
FSDP_RESHARD_AFTER_FORWARD                     FSDP, if set           true | false
FSDP_AUTO_WRAP_POLICY                          FSDP, if set           TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP
FSDP_TRANSFORMER_CLS_TO_WRAP                   FSDP, if set           comma-separated class names
FSDP_MIN_NUM_PARAMS                            FSDP, if set           int (SIZE_BASED_WRAP)
FSDP_ACTIVATION_CHECKPOINTING                  FSDP, if set           true | false
FSDP_CPU_RAM_EFFICIENT_LOADING                 FSDP, if set           true | false
FSDP_OFFLOAD_PARAMS                            FSDP, if set           true | false
FSDP_STATE_DICT_TYPE                           FSDP, if set           FULL_STATE_DICT | SHARDED_STATE_DICT (DCP, reshardable)
ACCELERATE_USE_DEEPSPEED                       always                 true | false
ACCELERATE_DEEPSPEED_ZERO_STAGE                DeepSpeed, if set      0 | 1 | 2 | 3
ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE  DeepSpeed, if set      none | cpu | nvme
ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE      DeepSpeed, if set      none | cpu | nvme
ACCELERATE_DEEPSPEED_CONFIG_FILE               DeepSpeed, if set      path to a DeepSpeed JSON
PARALLELISM_CONFIG_TP_SIZE                     if set                 int >= 1: tensor-parallel processes per model
                                                                      replica (the model's _tp_plan)
PARALLELISM_CONFIG_DP_SHARD_SIZE               if set                 int >= 1: FSDP2 shards; x tp_size = processes
ACCELERATE_GRADIENT_ACCUMULATION_STEPS         if set                 int >= 1
ACCELERATE_GRADIENT_CLIPPING                   DeepSpeed, if set      float (max grad norm; DeepSpeed clips)
CUDA_VISIBLE_DEVICES                           if gpu_ids set         e.g. 0,1 (not written for "all")
ACCELERATE_DYNAMO_BACKEND                      if set                 NO | INDUCTOR | ... (TorchDynamoPlugin reads it)
ACCELERATE_FP8_BACKEND                         fp8, if set            NATIVE | TE | MSAMP | AO | AUTO (upper case,
                                                                      as Accelerate's FP8BackendType; read any case)
LOWPREC_FP8_RECIPE                             fp8, if set            delayed | tensorwise | rowwise |
                                                                      rowwise_with_gw_hp | blockwise
LOWPREC_FP8_FALLBACK                           fp8, if set            bf16 | emulate: what to do where the device
                                                                      has no FP8 GEMMs (run bf16, or FP8 numerics
                                                                      through the emulated GEMM)
ACCELERATE_FP8_FORMAT                          fp8, if set            HYBRID | E4M3 | E5M2 (E5M2: te only)
ACCELERATE_FP8_AMAX_HISTORY_LEN                fp8, if set            int >= 1 (delayed scaling)
ACCELERATE_FP8_AMAX_COMPUTE_ALGO               fp8, if set            max | most_recent
ACCELERATE_FP8_MARGIN                          fp8, if set            int >= 0
ACCELERATE_FP8_INTERVAL                        fp8, if set            int >= 1
LOWPREC_FP8_SCALE_ROUNDING                     fp8, if set            rceil | floor: MXFP8's E8M0 scale rule (native)
ACCELERATE_FP8_OVERRIDE_FPROP                  fp8, if set            true | false: forward GEMM in high precision
ACCELERATE_FP8_OVERRIDE_DGRAD                  fp8, if set            true | false: grad-input GEMM in high precision
ACCELERATE_FP8_OVERRIDE_WGRAD                  fp8, if set            true | false: grad-weight GEMM in high precision
ACCELERATE_FP8_OPT_LEVEL                       fp8, if set            O1 | O2 (low-precision optimizer state/comm)
ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL        fp8, if set            true | false: keep FP8 on in model.eval()
ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER   fp8, if set            true | false: FP8 all-gather under FSDP2
ACCELERATE_FP8_PAD_INNER_DIM                   fp8, if set            true | false: pad GEMM dims to 16 (torchao)
ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD fp8, if set          true | false (auto: unset): re-cast the weight
                                                                      in backward instead of keeping its FP8 copy
                                                                      (auto: where FSDP / ZeRO-3 shards it)
============================================== ====================== =====================================

Not written: ``zero3_init_flag`` (ACCELERATE_DEEPSPEED_ZERO3_INIT) is accepted in a config file
(Accelerate writes it) but nothing in lowprec reads it (``UNREAD_FIELDS``). ``dynamo_backend`` is
written when set (``TorchDynamoPlugin`` reads it, with ``--dynamo_mode`` / ``--dynamo_use_fullgraph``
/ ``--dynamo_use_dynamic``: ``cli/_launch_options.py``).

"If set" means the user gave the value (flag or YAML); an unset value is not written, so the
consumer's own default applies (for ``fp8_recipe: rowwise`` that is the recipe's E4M3 format,
not a launcher default of HYBRID). Accelerate instead exported every default (reference §3.1),
which made every value look user-chosen. Launch-only settings (``num_processes``,
``num_machines``, ``machine_rank``, ``main_process_ip``, ``main_process_port``) go to torchrun
as flags; torchrun then sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

from lowprec.config import values as V
from lowprec.catalog import check_tensor_parallel
from lowprec.errors import UsageError, did_you_mean
from lowprec.backends.spec import ENGINE_SETTINGS, RECIPE_SETTINGS, recipe_field, spec_or_native, specs
from lowprec.catalog import recipes_reading, unread_recipe_fields


__all__ = [
    "LaunchSettings",
    "ENV_VARS",
    "FP8_OVERRIDE_VARS",
    "FP8_FIELDS",
    "UNREAD_FIELDS",
    "fp8_fields_unread",
    "fp8_readers",
    "check_fp8_fields",
    "owned_env_var",
    "read_env",
    "clear_environment",
]


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the caller's environment comes back exactly
    afterwards (variables the block set are gone, removed ones return). Accelerate's
    ``accelerate.utils.clear_environment`` (``lowprec.utils`` re-exports it)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


FP8_OVERRIDE_VARS = (
    "ACCELERATE_FP8_OVERRIDE_FPROP",
    "ACCELERATE_FP8_OVERRIDE_DGRAD",
    "ACCELERATE_FP8_OVERRIDE_WGRAD",
)


@dataclass(frozen=True)
class _Var:
    field: str
    name: str
    parse: Callable[[Any], Any]
    when: str  # "always" | "set" | "fp8" | "fsdp" | "deepspeed"
    render: Optional[Callable[[Any], str]] = None  # None: true/false for a boolean, else str

    def __post_init__(self) -> None:
        if self.render is None:
            object.__setattr__(self, "render", V.format_bool if self.parse is V.parse_bool else str)

    def render_value(self, value: Any) -> str:
        # __post_init__ replaced a None render with the default, so it is always a callable here
        return cast(Callable[[Any], str], self.render)(value)


def _upper(value: Any) -> str:
    return str(value).upper()


_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _parse_zero_stage(value: Any) -> int:
    stage = V.parse_int(value)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{stage} is not a ZeRO stage; choose 0, 1, 2 or 3")
    return stage


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    return lambda value: V.choice(value, choices)


_B, _I = V.parse_bool, V.parse_int
# (field, variable, parser, when written). One row per variable; fp8_override_linear_precision
# fans out to FP8_OVERRIDE_VARS and is handled apart.
ENV_VARS: tuple[_Var, ...] = (
    _Var("mixed_precision", "ACCELERATE_MIXED_PRECISION", V.parse_mixed_precision, "always"),
    _Var("use_cpu", "ACCELERATE_USE_CPU", _B, "always"),
    _Var("use_fsdp", "ACCELERATE_USE_FSDP", _B, "always"),
    _Var("fsdp_version", "FSDP_VERSION", _I, "fsdp"),
    _Var("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", _B, "fsdp"),
    _Var("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", _one_of(_WRAP_POLICIES), "fsdp"),
    _Var("fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", str, "fsdp"),
    _Var("fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", lambda x: _I(x, minimum=0), "fsdp"),
    _Var("fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", _B, "fsdp"),
    _Var("fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", _B, "fsdp"),
    _Var("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", _B, "fsdp"),
    _Var("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", _one_of(_STATE_DICT_TYPES), "fsdp"),
    _Var("use_deepspeed", "ACCELERATE_USE_DEEPSPEED", _B, "always"),
    _Var("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", _parse_zero_stage, "deepspeed"),
    _Var(
        "offload_optimizer_device",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        _one_of(_OFFLOAD_DEVICES),
        "deepspeed",
    ),
    _Var("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", _one_of(_OFFLOAD_DEVICES), "deepspeed"),
    _Var("zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT", _B, "deepspeed"),
    _Var("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE", str, "deepspeed"),
    _Var("tp_size", "PARALLELISM_CONFIG_TP_SIZE", lambda x: _I(x, minimum=1), "set"),
    _Var("dp_shard_size", "PARALLELISM_CONFIG_DP_SHARD_SIZE", lambda x: _I(x, minimum=1), "set"),
    _Var("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", lambda x: _I(x, minimum=1), "set"),
    _Var("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", V.parse_float, "deepspeed"),
    _Var("dynamo_backend", "ACCELERATE_DYNAMO_BACKEND", V.parse_dynamo_backend, "set", _upper),
    _Var("gpu_ids", "CUDA_VISIBLE_DEVICES", str, "set"),
    _Var("fp8_backend", "ACCELERATE_FP8_BACKEND", V.parse_fp8_backend, "fp8", _upper),
    _Var("fp8_recipe", "LOWPREC_FP8_RECIPE", V.parse_fp8_recipe, "fp8"),
    _Var("fp8_fallback", "LOWPREC_FP8_FALLBACK", V.parse_fp8_fallback, "fp8"),
    _Var("fp8_format", "ACCELERATE_FP8_FORMAT", V.parse_fp8_format, "fp8"),
    _Var("fp8_amax_history_len", "ACCELERATE_FP8_AMAX_HISTORY_LEN", V.parse_recipe_int("amax_history_len"), "fp8"),
    _Var("fp8_amax_compute_algo", "ACCELERATE_FP8_AMAX_COMPUTE_ALGO", V.parse_amax_compute_algo, "fp8"),
    _Var("fp8_margin", "ACCELERATE_FP8_MARGIN", V.parse_recipe_int("margin"), "fp8"),
    _Var("fp8_interval", "ACCELERATE_FP8_INTERVAL", V.parse_recipe_int("interval"), "fp8"),
    _Var("fp8_scale_rounding", "LOWPREC_FP8_SCALE_ROUNDING", V.parse_recipe_option("scale_rounding"), "fp8"),
    _Var("fp8_opt_level", "ACCELERATE_FP8_OPT_LEVEL", V.parse_opt_level, "fp8"),
    _Var("fp8_use_autocast_during_eval", "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", _B, "fp8"),
    _Var("fp8_enable_fsdp_float8_all_gather", "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", _B, "fp8"),
    _Var("fp8_pad_inner_dim", "ACCELERATE_FP8_PAD_INNER_DIM", _B, "fp8"),
    _Var(
        "fp8_force_recompute_fp8_weight_in_bwd",
        "ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD",
        V.parse_bool_or_auto,
        "fp8",
        V.format_bool,
    ),
)

_OWNED = frozenset(v.name for v in ENV_VARS) | frozenset(FP8_OVERRIDE_VARS)


def owned_env_var(name: str) -> bool:
    """True for variables this contract writes (and ``launch`` scrubs from the parent env),
    including Accelerate's FP8/FSDP/DeepSpeed families we do not write, so that a stale
    ``ACCELERATE_FP8_*`` from the user's shell cannot reach the child unseen."""
    if name == "CUDA_VISIBLE_DEVICES":  # the user's own device mask stays unless gpu_ids is set
        return False
    return name in _OWNED or name.startswith(("ACCELERATE_FP8_", "LOWPREC_FP8_", "FSDP_", "PARALLELISM_CONFIG_"))


_FSDP_FIELDS = tuple(v.field for v in ENV_VARS if v.when == "fsdp" and v.field != "fsdp_version")
_DS_FIELDS = tuple(v.field for v in ENV_VARS if v.when == "deepspeed")
FP8_FIELDS = tuple(v.field for v in ENV_VARS if v.when == "fp8") + ("fp8_override_linear_precision",)

# Accepted for Accelerate compatibility (its config files carry them) but read by nothing in
# lowprec: never exported, and `launch` says so instead of pretending they act.
UNREAD_FIELDS = ("zero3_init_flag",)


def fp8_fields_unread(backend: str | None, fields: Any) -> list[str]:
    """Which of ``fields`` (FP8 setting names) the ``backend`` (None/auto: native) never reads
    (each backend declares what it reads: ``SPEC.reads`` in ``lowprec/backends/<name>.py``)."""

    read = set(spec_or_native(backend).reads) | {"fp8_backend", "fp8_fallback"}
    return sorted(f for f in fields if f in FP8_FIELDS and f not in read)


def fp8_readers(field_name: str) -> list[str]:
    return [s.env_value.lower() for s in specs() if field_name in s.reads]


def check_fp8_fields(
    backend: str | None,
    recipe: str | None,
    fields: Any,
    spell: Callable[[str], str] = str,
    backend_unread: bool = True,
    recipe_unread: bool = True,
) -> None:
    """FP8 settings the chosen backend refuses, or that it (``backend_unread``) or the chosen
    recipe (``recipe_unread``) would ignore, are errors naming the key and the fix (``spell``
    renders a setting name as the user wrote it: ``--fp8_margin``, ``fp8_config.margin``)."""

    spec = spec_or_native(backend)
    for name in sorted(fields):
        if name in spec.rejects and fields[name] not in (None, False):
            raise UsageError(f"{spell(name)}: {spec.rejects[name]}")
    for name in fp8_fields_unread(backend, fields) if backend_unread else ():
        if name in spec.rejects:
            continue
        readers = fp8_readers(name)
        fix = f"drop it, or set fp8_backend {' or '.join(readers)}" if readers else "drop it"
        raise UsageError(
            f"{spell(name)}: the {spec.env_value.lower()} FP8 backend does not read it "
            f"(read by: {', '.join(readers) or 'none'}); {fix}"
        )
    refusal = spec.check_fields(recipe, fields) if spec.check_fields is not None else None
    if refusal is not None:  # a combination the backend cannot run, e.g. native FP8 all-gather + delayed
        name, why = refusal
        raise UsageError(f"{spell(name)}: {why}")
    if "fp8_recipe" in spec.reads and recipe_unread:
        by_engine = {recipe_field(f): f for f in fields}
        for name in unread_recipe_fields(recipe or "tensorwise", by_engine):
            raise UsageError(
                f"{spell(by_engine[name])}: the {recipe or 'tensorwise'} recipe does not read it "
                f"(read by: {', '.join(recipes_reading(name)) or 'none'}); {_recipe_fix(name, by_engine[name])}"
            )


def _recipe_fix(engine_field: str, setting: str) -> str:
    """How to make a recipe field count: the native recipes that read it, and the backends with
    their own recipe that read it (TE's delayed scaling reads amax_history_len)."""
    recipes = [r for r in V.FP8_RECIPES if not unread_recipe_fields(r, [engine_field])]
    backends = [s.env_value.lower() for s in specs() if setting in s.reads and "fp8_recipe" not in s.reads]
    options = [f"fp8_recipe {' or '.join(recipes)}"] if recipes else []
    options += [f"fp8_backend {b}" for b in backends]
    return "drop it, or set " + ", or ".join(options) if options else "drop it"


def read_env(environ: Mapping[str, str] | None = None, fields: Any = None) -> dict[str, Any]:
    """The one reader of the launch variables: ``{setting: value}`` for each variable that is set
    (``fields`` limits which), each parsed by its one parser; a bad value is a ``UsageError``
    naming the variable. ``LaunchSettings.from_env`` and the kwargs handlers both read here."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var in ENV_VARS:
        raw = environ.get(var.name)
        if raw is None or raw == "" or var.field == "gpu_ids" or (fields is not None and var.field not in fields):
            continue
        try:
            out[var.field] = var.parse(raw)
        except ValueError as exc:
            raise UsageError(f"environment variable {var.name}={raw!r}: {exc}") from None
    raw_overrides = [environ.get(name) for name in FP8_OVERRIDE_VARS]
    wanted = fields is None or "fp8_override_linear_precision" in fields
    if wanted and any(r not in (None, "") for r in raw_overrides):
        flags = []
        for name, raw in zip(FP8_OVERRIDE_VARS, raw_overrides):
            try:
                flags.append(False if raw in (None, "") else V.parse_bool(raw))
            except ValueError as exc:
                raise UsageError(f"environment variable {name}={raw!r}: {exc}") from None
        out["fp8_override_linear_precision"] = tuple(flags)
    return out


@dataclass(frozen=True)
class LaunchSettings:
    """Everything ``lowprec launch`` resolved. ``None`` means "not set by the user": it is not
    exported and the consumer (Accelerator, backend, recipe) keeps its own default.

    Values are normalised in ``__post_init__`` (any case in, canonical case out), so a
    settings object built from flags, from YAML or from the environment compares equal when
    it means the same thing.
    """

    mixed_precision: str = "no"
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    use_cpu: bool = False
    gpu_ids: str | None = None
    dynamo_backend: str | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    # tensor parallelism (Accelerate's ParallelismConfig sizes); dp_shard_size: num_processes / tp_size
    tp_size: int | None = None
    dp_shard_size: int | None = None
    # FSDP (always FSDP2: torch.distributed.fsdp.fully_shard)
    use_fsdp: bool = False
    fsdp_version: int = 2
    fsdp_reshard_after_forward: bool | None = None
    fsdp_auto_wrap_policy: str | None = None
    fsdp_transformer_layer_cls_to_wrap: str | None = None
    fsdp_min_num_params: int | None = None
    fsdp_activation_checkpointing: bool | None = None
    fsdp_cpu_ram_efficient_loading: bool | None = None
    fsdp_offload_params: bool | None = None
    fsdp_state_dict_type: str | None = None
    # DeepSpeed
    use_deepspeed: bool = False
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    zero3_init_flag: bool | None = None
    deepspeed_config_file: str | None = None
    # FP8 (exported only when mixed_precision == "fp8")
    fp8_backend: str | None = None
    fp8_recipe: str | None = None
    fp8_fallback: str | None = None
    fp8_format: str | None = None
    fp8_amax_history_len: int | None = None
    fp8_amax_compute_algo: str | None = None
    fp8_margin: int | None = None
    fp8_interval: int | None = None
    fp8_scale_rounding: str | None = None
    fp8_override_linear_precision: tuple[bool, bool, bool] | None = None
    fp8_opt_level: str | None = None
    fp8_use_autocast_during_eval: bool | None = None
    fp8_enable_fsdp_float8_all_gather: bool | None = None
    fp8_pad_inner_dim: bool | None = None
    fp8_force_recompute_fp8_weight_in_bwd: bool | None = None  # None: auto

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        parsers: dict[str, Callable[[Any], Any]] = {v.field: v.parse for v in ENV_VARS}
        parsers.update(
            num_processes=lambda x: V.parse_int(x, minimum=1),
            num_machines=lambda x: V.parse_int(x, minimum=1),
            machine_rank=lambda x: V.parse_int(x, minimum=0),
            main_process_port=lambda x: V.parse_int(x, minimum=0),
            main_process_ip=str,
            fp8_override_linear_precision=V.parse_override_linear_precision,
        )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name not in parsers:
                continue
            try:
                set_(f.name, parsers[f.name](value))
            except ValueError as exc:
                raise UsageError(f"{f.name}: {exc}") from None
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.use_fsdp and self.use_deepspeed:
            raise UsageError("use_fsdp and use_deepspeed are both set; pick one (FSDP2 or DeepSpeed ZeRO)")
        if self.fsdp_version != 2:
            raise UsageError(
                f"fsdp_version={self.fsdp_version}: FSDP1 is not supported; lowprec shards with "
                "FSDP2 (torch fully_shard): set fsdp_version to 2"
            )
        if self.num_processes % self.num_machines:
            raise UsageError(
                f"num_processes={self.num_processes} is not a multiple of num_machines="
                f"{self.num_machines}; num_processes counts all processes on all machines"
            )
        if self.machine_rank >= self.num_machines:
            raise UsageError(f"machine_rank={self.machine_rank} must be below num_machines={self.num_machines}")
        if self.num_machines > 1 and not self.main_process_ip:
            raise UsageError(
                f"num_machines={self.num_machines} needs main_process_ip (the address of the "
                "machine with machine_rank 0)"
            )
        if self.num_machines > 1 and self.main_process_port == 0:
            raise UsageError(
                "main_process_port=0 (any free port) works on one machine only; with "
                f"num_machines={self.num_machines} every machine must know the port: set one, e.g. 29500"
            )
        self._check_tensor_parallel()

        if self.fp8_format is not None and self.fp8_format not in spec_or_native(self.fp8_backend).fp8_formats:
            raise UsageError(
                "fp8_format=E5M2 (E5M2 in the forward pass too) is a TransformerEngine option; "
                "with the native engine use HYBRID (E4M3 forward, E5M2 gradients) or E4M3"
            )
        if self.fp8_override_linear_precision == (True, True, True):
            raise UsageError(
                "fp8_override_linear_precision=(true, true, true) runs no GEMM in FP8; use mixed_precision bf16 instead"
            )
        # msamp + ZeRO-3 is not rejected here: lowprec's native O2 (FP8AdamW as DeepSpeed's
        # client optimizer) runs under ZeRO-3; the backend decides for the real MS-AMP library.

    def _check_tensor_parallel(self) -> None:
        tp = self.tp_size or 1
        if self.num_processes % tp:
            raise UsageError(
                f"tp_size={tp} does not divide num_processes={self.num_processes}; launch a multiple "
                f"of {tp} processes or pick a tp_size that divides {self.num_processes}"
            )
        dp = self.num_processes // tp
        if self.dp_shard_size is not None and self.dp_shard_size != dp:
            raise UsageError(
                f"dp_shard_size={self.dp_shard_size} x tp_size={tp} != num_processes={self.num_processes}; "
                f"set dp_shard_size to {dp} (or drop it: it is num_processes / tp_size)"
            )
        if tp == 1:
            return
        if self.use_deepspeed:
            raise UsageError(f"tp_size={tp} runs with FSDP2 (or alone), not DeepSpeed; drop use_deepspeed or tp_size")
        if dp > 1 and not self.use_fsdp:
            raise UsageError(
                f"tp_size={tp} with num_processes={self.num_processes} leaves {dp} data-parallel shards, "
                f"which FSDP2 holds: add --use_fsdp (distributed_type: FSDP), or launch {tp} processes"
            )

        if self.fp8 and spec_or_native(self.fp8_backend).library is not None:  # another library's FP8 layers
            raise UsageError(
                f"tp_size={tp} with fp8_backend={self.fp8_backend}: tensor parallel FP8 runs on lowprec's "
                "native engine; set fp8_backend: native"
            )
        if self.fp8 and self.fp8_recipe:
            try:
                check_tensor_parallel(self.fp8_recipe, what=f"tp_size={tp} (tensor parallel FP8)")
            except ValueError as exc:
                raise UsageError(str(exc)) from None

    # ------------------------------------------------------------------ properties
    @property
    def fp8(self) -> bool:
        return self.mixed_precision == "fp8"

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def distributed(self) -> bool:
        """True when launched through torchrun (several processes or machines)."""
        return self.num_processes > 1 or self.num_machines > 1

    def replace(self, **changes: Any) -> "LaunchSettings":
        return dataclasses.replace(self, **changes)

    def explicit(self) -> dict[str, Any]:
        """Fields that differ from the defaults (what a YAML needs to store)."""
        default = LaunchSettings()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def fp8_recipe_overrides(self) -> dict[str, Any]:
        """The user-set FP8 values under the field names of ``lowprec.fp8.Recipe``, for
        ``Recipe.from_name(settings.fp8_recipe or default, **overrides)``."""

        return {
            recipe_field(s): getattr(self, s)
            for s in (*RECIPE_SETTINGS, *ENGINE_SETTINGS)
            if getattr(self, s) is not None
        }

    # ------------------------------------------------------------------ environment
    def _written(self, var: _Var) -> bool:
        value = getattr(self, var.field)
        if var.field in UNREAD_FIELDS:
            return False
        if var.when == "always":
            return True
        if value is None:
            return False
        if var.when == "fp8":
            return self.fp8
        if var.when == "fsdp":
            return self.use_fsdp
        if var.when == "deepspeed":
            return self.use_deepspeed
        if var.field == "gpu_ids":
            return str(value).lower() != "all"
        return True

    def to_env(self) -> dict[str, str]:
        """The variables to export for the training processes (see the module table)."""
        env = {v.name: v.render_value(getattr(self, v.field)) for v in ENV_VARS if self._written(v)}
        if self.fp8 and self.fp8_override_linear_precision is not None:
            for name, flag in zip(FP8_OVERRIDE_VARS, self.fp8_override_linear_precision):
                env[name] = V.format_bool(flag)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "LaunchSettings":
        """Read the settings a launcher exported (``os.environ`` by default). Values in any
        case are accepted; a bad value raises ``UsageError`` naming the variable."""
        kwargs = read_env(environ)
        return cls(**kwargs)

    @classmethod
    def from_layers(cls, *layers: Mapping[str, Any]) -> "LaunchSettings":
        """Merge partial settings, later layers winning (defaults < YAML < CLI)."""
        known = {f.name for f in dataclasses.fields(cls)}
        merged: dict[str, Any] = {}
        for layer in layers:
            for key, value in layer.items():
                if key not in known:
                    raise UsageError(f"unknown launch setting {key!r}{did_you_mean(key, known)}")
                merged[key] = value
        return cls(**merged)
