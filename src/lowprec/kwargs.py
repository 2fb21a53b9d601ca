"""Kwargs handlers: the Accelerate-named dataclasses a script passes in ``kwargs_handlers``.

Every field resolves once, in ``__post_init__``: the explicit argument, then its environment
variable, then the documented default. ``to_kwargs()`` returns *every* resolved value (unlike
Accelerate, reference section 8, bug 10), so the value a user reads in the docs is the value the
backend receives. The FP8 recipe handlers live in :mod:`lowprec.fp8_kwargs` and are importable
from here too; what both build on is in :mod:`lowprec.kwargs_base`.

All environment reading goes through :func:`environ` (one place; the launch variables are parsed
by :func:`lowprec.config.env.read_env` over it).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lowprec import fp8_kwargs, kwargs_base
from lowprec.fp8_kwargs import (  # noqa: F401 - the FP8 recipe handlers, Accelerate-named: found here too
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    NativeRecipeKwargs,
    RecipeKwargs,
    TERecipeKwargs,
    normalize_backend,
    recipe_kwargs_from_config,
)
from lowprec.kwargs_base import (  # noqa: F401 - re-exported (__all__)
    ForwardEveryField,
    KwargsHandler,
    _int,
    env_flag,
    env_get,
    env_int,
    environ,
    parse_bool,
    parse_override_linear_precision,
)
from lowprec.logs import log_once

# what a script imports from here: the shared helpers, the handlers below, the FP8 handlers
__all__ = [
    *(n for n in kwargs_base.__all__ if n != "FP8_PREFIX"),
    "AutocastKwargs",
    "GradScalerKwargs",
    "DistributedDataParallelKwargs",
    "DDPCommunicationHookType",
    "InitProcessGroupKwargs",
    "GradientAccumulationPlugin",
    "FullyShardedDataParallelPlugin",
    "DeepSpeedPlugin",
    *fp8_kwargs.__all__,
]


@dataclass(frozen=True)
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass(frozen=True)
class GradScalerKwargs(ForwardEveryField):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


class DDPCommunicationHookType(str, enum.Enum):
    """How DDP all-reduces gradients (Accelerate's names and values): torch's compression hooks
    (``torch.distributed.algorithms.ddp_comm_hooks``): FP16 / BF16 halves, or PowerSGD's
    low-rank approximation; as ``comm_wrapper``, FP16 / BF16 around a PowerSGD hook."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


_COMM_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


@dataclass(frozen=True)
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("comm_hook", "comm_wrapper"):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, DDPCommunicationHookType(getattr(value, "value", value)))
            except ValueError:
                names = ", ".join(repr(t.value) for t in DDPCommunicationHookType)
                raise ValueError(f"DistributedDataParallelKwargs({name}={value!r}): use one of {names}") from None
        if self.comm_wrapper not in ("no", "fp16", "bf16"):
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper.value!r}): a wrapper is "
                "'fp16' or 'bf16' (around a PowerSGD comm_hook), or 'no'"
            )

    def to_kwargs(self) -> dict[str, Any]:
        d = {k: v for k, v in self.to_dict().items() if k not in _COMM_FIELDS}  # registered after wrapping
        d.pop("check_reduction")  # accepted for Accelerate scripts; DDP deprecated it
        if d["broadcast_buffers"]:
            # DDP's own default; passing it explicitly triggers torch's deprecation warning
            d.pop("broadcast_buffers")
        return d

    def register_comm_hook(self, model: Any) -> None:
        """Register ``comm_hook`` (wrapped in ``comm_wrapper``; PowerSGD with a state built from
        ``comm_state_option``) on the DDP ``model``; nothing for ``'no'``."""
        if self.comm_hook == "no":
            if self.comm_wrapper != "no" or self.comm_state_option:
                log_once(
                    "lowprec: DistributedDataParallelKwargs: comm_wrapper / comm_state_option apply to a "
                    "comm_hook, and comm_hook is 'no': nothing registered",
                    logging.WARNING,
                )
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
            "power_sgd": powerSGD_hook.powerSGD_hook,
            "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
        }
        hook: Any = hooks[self.comm_hook.value]
        power_sgd = self.comm_hook in ("power_sgd", "batched_power_sgd")
        if self.comm_wrapper != "no":
            if not power_sgd:
                raise ValueError(
                    f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper.value!r}) wraps a PowerSGD "
                    f"comm_hook; comm_hook={self.comm_hook.value!r} compresses already: drop comm_wrapper"
                )
            wrap = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
            hook = wrap[self.comm_wrapper.value](hook)
        elif self.comm_state_option and not power_sgd:
            raise ValueError(
                "DistributedDataParallelKwargs(comm_state_option=...) configures a PowerSGD comm_hook; "
                f"comm_hook={self.comm_hook.value!r} takes none: drop it"
            )
        state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option) if power_sgd else None
        model.register_comm_hook(state=state, hook=hook)


@dataclass(frozen=True)
class InitProcessGroupKwargs(KwargsHandler):
    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[Any] = None  # datetime.timedelta


def _env_field(var: str, default: Any, parse: Callable[[Any, str], Any]) -> Any:
    """A plugin field that, left ``None``, takes the variable ``var`` (as ``lowprec launch``
    writes it), else ``default``; an explicit or environment value goes through ``parse(value,
    key)`` (``key``: the field, or ``environment variable VAR``, for the error)."""
    return dataclasses.field(default=None, metadata={"env": var, "default": default, "parse": parse})


