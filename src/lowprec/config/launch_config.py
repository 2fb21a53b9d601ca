"""The launch YAML: a strict pydantic schema in Accelerate's spelling.

A config written by ``accelerate config`` loads unchanged (its keys, its upper-case enum
values, its wizard spellings ``amax_history_length`` / ``amax_compute_algorithm`` /
``optimization_level``, which Accelerate itself then ignored, reference §3.4 bug 2). Unknown
keys are errors with a "did you mean", inside ``fp8_config`` as well (Accelerate forwarded
any ``fp8_config`` key as an env var nobody reads). Example::

    compute_environment: LOCAL_MACHINE
    distributed_type: MULTI_GPU        # NO | MULTI_GPU | MULTI_CPU | FSDP | DEEPSPEED
    mixed_precision: fp8
    num_processes: 8
    fp8_config:
      backend: NATIVE                  # NATIVE | TE | AO | MSAMP | AUTO, any case
      recipe: rowwise                  # native: delayed|tensorwise|rowwise|rowwise_with_gw_hp|blockwise
      fallback: emulate                # where FP8 GEMMs are missing: bf16 | emulate
      amax_history_len: 1024
      override_linear_precision: [false, false, true]   # or "(false, false, true)"
    parallelism_config:                # Accelerate's keys: tensor parallelism x FSDP2 shards
      parallelism_config_tp_size: 2

Keys Accelerate writes that mean nothing here (``main_training_function``, ``tpu_*``, FSDP1-only
``fsdp_*`` keys, ``mpirun_config``, ``megatron_lm_config`` ...) are accepted and ignored (noted where they differ from Accelerate's default), so
an existing Accelerate config keeps working; ``debug`` and ``rdzv_backend`` act as the launch flags
of the same name (``config/accelerate_flags.py``). Settings a config cannot express (TPU, Megatron,
FSDP1) are rejected with the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Mapping, Optional

import yaml
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from lowprec.backends.spec import get_spec
from lowprec.catalog import TE_SWITCHES, te_switch_recipe
from lowprec.config import values as V
from lowprec.config.accelerate_flags import IGNORED
from lowprec.config.env import LaunchSettings
from lowprec.config.paths import default_config_path
from lowprec.errors import UsageError, did_you_mean
from lowprec.config.yaml_file import read_yaml_mapping

__all__ = [
    "LaunchConfig",
    "FP8Config",
    "FSDPConfig",
    "DeepSpeedConfig",
    "DynamoConfig",
    "ParallelismSection",
    "default_config_path",
    "load_launch_config",
    "parse_launch_config",
    "parse_fp8_config",
    "settings_to_yaml_dict",
    "write_launch_config",
]

DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED")


def _opt(parse: Callable[[Any], Any]) -> BeforeValidator:
    return BeforeValidator(lambda v: v if v is None else parse(v))


def _int_min(minimum: int) -> BeforeValidator:
    return _opt(lambda v: V.parse_int(v, minimum=minimum))


def _alias(*names: str) -> Any:
    return Field(default=None, validation_alias=AliasChoices(*names))


OptBool = Annotated[Optional[bool], _opt(V.parse_bool)]
Ignored = Optional[Any]  # accepted for Accelerate compatibility, not used


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _ignored_fields(model: BaseModel) -> set[str]:
    """The keys accepted for Accelerate and not used (``config/accelerate_flags.py`` says why)."""
    return {k for k, info in type(model).model_fields.items() if info.annotation == Ignored}


class FP8Config(_Strict):
    """``fp8_config:``. Aliases: the names ``accelerate config`` writes."""

    backend: Annotated[Optional[str], _opt(V.parse_fp8_backend)] = None
    recipe: Annotated[Optional[str], _opt(V.parse_fp8_recipe)] = None
    fallback: Annotated[Optional[str], _opt(V.parse_fp8_fallback)] = None
    fp8_format: Annotated[Optional[str], _opt(V.parse_fp8_format)] = None
    margin: Annotated[Optional[int], _opt(V.parse_recipe_int("margin"))] = None
    interval: Annotated[Optional[int], _opt(V.parse_recipe_int("interval"))] = None
    amax_history_len: Annotated[Optional[int], _opt(V.parse_recipe_int("amax_history_len"))] = _alias(
        "amax_history_len", "amax_history_length"
    )
    amax_compute_algo: Annotated[Optional[str], _opt(V.parse_amax_compute_algo)] = _alias(
        "amax_compute_algo", "amax_compute_algorithm"
    )
    scale_rounding: Annotated[Optional[str], _opt(V.parse_recipe_option("scale_rounding"))] = None
    override_linear_precision: Annotated[Optional[tuple[bool, bool, bool]], _opt(V.parse_override_linear_precision)] = (
        None
    )
    opt_level: Annotated[Optional[str], _opt(V.parse_opt_level)] = _alias("opt_level", "optimization_level")
    use_autocast_during_eval: OptBool = _alias("use_autocast_during_eval", "use_during_eval")
    enable_fsdp_float8_all_gather: OptBool = None
    pad_inner_dim: OptBool = None
    force_recompute_fp8_weight_in_bwd: Annotated[Optional[bool], _opt(V.parse_bool_or_auto)] = None
    use_mxfp8_block_scaling: OptBool = None
    use_nvfp4_block_scaling: OptBool = None

    def to_settings(self) -> dict[str, Any]:
        names = {"backend": "fp8_backend", "recipe": "fp8_recipe", "fallback": "fp8_fallback"}
        out = {}
        try:
            switched = te_switch_recipe({k: getattr(self, k) for k in TE_SWITCHES})
        except ValueError as err:
            raise UsageError(f"fp8_config: {err}") from None
        if switched is not None:  # TE's switch names the native recipe of the same meaning
            key = next(k for k in TE_SWITCHES if getattr(self, k))
            if self.recipe not in (None, switched):
                raise UsageError(f"fp8_config.{key} asks for the {switched} recipe but recipe: {self.recipe}; keep one")
            if self.backend is not None and get_spec(self.backend).library is not None:  # a library's backend
                raise UsageError(
                    f"fp8_config.{key}: launch runs it on the native engine (recipe {switched}); for "
                    f"TransformerEngine's own, pass TERecipeKwargs({key}=True) in the script; or set "
                    f"backend: native, recipe: {switched}"
                )
            out["fp8_recipe"] = switched
        for key in self.model_fields_set - set(TE_SWITCHES):
            value = getattr(self, key)
            if value is not None:
                out[names.get(key, key if key.startswith("fp8_") else f"fp8_{key}")] = value
        return out


class FSDPConfig(_Strict):
    """``fsdp_config:``; keys with Accelerate's ``fsdp_`` prefix or without it."""

    fsdp_version: Annotated[Optional[int], _int_min(1)] = _alias("fsdp_version", "version")
    fsdp_reshard_after_forward: OptBool = _alias("fsdp_reshard_after_forward", "reshard_after_forward")
    fsdp_auto_wrap_policy: Optional[str] = _alias("fsdp_auto_wrap_policy", "auto_wrap_policy")
    fsdp_transformer_layer_cls_to_wrap: Optional[str] = _alias(
        "fsdp_transformer_layer_cls_to_wrap", "transformer_layer_cls_to_wrap"
    )
    fsdp_min_num_params: Annotated[Optional[int], _int_min(0)] = _alias("fsdp_min_num_params", "min_num_params")
    fsdp_activation_checkpointing: OptBool = _alias("fsdp_activation_checkpointing", "activation_checkpointing")
    fsdp_cpu_ram_efficient_loading: OptBool = _alias("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading")
    fsdp_offload_params: OptBool = _alias("fsdp_offload_params", "offload_params")
    fsdp_state_dict_type: Optional[str] = _alias("fsdp_state_dict_type", "state_dict_type")
    # FSDP1 spellings Accelerate's wizard writes; FSDP2 maps sharding_strategy to resharding.
    fsdp_sharding_strategy: Optional[str] = _alias("fsdp_sharding_strategy", "sharding_strategy")
    fsdp_sync_module_states: Ignored = _alias("fsdp_sync_module_states", "sync_module_states")
    fsdp_use_orig_params: Ignored = _alias("fsdp_use_orig_params", "use_orig_params")
    fsdp_forward_prefetch: Ignored = _alias("fsdp_forward_prefetch", "forward_prefetch")
    fsdp_backward_prefetch: Ignored = _alias("fsdp_backward_prefetch", "backward_prefetch")
    fsdp_activation_checkpointing_offload: Ignored = _alias(
        "fsdp_activation_checkpointing_offload", "activation_checkpointing_offload"
    )

    def to_settings(self) -> dict[str, Any]:
        skip = {"fsdp_sharding_strategy", *_ignored_fields(self)}
        out = {k: getattr(self, k) for k in self.model_fields_set - skip if getattr(self, k) is not None}
        if self.fsdp_sharding_strategy is not None and "fsdp_reshard_after_forward" not in out:
            try:
                out["fsdp_reshard_after_forward"] = V.reshard_after_forward(self.fsdp_sharding_strategy)
            except ValueError as err:
                raise UsageError(f"fsdp_config.fsdp_sharding_strategy={err}") from None
        return out


