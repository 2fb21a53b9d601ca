"""The Accelerator's side of tensor parallelism, with Accelerate 1.15's surface.

* ``Accelerator(parallelism_config=ParallelismConfig(tp_size=N))``, or Accelerate's older
  ``torch_tp_plugin=TorchTensorParallelPlugin(tp_size=N)``: deprecated in Accelerate 1.15 in
  favour of ``ParallelismConfig`` and still accepted there with a ``FutureWarning`` (the same
  message here), turned into ``ParallelismConfig(tp_size=N)`` unless a ``parallelism_config`` is
  given too (which wins, as in Accelerate).
* ``accelerator.torch_device_mesh`` (the ``(dp_shard, tp)`` mesh, ``None`` without tensor
  parallelism), ``tensor_parallel_rank``, ``data_parallel_rank``, ``data_parallel_shard_rank``.
* The steps :meth:`Accelerator.prepare` takes: resolve the sizes against the process count,
  apply the model's plan after FP8 conversion and before FSDP2, shard FSDP2 and the data over
  ``dp_shard`` only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from lowprec.accelerator_host import AcceleratorHost
from lowprec.distributed.expert_parallel import apply_expert_parallel, expert_parallel_names
from lowprec.distributed.expert_replicas import ExpertReplicas
from lowprec.kwargs import env_int
from lowprec.parallelism_config import ParallelismConfig

__all__ = [
    "TorchTensorParallelPlugin",
    "ParallelismMixin",
    "parallelism_from_kwargs",
    "for_accelerator",
    "tp_size_of",
    "data_shard",
    "apply_tp",
    "dp_mesh",
]


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's deprecated plugin: ``tp_size`` becomes ``ParallelismConfig(tp_size=...)``."""

    tp_size: int = field(default=1, metadata={"help": "tensor parallel size used in the device mesh"})
    torch_device_mesh: Any = field(default=None)


def parallelism_from_kwargs(kwargs: dict) -> Optional[ParallelismConfig]:
    """Pop ``parallelism_config`` and ``torch_tp_plugin`` from the Accelerator's keywords."""
    config = kwargs.pop("parallelism_config", None)
    plugin = kwargs.pop("torch_tp_plugin", None)
    if plugin is not None:
        warnings.warn(
            "`TorchTensorParallelPlugin` is deprecated and will be removed in a future version of Accelerate. "
            "Please use the `ParallelismConfig` with `tp_size` instead.",
            FutureWarning,
            stacklevel=3,
        )
        if config is None:
            config = ParallelismConfig(tp_size=plugin.tp_size)
    if config is not None and not isinstance(config, ParallelismConfig):
        raise TypeError(f"parallelism_config takes a lowprec.ParallelismConfig, got {type(config).__name__}")
    return config


def for_accelerator(
    config: Optional[ParallelismConfig], world: int, distributed_type: str
) -> Optional[ParallelismConfig]:
    """The Accelerator's resolved config (None: plain data parallelism, nothing to do)."""
    if (
        config is None
        and env_int("PARALLELISM_CONFIG_TP_SIZE", 1) == 1
        and env_int("PARALLELISM_CONFIG_EP_SIZE", 1) == 1
    ):
        return None
    config = config or ParallelismConfig()
    config.resolve(world)  # sets dp_shard_size (an int from here on)
    if config.tp_enabled and config.dp_shard_enabled and distributed_type != "FSDP":
        raise ValueError(
            f"tp_size {config.tp_size} with dp_shard_size {config.dp_shard_size} needs FSDP2 for the "
            "data-parallel dimension: launch with --use_fsdp (or fsdp_version: 2)"
        )
    if config.ep_enabled:
        if not (str(distributed_type).startswith("MULTI_") or distributed_type == "FSDP"):  # DDP or FSDP2
            raise ValueError(
                f"ep_size {config.ep_size} runs the non-expert weights under DDP or FSDP2 (launch several "
                f"processes, without DeepSpeed, which does not compose with expert parallelism yet); got "
                f"{distributed_type}"
            )
    return config if (config.tp_enabled or config.ep_enabled) else None


def tp_size_of(config: Optional[ParallelismConfig]) -> int:
    """The tensor-parallel size asked for (the config's, else env PARALLELISM_CONFIG_TP_SIZE)."""
    return int(config.tp_size or 1) if config is not None else env_int("PARALLELISM_CONFIG_TP_SIZE", 1)