def _resolve_env_fields(obj: Any) -> None:
    """Every :func:`_env_field` of ``obj``: explicit > its variable > its default."""
    for f in dataclasses.fields(obj):
        if "env" not in f.metadata:
            continue
        value, key = getattr(obj, f.name), f.name
        if value is None:
            value, key = env_get(f.metadata["env"]), f"environment variable {f.metadata['env']}"
        object.__setattr__(obj, f.name, f.metadata["default"] if value is None else f.metadata["parse"](value, key))


def _names(value: Any) -> tuple:
    """Class names: a comma-separated string or a sequence."""
    if isinstance(value, str):
        return tuple(n.strip() for n in value.split(",") if n.strip())
    return tuple(value)


def _upper_choice(*choices: str) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        text = str(value).upper()
        if text not in choices:
            raise ValueError(f"{key}={text!r}; use {' or '.join(choices)}")
        return text

    return parse


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
    ``FSDP_OFFLOAD_PARAMS``, ``FSDP_STATE_DICT_TYPE``. ``state_dict_type``: ``FULL_STATE_DICT``
    (default: ``save_state`` gathers full tensors, written by the main process) or
    ``SHARDED_STATE_DICT`` (each process writes its shards through torch.distributed.checkpoint;
    the checkpoint loads on any number of processes: :mod:`lowprec.checkpoint.sharded`).
    """

    fsdp_version: Optional[int] = _env_field("FSDP_VERSION", 2, lambda v, key: _int(key)(v))
    transformer_cls_names_to_wrap: Optional[tuple] = _env_field(
        "FSDP_TRANSFORMER_CLS_TO_WRAP", (), lambda v, key: _names(v)
    )
    reshard_after_forward: Optional[bool] = _env_field("FSDP_RESHARD_AFTER_FORWARD", True, parse_bool)
    auto_wrap_policy: Optional[str] = None  # its variable counts only without explicit class names
    min_num_params: Optional[int] = _env_field("FSDP_MIN_NUM_PARAMS", 100_000_000, lambda v, key: _int(key)(v))
    offload_params: Optional[bool] = _env_field("FSDP_OFFLOAD_PARAMS", False, parse_bool)
    state_dict_type: Optional[str] = _env_field(
        "FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT", _upper_choice("FULL_STATE_DICT", "SHARDED_STATE_DICT")
    )
    # not a field: lowprec's FSDP2 path has no checkpointing of its own (Accelerate's field, read
    # by transformers' Trainer; Accelerate's plugin asking for it is refused on conversion): use
    # the model's gradient checkpointing (Trainer's gradient_checkpointing=True)
    activation_checkpointing = False

    def __post_init__(self) -> None:
        explicit_names = self.transformer_cls_names_to_wrap is not None  # they imply their policy
        _resolve_env_fields(self)
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version}: lowprec supports FSDP2 (fully_shard) only; set fsdp_version: 2"
            )
        policy = self.auto_wrap_policy
        if policy is None and not explicit_names:
            policy = env_get("FSDP_AUTO_WRAP_POLICY")
        if policy is None:
            policy = "TRANSFORMER_BASED_WRAP" if self.transformer_cls_names_to_wrap else "NO_WRAP"
        policy = str(policy).upper()
        if policy not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"):
            raise ValueError(f"auto_wrap_policy={policy!r}; use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
        object.__setattr__(self, "auto_wrap_policy", policy)
        for env in ("FSDP_ACTIVATION_CHECKPOINTING", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
            if env_flag(env):
                import logging

                logging.getLogger("lowprec").warning(
                    "lowprec: %s=true is not supported by lowprec's FSDP2 path; ignored", env
                )


def _zero_stage(value: Any, key: str) -> int:
    if _int(key)(value) not in (0, 1, 2, 3):
        raise ValueError(f"{key}={value!r}; use 0, 1, 2 or 3")
    return int(value)


def _ds_config(cfg: Any) -> Any:
    """A DeepSpeed config: a dict as given, a path read as JSON."""
    if isinstance(cfg, str):
        import json

        try:
            with open(cfg) as f:
                return json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"DeepSpeed config file {cfg!r} could not be read: {err}") from None
    return cfg


def _offload_device(value: Any, key: str) -> str:
    if str(value).lower() not in ("none", "cpu", "nvme"):
        raise ValueError(f"{key}={value!r}; use none, cpu or nvme")
    return str(value).lower()


@dataclass(frozen=True)
class DeepSpeedPlugin(KwargsHandler):
    """DeepSpeed ZeRO 1-3 (optional extra). Env (as ``lowprec launch`` writes them):
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``,
    ``ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE``, ``ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE``,
    ``ACCELERATE_GRADIENT_CLIPPING``. ``hf_ds_config`` is a dict or a JSON file path."""

    zero_stage: Optional[int] = _env_field("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2, _zero_stage)
    gradient_clipping: Optional[float] = _env_field("ACCELERATE_GRADIENT_CLIPPING", None, lambda v, key: float(v))
    hf_ds_config: Optional[Any] = _env_field("ACCELERATE_DEEPSPEED_CONFIG_FILE", None, lambda v, key: _ds_config(v))
    offload_optimizer_device: Optional[str] = _env_field(
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", None, _offload_device
    )
    offload_param_device: Optional[str] = _env_field("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", None, _offload_device)

    def __post_init__(self) -> None:
        _resolve_env_fields(self)