class DeepSpeedConfig(_Strict):
    """``deepspeed_config:`` as Accelerate writes it."""

    zero_stage: Optional[int] = None
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    zero3_init_flag: OptBool = None
    deepspeed_config_file: Optional[str] = None
    gradient_accumulation_steps: Annotated[Optional[int], _int_min(1)] = None
    gradient_clipping: Annotated[Optional[float], _opt(V.parse_float)] = None
    zero3_save_16bit_model: Ignored = None
    deepspeed_multinode_launcher: Ignored = None
    deepspeed_hostfile: Ignored = None
    deepspeed_exclusion_filter: Ignored = None
    deepspeed_inclusion_filter: Ignored = None
    deepspeed_moe_layer_cls_names: Ignored = None
    offload_optimizer_nvme_path: Ignored = None
    offload_param_nvme_path: Ignored = None

    def to_settings(self) -> dict[str, Any]:
        skip = _ignored_fields(self)
        return {k: getattr(self, k) for k in self.model_fields_set - skip if getattr(self, k) is not None}


class ParallelismSection(_Strict):
    """``parallelism_config:`` as ``accelerate config`` writes it (``parallelism_config_`` prefix
    or without it). lowprec runs FSDP2 shards x tensor parallelism; the other sizes must be 1."""

    tp_size: Annotated[Optional[int], _int_min(1)] = _alias("parallelism_config_tp_size", "tp_size")
    dp_shard_size: Annotated[Optional[int], _int_min(1)] = _alias("parallelism_config_dp_shard_size", "dp_shard_size")
    dp_replicate_size: Annotated[Optional[int], _int_min(1)] = _alias(
        "parallelism_config_dp_replicate_size", "dp_replicate_size"
    )
    cp_size: Annotated[Optional[int], _int_min(1)] = _alias("parallelism_config_cp_size", "cp_size")
    sp_size: Annotated[Optional[int], _int_min(1)] = _alias("parallelism_config_sp_size", "sp_size")
    cp_comm_strategy: Ignored = _alias("parallelism_config_cp_comm_strategy", "cp_comm_strategy")
    cp_backend: Ignored = _alias("parallelism_config_cp_backend", "cp_backend")
    sp_backend: Ignored = _alias("parallelism_config_sp_backend", "sp_backend")
    sp_seq_length: Ignored = _alias("parallelism_config_sp_seq_length", "sp_seq_length")
    sp_seq_length_is_variable: Ignored = _alias(
        "parallelism_config_sp_seq_length_is_variable", "sp_seq_length_is_variable"
    )
    sp_attn_implementation: Ignored = _alias("parallelism_config_sp_attn_implementation", "sp_attn_implementation")

    def to_settings(self) -> dict[str, Any]:
        for key in V.UNSUPPORTED_PARALLEL_SIZES:
            try:
                V.check_parallel_size(key, getattr(self, key))
            except ValueError as err:
                raise UsageError(f"parallelism_config.parallelism_config_{key}={err}") from None
        return {k: getattr(self, k) for k in ("tp_size", "dp_shard_size") if getattr(self, k) is not None}


