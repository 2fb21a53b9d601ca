"""Resolve, once, where and how this process trains: precision, device, distributed type.

Every ``auto``/default is resolved here into a :class:`Decision` (value plus reason) and logged
once. Environment values come from :func:`lowprec.kwargs.environ` only; under torchrun the
standard ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` are read.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from lowprec.decision import Decision
from lowprec.kwargs import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    env_flag,
    env_get,
    env_int,
)
from lowprec.state.partial import DistributedType, PartialState, ProcessFacts, _resolve_device as _device_and_reason
from lowprec.state.process_group import init_default_group
from lowprec.fp8.gemm.cpu import cpu_gemm_choice
from lowprec.state.gradient import GradientState

__all__ = [
    "PRECISIONS",
    "DistributedType",
    "Decision",
    "DistributedEnv",
    "read_distributed_env",
    "resolve_mixed_precision",
    "fp8_hardware_check",
    "fp8_capability_check",
    "fp8_capability_decision",
    "AcceleratorState",
    "PartialState",
    "GradientState",  # noqa: F822 - served by __getattr__ below (it lives with the dataloaders)
]

logger = logging.getLogger("lowprec")

PRECISIONS = ("no", "fp16", "bf16", "fp8")
FP8_FALLBACKS = ("bf16", "emulate")


@dataclass(frozen=True)
class DistributedEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[str] = None


def read_distributed_env() -> DistributedEnv:
    """The variables torchrun sets for each worker."""
    return DistributedEnv(
        rank=env_int("RANK", 0),
        world_size=env_int("WORLD_SIZE", 1),
        local_rank=env_int("LOCAL_RANK", 0),
        master_addr=env_get("MASTER_ADDR"),
        master_port=env_get("MASTER_PORT"),
    )


def resolve_mixed_precision(explicit: Optional[str]) -> Decision:
    value: Optional[str]
    if explicit is not None:
        value, reason = explicit, "Accelerator(mixed_precision=...)"
    elif env_get("ACCELERATE_MIXED_PRECISION") is not None:
        value, reason = env_get("ACCELERATE_MIXED_PRECISION"), "env ACCELERATE_MIXED_PRECISION"
    else:
        value, reason = "no", "default (no argument, no ACCELERATE_MIXED_PRECISION)"
    value = str(value).lower()
    if value not in PRECISIONS:
        raise ValueError(f"mixed_precision={value!r} is not known; use one of {', '.join(PRECISIONS)}")
    return Decision(value, reason)


FP8_MIN_CAPABILITY = (8, 9)


def fp8_capability_check(cap: Tuple[int, int], fallback: Optional[str], fix: str) -> Optional[str]:
    """The one sm_89 rule (Accelerator and trainer): ``None`` when FP8 GEMMs run on a GPU of
    compute capability ``cap``, else the fallback (``bf16`` / ``emulate``); without a fallback a
    ``ValueError`` whose message ends with ``fix`` (the caller's spelling of the options)."""
    if cap >= FP8_MIN_CAPABILITY:
        return None
    if fallback is None:
        raise ValueError(
            f"FP8 needs a GPU with compute capability 8.9+ (Ada, Hopper or newer); this GPU is "
            f"sm_{cap[0]}{cap[1]} ({cap[0]}.{cap[1]}). {fix}"
        )
    return fallback


_ACCELERATOR_FIX = (
    "Use mixed_precision='bf16', or pass fp8_fallback='bf16' (train in bf16, model not converted) or "
    "fp8_fallback='emulate' (FP8 numerics emulated in float32, slow); env LOWPREC_FP8_FALLBACK does the same"
)


def fp8_capability_decision(cap: Tuple[int, int], fallback: Optional[str], fix: str = _ACCELERATOR_FIX) -> Decision:
    """:func:`fp8_capability_check` as the precision mode it picks on a GPU of capability ``cap``
    (``fp8``, ``fp8-emulate`` or ``bf16``), with its reason. The trainer makes this decision
    while planning (against its :class:`~lowprec.train.resolve.Capabilities`) and hands it to
    the Accelerator, which then does not make it again."""
    chosen = fp8_capability_check(cap, fallback, fix)
    if chosen is None:
        return Decision("fp8", f"CUDA compute capability {cap[0]}.{cap[1]} >= 8.9")
    if chosen == "bf16":
        return Decision("bf16", f"compute capability {cap[0]}.{cap[1]} < 8.9 and fp8_fallback='bf16'")
    return Decision("fp8-emulate", f"compute capability {cap[0]}.{cap[1]} < 8.9 and fp8_fallback='emulate'")


def fp8_hardware_check(device: torch.device, fallback: Optional[str]) -> Decision:
    """FP8 needs compute capability 8.9+ on CUDA. Returns the effective precision mode:
    ``fp8``, ``fp8-emulate`` or ``bf16``; never a silent switch (Accelerate falls back to fp16
    and still converts the model, reference bug 11)."""
    if device.type == "cpu":
        return Decision("fp8", f"CPU: FP8 casts run for real; GEMMs: {cpu_gemm_choice().describe()}")
    if device.type != "cuda":
        return Decision("fp8-emulate", f"device {device.type}: FP8 GEMMs emulated in float32")
    return fp8_capability_decision(torch.cuda.get_device_capability(device), fallback)


def _resolve_device(cpu: bool, env: DistributedEnv) -> Decision:
    return Decision(*_device_and_reason(cpu, env.local_rank))


def _resolve_distributed(env: DistributedEnv, fsdp_plugin, deepspeed_plugin, tp: int = 1) -> tuple[Decision, Any, Any]:
    """The distributed type (Accelerate's: tensor parallelism keeps MULTI_* or FSDP) and why,
    naming tensor parallelism where ``tp`` (tp_size) > 1: the processes are not DDP replicas."""
    use_fsdp = fsdp_plugin is not None or env_flag("ACCELERATE_USE_FSDP")
    use_ds = deepspeed_plugin is not None or env_flag("ACCELERATE_USE_DEEPSPEED")
    if use_fsdp and use_ds:
        raise ValueError("both FSDP and DeepSpeed were asked for; pick one (fsdp_plugin or deepspeed_plugin)")
    if use_fsdp:
        plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()
        why = "fsdp_plugin" if fsdp_plugin is not None else "env ACCELERATE_USE_FSDP"
        if tp > 1:
            why += (
                f"; tensor parallelism tp_size={tp} x FSDP2 over {max(1, env.world_size // tp)} data-parallel shard(s)"
            )
        return Decision(DistributedType.FSDP, why), plugin, None
    if use_ds:
        plugin = deepspeed_plugin if deepspeed_plugin is not None else DeepSpeedPlugin()
        why = "deepspeed_plugin" if deepspeed_plugin is not None else "env ACCELERATE_USE_DEEPSPEED"
        return Decision(DistributedType.DEEPSPEED, why), None, plugin
    if env.world_size > 1:
        kind = (
            DistributedType.MULTI_GPU
            if torch.cuda.is_available() and not env_flag("ACCELERATE_USE_CPU")
            else DistributedType.MULTI_CPU
        )
        how = f"tensor parallelism, tp_size={tp}" if tp > 1 else "DistributedDataParallel"
        return Decision(kind, f"WORLD_SIZE={env.world_size}: {how}"), None, None
    return Decision(DistributedType.NO, "single process"), None, None


class AcceleratorState(ProcessFacts):
    """What the Accelerator resolved: precision, device, process group, plugins.

    One per Accelerator (not shared like Accelerate's: several Accelerators with different
    precisions may live in one process); ``_reset_state`` forgets every live one, as Accelerate's
    does, and ``PartialState`` shows the process facts of the latest."""

    _instances: "weakref.WeakSet[AcceleratorState]" = weakref.WeakSet()
    _known_attrs = (
        "device",
        "distributed_type",
        "mixed_precision",
        "env",
        "decisions",
        "num_processes",
        "process_index",
        "local_process_index",
        "is_main_process",
        "use_distributed",
        "fsdp_plugin",
        "deepspeed_plugin",
        "requested_mixed_precision",
        "fp8_fallback",
        "fp8_emulate",
    )

    def __init__(
        self,
        mixed_precision: Optional[str] = None,
        cpu: bool = False,
        fp8_fallback: Optional[str] = None,
        fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None,
        deepspeed_plugin: Optional[DeepSpeedPlugin] = None,
        init_kwargs: Optional[InitProcessGroupKwargs] = None,
        fp8_hardware: Optional[Decision] = None,
        tp_size: int = 1,
    ) -> None:
        self.decisions: dict[str, Decision] = {}
        self.env = read_distributed_env()
        cpu = cpu or env_flag("ACCELERATE_USE_CPU")
        device = self._decide("device", _resolve_device(cpu, self.env))
        dist_decision, self.fsdp_plugin, self.deepspeed_plugin = _resolve_distributed(
            self.env, fsdp_plugin, deepspeed_plugin, tp_size
        )
        self.distributed_type = self._decide("distributed_type", dist_decision)
        requested = self._decide("mixed_precision", resolve_mixed_precision(mixed_precision))
        self.requested_mixed_precision = requested
        fallback = fp8_fallback if fp8_fallback is not None else env_get("LOWPREC_FP8_FALLBACK")
        if fallback is not None and str(fallback).lower() not in FP8_FALLBACKS:
            raise ValueError(f"fp8_fallback={fallback!r}; use 'bf16' or 'emulate' (or leave it unset)")
        self.fp8_fallback = None if fallback is None else str(fallback).lower()
        self.fp8_emulate = False
        if requested == "fp8":
            # a CUDA decision made by the caller (the trainer's plan) stands; else made here
            made = fp8_hardware if fp8_hardware is not None and device.type == "cuda" else None
            hw = self._decide(
                "fp8_hardware", made if made is not None else fp8_hardware_check(device, self.fp8_fallback)
            )
            self.fp8_emulate = hw == "fp8-emulate"
            mode = "bf16" if hw == "bf16" else "fp8"
        else:
            mode = requested
        self.mixed_precision = mode
        self.device = device
        self._init_process_group(init_kwargs or InitProcessGroupKwargs())
        AcceleratorState._instances.add(self)
        PartialState._reset_state()
        shared = PartialState._shared_state
        shared.update(
            device=device,
            decisions=dict(self.decisions),
            debug=env_flag("ACCELERATE_DEBUG_MODE"),
            backend=dist.get_backend() if dist.is_initialized() else None,
            process_index=self.process_index,
            num_processes=self.num_processes,
            local_process_index=self.local_process_index,
            distributed_type=self.distributed_type if self.num_processes > 1 else DistributedType.NO,
        )

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget every live state (Accelerate's test helper): their Accelerators are unusable
        afterwards, with an error that says why."""
        for state in list(AcceleratorState._instances):
            state.__dict__.clear()
        if reset_partial_state:
            PartialState._reset_state()

    @property
    def initialized(self) -> bool:
        return "device" in self.__dict__

    def __repr__(self) -> str:
        text = super().__repr__()
        if not self.initialized:
            return text
        text += f"\nMixed precision type: {self.mixed_precision}\n"
        fp8 = self.decisions.get("fp8_backend")
        return text + (f"FP8 backend: {fp8.value} ({fp8.reason})\n" if fp8 is not None else "")

    def _decide(self, key: str, decision: Decision) -> Any:
        self.decisions[key] = decision
        if self.env.rank == 0:
            logger.info("lowprec: %s = %s (%s)", key, decision.value, decision.reason)
        return decision.value

    def _init_process_group(self, kwargs: InitProcessGroupKwargs) -> None:
        needs_group = self.env.world_size > 1 or self.distributed_type != DistributedType.NO
        if not needs_group or dist.is_initialized():
            return
        backend = kwargs.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.env.world_size == 1 and self.env.master_addr is None:
            # FSDP2 / DeepSpeed in one plain process: a private in-memory store, no rendezvous
            init_default_group(backend, 0, 1, kwargs.timeout, store=dist.HashStore())
        else:
            init_default_group(backend, self.env.rank, self.env.world_size, kwargs.timeout, kwargs.init_method)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # Accelerate names
    @property
    def process_index(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.env.rank

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.env.world_size

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank


def __getattr__(name: str):
    if name == "GradientState":  # lives with the dataloaders that update it
        return GradientState
    raise AttributeError(f"module 'lowprec.state' has no attribute {name!r}")