def data_shard(config: Optional[ParallelismConfig], rank: int, world: int, device_type: str) -> tuple[int, int]:
    """(rank, world size) the data is split over: the dp_shard dimension under tensor parallelism."""
    if config is None or not config.tp_enabled:  # expert parallelism: every process its own data
        return rank, world
    return config.mesh(device_type)["dp_shard"].get_local_rank(), config.data_parallel_size


def apply_tp(config: Optional[ParallelismConfig], model: Any, device_type: str) -> None:
    """The Accelerator's step between FP8 conversion and FSDP2 (nothing without tensor parallelism)."""
    if config is not None and config.tp_enabled:
        # torch.distributed.tensor costs ~0.4 s to import: only a tensor-parallel run pays for it
        from lowprec.distributed.tensor_parallel import apply_tp_plan

        apply_tp_plan(model, config.mesh(device_type)["tp"], config.sequence_parallel)


def apply_ep(config: Optional[ParallelismConfig], model: Any) -> tuple[list[str], Optional[ExpertReplicas]]:
    """The Accelerator's expert-parallel step, after FP8 conversion and before DDP / FSDP2:
    shard the experts (:func:`lowprec.distributed.expert_parallel.apply_expert_parallel`) with
    DDP's / FSDP2's averaging (expert gradients scaled by 1 / ep_size, then averaged over the
    replicas where there are more processes than ``ep_size``); returns the names of the
    parameters and buffers DDP / FSDP2 must leave alone (each rank's own experts) and the
    replicas' gradient reduction (``None`` without replicas)."""
    if config is None or not config.ep_enabled:
        return [], None
    ep_size = cast(int, config.ep_size)  # an int once ParallelismConfig is built (__post_init__)
    apply_expert_parallel(model, ep_size, config.ep_group(), grad_scale=1.0 / ep_size, combine=config.ep_combine)
    names = expert_parallel_names(model)
    group = config.ep_replica_group()
    if group is None:
        return names, None
    own = set(names)
    return names, ExpertReplicas(group, [p for n, p in model.named_parameters() if n in own])


def describe_ep(config: Optional[ParallelismConfig], world: int) -> Optional[str]:
    """One line for the conversion report: how the experts are shared out (None without ``ep_size``)."""
    if config is None or not config.ep_enabled:
        return None
    replicas = world // cast(int, config.ep_size)  # an int once ParallelismConfig is built (__post_init__)
    line = (
        f"expert parallelism: ep_size {config.ep_size} of {world} processes: each process holds 1/{config.ep_size} "
        f"of every experts module's experts, tokens dispatched among {config.ep_size} processes (outputs back: "
        f"{config.ep_combine})"
    )
    if replicas > 1:
        line += f"; {replicas} replicas of the experts, their gradients averaged over the replicas"
    return line


def dp_mesh(config: Optional[ParallelismConfig], device_type: str) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard`` under tensor parallelism, else None (all processes)."""
    return None if config is None else config.mesh(device_type)["dp_shard"]


class ParallelismMixin(AcceleratorHost):
    """Accelerate's mesh and rank properties (needs ``parallelism_config`` and ``device``)."""

    _parallelism_from_kwargs = staticmethod(parallelism_from_kwargs)

    @property
    def torch_device_mesh(self) -> Any:
        pc = self.parallelism_config
        return None if pc is None else pc.mesh(self.device.type)

    def _mesh_rank(self, dim: str, enabled: bool, what: str) -> int:
        if self.parallelism_config is None:
            raise RuntimeError(f"{what} is not configured. Set `parallelism_config` first.")
        return self.torch_device_mesh.get_local_rank(dim) if enabled else 0

    @property
    def tensor_parallel_rank(self) -> int:
        pc = self.parallelism_config
        return self._mesh_rank("tp", pc is not None and pc.tp_enabled, "Tensor parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        pc = self.parallelism_config
        return self._mesh_rank("dp_shard", pc is not None and pc.dp_shard_enabled, "Shard-based data parallelism")

    @property
    def data_parallel_rank(self) -> int:
        return self._mesh_rank("dp_replicate", False, "Data parallelism")  # no replicate dimension here