class DynamoConfig(_Strict):
    # dynamo_backend is a launch setting; mode / fullgraph / dynamic are no setting but reach launch
    # through accelerate_options(), which exports them as the flags of the same name (ACCELERATE_DYNAMO_*)
    dynamo_backend: Annotated[Optional[str], _opt(V.parse_dynamo_backend)] = None
    dynamo_mode: Ignored = None
    dynamo_use_fullgraph: Ignored = None
    dynamo_use_dynamic: Ignored = None
    dynamo_use_regional_compilation: Ignored = None


class MpirunSection(_Strict):
    """``mpirun_config:`` as ``accelerate config`` writes it for MULTI_CPU with mpirun: noted as ignored
    (several CPU processes start under torchrun here)."""

    mpirun_hostfile: Ignored = None


_MEGATRON_DOC = """``megatron_lm_config:`` (Accelerate's Megatron-LM settings: its ``megatron_lm_*`` keys, which
``accelerate launch`` reads as the flags of the same names): noted as ignored, as those flags are
(``config/accelerate_flags.py``)."""

if TYPE_CHECKING:

    class MegatronSection(_Strict):
        pass

else:  # one Ignored field per megatron_lm_* option of the table
    MegatronSection = create_model(
        "MegatronSection",
        __base__=_Strict,
        __doc__=_MEGATRON_DOC,
        **{name: (Ignored, None) for name in IGNORED if name.startswith("megatron_lm_")},
    )


class LaunchConfig(_Strict):
    """The whole launch YAML. :meth:`to_settings` gives the keys the user wrote, as
    ``LaunchSettings`` fields (one layer of ``LaunchSettings.from_layers``)."""

    compute_environment: Optional[str] = None
    distributed_type: Annotated[
        Optional[str], _opt(lambda v: V.choice("NO" if v is False else v, DISTRIBUTED_TYPES))
    ] = None
    mixed_precision: Annotated[Optional[str], _opt(V.parse_mixed_precision)] = None
    num_processes: Annotated[Optional[int], _int_min(1)] = None
    num_machines: Annotated[Optional[int], _int_min(1)] = None
    machine_rank: Annotated[Optional[int], _int_min(0)] = None
    main_process_ip: Annotated[Optional[str], _opt(str)] = None
    main_process_port: Annotated[Optional[int], _int_min(0)] = None
    use_cpu: OptBool = None
    gpu_ids: Annotated[Optional[str], _opt(str)] = None
    fp8_config: Optional[FP8Config] = None
    fsdp_config: Optional[FSDPConfig] = None
    deepspeed_config: Optional[DeepSpeedConfig] = None
    dynamo_config: Optional[DynamoConfig] = None
    parallelism_config: Optional[ParallelismSection] = None
    mpirun_config: Optional[MpirunSection] = None
    megatron_lm_config: Optional[MegatronSection] = None
    # Accelerate keys that are no launch setting: debug and rdzv_backend act as the flags of the same
    # name, the rest are noted as ignored (config/accelerate_flags.py; accelerate_options())
    debug: Ignored = None
    downcast_bf16: Ignored = None
    enable_cpu_affinity: Ignored = None
    main_training_function: Ignored = None
    rdzv_backend: Ignored = None
    same_network: Ignored = None
    tpu_env: Ignored = None
    tpu_use_cluster: Ignored = None
    tpu_use_sudo: Ignored = None

    def accelerate_options(self) -> dict[str, Any]:
        """The keys that are no launch setting, under the names of ``accelerate launch``'s flags
        (``cli/_launch_options.py`` treats both alike): ``debug``, ``rdzv_backend`` and every
        key accepted and not used (``parallelism_config.cp_backend`` as ``parallelism_config_cp_backend``)."""
        out = {k: getattr(self, k) for k in ("debug", "rdzv_backend") if getattr(self, k) is not None}
        sections = (self.fsdp_config, self.deepspeed_config, self.dynamo_config, self.parallelism_config)
        for section in (self, *sections, self.mpirun_config, self.megatron_lm_config):
            prefix = "parallelism_config_" if isinstance(section, ParallelismSection) else ""
            for key in _ignored_fields(section) if section is not None else ():
                if getattr(section, key) is not None:
                    out[prefix + key] = getattr(section, key)
        return out

    def to_settings(self) -> dict[str, Any]:
        if self.compute_environment not in (None, "LOCAL_MACHINE"):
            raise UsageError(
                f"compute_environment={self.compute_environment!r}: only LOCAL_MACHINE is "
                "supported (launch on each machine with machine_rank set)"
            )
        if self.downcast_bf16 not in (None, False, "no", "false"):
            raise UsageError("downcast_bf16 is a TPU option; lowprec does not run on TPU: remove it")
        top = (
            "mixed_precision",
            "num_processes",
            "num_machines",
            "machine_rank",
            "main_process_ip",
            "main_process_port",
            "use_cpu",
            "gpu_ids",
        )
        out: dict[str, Any] = {k: getattr(self, k) for k in top if getattr(self, k) is not None}
        if self.gpu_ids is not None:
            out["gpu_ids"] = str(self.gpu_ids)
        kind = self.distributed_type
        if kind is not None:
            out["use_fsdp"] = kind == "FSDP"
            out["use_deepspeed"] = kind == "DEEPSPEED"
            if kind == "MULTI_CPU":
                if self.use_cpu is False:
                    raise UsageError("distributed_type MULTI_CPU contradicts use_cpu: false; drop one")
                out["use_cpu"] = True
        for section in (self.fp8_config, self.fsdp_config, self.deepspeed_config, self.parallelism_config):
            if section is not None:
                out.update(section.to_settings())
        if self.dynamo_config is not None and self.dynamo_config.dynamo_backend is not None:
            out["dynamo_backend"] = self.dynamo_config.dynamo_backend
        return out


# ---------------------------------------------------------------------- loading / errors
def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        keys.append(name)
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            keys.extend(str(c) for c in alias.choices)
    return keys


_SECTIONS: dict[str, type[BaseModel]] = {
    "fp8_config": FP8Config,
    "fsdp_config": FSDPConfig,
    "deepspeed_config": DeepSpeedConfig,
    "dynamo_config": DynamoConfig,
    "parallelism_config": ParallelismSection,
    "mpirun_config": MpirunSection,
    "megatron_lm_config": MegatronSection,
}


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        model = _SECTIONS.get(loc[0], LaunchConfig) if len(loc) > 1 else LaunchConfig
        hint = did_you_mean(loc[-1], _known_keys(model))
        return f"unknown key {key!r}{hint}"
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if err["type"] in ("model_type", "dict_type"):
        msg = "expected a mapping of keys (key: value lines under it)"
    if err["type"] == "value_error" or isinstance(err.get("input"), dict):
        return f"{key}: {msg}"
    return f"{key}: {msg} (got {err.get('input')!r})"


def parse_launch_config(data: Any, source: str = "launch config") -> LaunchConfig:
    """Validate a mapping (already parsed YAML); errors become one ``UsageError`` line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    data = {k: ({} if v is None and k in _SECTIONS else v) for k, v in data.items()}
    for section in _SECTIONS:  # reject "both spellings of one key" instead of silently picking one
        body = data.get(section)
        if isinstance(body, dict):
            _check_duplicate_aliases(_SECTIONS[section], body, f"{section}.")
    try:
        return LaunchConfig.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"{source}: " + "; ".join(_describe(e) for e in exc.errors())) from None


def parse_fp8_config(data: Any, source: str = "fp8_config") -> dict[str, Any]:
    """One ``fp8_config:`` block (a mapping) -> launch settings (``fp8_backend``, ``fp8_margin``...),
    validated by :class:`FP8Config` (the one parser of that block)."""
    config = parse_launch_config({"fp8_config": dict(data)}, source=source).fp8_config
    return {} if config is None else config.to_settings()


def _check_duplicate_aliases(model: type[BaseModel], body: dict[str, Any], prefix: str) -> None:
    for info in model.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            given = [str(c) for c in alias.choices if c in body]
            if len(given) > 1:
                raise UsageError(f"{prefix}{given[0]} and {prefix}{given[1]} mean the same; keep one")


def load_launch_config(path: str | os.PathLike[str]) -> LaunchConfig:
    path = Path(path).expanduser()
    if path.is_dir():
        raise UsageError(
            f"config file {str(path)!r} is a directory; give the YAML file (e.g. {str(path / 'default_config.yaml')!r})"
        )
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} does not exist; create it with `lowprec config`")

    data = read_yaml_mapping(path, example="distributed_type: MULTI_GPU")
    return parse_launch_config(data, source=str(path))


# ---------------------------------------------------------------------- writing
def settings_to_yaml_dict(settings: LaunchSettings) -> dict[str, Any]:
    """The YAML (Accelerate's layout) that loads back into ``settings``."""
    s = settings
    if s.use_fsdp:
        kind = "FSDP"
    elif s.use_deepspeed:
        kind = "DEEPSPEED"
    elif s.distributed:
        kind = "MULTI_CPU" if s.use_cpu else "MULTI_GPU"
    else:
        kind = "NO"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "mixed_precision": s.mixed_precision,
        "num_processes": s.num_processes,
        "num_machines": s.num_machines,
        "machine_rank": s.machine_rank,
        "use_cpu": s.use_cpu,
    }
    for key in ("main_process_ip", "main_process_port", "gpu_ids"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    fp8 = {
        "backend": s.fp8_backend.upper() if s.fp8_backend else None,
        "recipe": s.fp8_recipe,
        "fallback": s.fp8_fallback,
        "fp8_format": s.fp8_format,
        "amax_history_len": s.fp8_amax_history_len,
        "amax_compute_algo": s.fp8_amax_compute_algo,
        "margin": s.fp8_margin,
        "interval": s.fp8_interval,
        "scale_rounding": s.fp8_scale_rounding,
        "override_linear_precision": list(s.fp8_override_linear_precision)
        if s.fp8_override_linear_precision is not None
        else None,
        "opt_level": s.fp8_opt_level,
        "use_autocast_during_eval": s.fp8_use_autocast_during_eval,
        "enable_fsdp_float8_all_gather": s.fp8_enable_fsdp_float8_all_gather,
        "pad_inner_dim": s.fp8_pad_inner_dim,
        "force_recompute_fp8_weight_in_bwd": s.fp8_force_recompute_fp8_weight_in_bwd,
    }
    fp8 = {k: v for k, v in fp8.items() if v is not None}
    if fp8:
        out["fp8_config"] = fp8
    fsdp = {k: getattr(s, k) for k in FSDPConfig.model_fields if hasattr(s, k) and getattr(s, k) is not None}
    if s.use_fsdp:
        out["fsdp_config"] = fsdp
    ds = {k: getattr(s, k) for k in DeepSpeedConfig.model_fields if hasattr(s, k) and getattr(s, k) is not None}
    if ds:
        out["deepspeed_config"] = ds
    if s.tp_size is not None:  # Accelerate's spelling, so `accelerate launch` reads it too
        out["parallelism_config"] = {
            "parallelism_config_tp_size": s.tp_size,
            "parallelism_config_dp_shard_size": s.num_processes // s.tp_size,
        }
    if s.dynamo_backend is not None:
        out["dynamo_config"] = {"dynamo_backend": s.dynamo_backend.upper()}
    return out


def write_launch_config(settings: LaunchSettings, path: str | os.PathLike[str]) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(settings_to_yaml_dict(settings), sort_keys=False)
    tmp = path.with_name(f".{path.name}.tmp")  # whole or not there: launch reads it unseen (the default file)
    try:
        tmp.write_text("# written by `lowprec config`; read by `lowprec launch`\n" + text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
