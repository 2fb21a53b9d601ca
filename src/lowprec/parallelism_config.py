"""``ParallelismConfig``: data-parallel sharding x tensor parallelism on one device mesh
(Accelerate's class and environment names, ``Accelerator(parallelism_config=...)``; the mesh is
``accelerator.torch_device_mesh``; the Accelerator's side is :mod:`lowprec.utils.parallelism`).

``tp_size`` processes split each Linear of the model's ``_tp_plan`` (the transformers convention:
``{"model.layers.*.self_attn.q_proj": "colwise", ...}``; lowprec's built-in Llama has one) with
:mod:`lowprec.distributed.tensor_parallel` (``apply_tp_plan``: FP8 layers get its styles, the
others torch's), then
FSDP2 shards over the ``dp_shard`` dimension; the data is split over ``dp_shard`` only (the
processes of one tensor-parallel group read the same batch). Environment:
``PARALLELISM_CONFIG_TP_SIZE``, ``PARALLELISM_CONFIG_DP_SHARD_SIZE``. Context parallelism and
replicated data parallelism (``cp_size``, ``dp_replicate_size`` > 1) are not implemented.
``ep_size`` (alias ``expert_parallel_degree``, torchtitan's name; environment
``PARALLELISM_CONFIG_EP_SIZE``) shards the model's FP8 experts over ``ep_size`` processes of the
data-parallel dimension with tokens dispatched in FP8 (:mod:`lowprec.distributed.expert_parallel`):
``ep_size`` consecutive processes share the experts, and with more processes than ``ep_size`` each
group of them is a replica (the processes at the same place in every group hold the same experts;
their gradients are averaged over them after each backward that syncs). Not with ``tp_size`` > 1;
``ep_combine`` (lowprec's field: ``hp``, ``bf16`` or ``fp8``) is the wire
format of the expert outputs on their way back. ``sequence_parallel=True`` (lowprec's field) adds the model's ``_sp_plan``: norms and the
residual stream on sequence slices, block inputs all-gathered in FP8
(:mod:`lowprec.distributed.sequence_parallel`), rowwise outputs reduce-scattered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

from lowprec.kwargs import env_int

__all__ = ["ParallelismConfig"]


@dataclass
class ParallelismConfig:
    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    # lowprec's: Megatron-style sequence parallelism inside the tensor-parallel group (the
    # model's _sp_plan; block inputs all-gathered in FP8). Accelerate has no such field.
    sequence_parallel: bool = False
    # expert parallelism: the FP8 experts sharded over ep_size processes of the data-parallel
    # dimension, tokens dispatched in FP8 (lowprec.distributed.expert_parallel); torchtitan's
    # name, expert_parallel_degree, is accepted as an alias
    ep_size: Optional[int] = None
    expert_parallel_degree: Optional[int] = None
    # lowprec's: the wire format of the expert outputs going back to their tokens' ranks (and of
    # the dispatch gradient): "hp" their own dtype (bf16 under bf16 training; the default: FP8
    # costs 0.6 dB of output SQNR, docs/LOG.md 2026-11-28), "bf16", or "fp8" (E4M3 + row scales)
    ep_combine: str = "hp"

    def __post_init__(self) -> None:
        self.tp_size = self.tp_size if self.tp_size is not None else env_int("PARALLELISM_CONFIG_TP_SIZE", 1)
        self._init_ep()
        for name in ("dp_replicate_size", "cp_size"):
            if getattr(self, name) is None:  # Accelerate's launcher exports 1 for both
                setattr(self, name, env_int(f"PARALLELISM_CONFIG_{name.upper()}", 1))
            if getattr(self, name) != 1:
                raise ValueError(
                    f"ParallelismConfig({name}={getattr(self, name)}): lowprec runs data-parallel "
                    "sharding (dp_shard_size) and tensor parallelism (tp_size) only; set it to 1"
                )
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"ParallelismConfig(tp_size={self.tp_size!r}): a positive integer")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError(
                "ParallelismConfig(sequence_parallel=True) shards the sequence inside the tensor-parallel "
                "group: set tp_size > 1 or drop sequence_parallel"
            )
        self._mesh: Any = None
        self._ep_group: Any = None
        self._ep_replicas: Any = None

    def _init_ep(self) -> None:
        ep, alias = self.ep_size, self.expert_parallel_degree
        if ep is not None and alias is not None and ep != alias:
            raise ValueError(
                f"ParallelismConfig(ep_size={ep}, expert_parallel_degree={alias}): two names for one size; "
                "pass one of them"
            )
        ep = ep if ep is not None else alias
        ep = ep if ep is not None else env_int("PARALLELISM_CONFIG_EP_SIZE", 1)
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ValueError(f"ParallelismConfig(ep_size={ep!r}): a positive integer (processes sharing the experts)")
        if ep > 1 and self._tp > 1:
            raise ValueError(
                f"ParallelismConfig(ep_size={ep}, tp_size={self.tp_size}): expert parallelism with tensor "
                "parallelism is not implemented; set one of them to 1"
            )
        self.ep_size = self.expert_parallel_degree = ep
        if self.ep_combine not in ("hp", "bf16", "fp8"):
            raise ValueError(f"ParallelismConfig(ep_combine={self.ep_combine!r}): one of hp, bf16, fp8")

    def resolve(self, world: int) -> None:
        """Fill ``dp_shard_size`` for ``world`` processes; one error naming both sizes if they
        do not multiply to it (and ``ep_size`` must divide the data-parallel processes)."""
        if self.dp_shard_size is None:
            self.dp_shard_size = env_int("PARALLELISM_CONFIG_DP_SHARD_SIZE", max(world // self._tp, 1))
        dp = self.dp_shard_size
        if dp * self._tp != world:
            raise ValueError(
                f"ParallelismConfig: dp_shard_size {dp} x tp_size {self.tp_size} != "
                f"{world} processes; launch {dp * self._tp} processes or change "
                "the sizes"
            )
        if dp % self._ep:
            raise ValueError(
                f"ParallelismConfig(ep_size={self.ep_size}) does not divide the {dp} data-parallel "
                f"processes; launch a multiple of {self.ep_size} processes or change ep_size"
            )

    # tp_size and ep_size are ints from __post_init__ on (None in the constructor: from the
    # environment, as Accelerate reads them)
    @property
    def _tp(self) -> int:
        return cast(int, self.tp_size)

    @property
    def _ep(self) -> int:
        return cast(int, self.ep_size)

    @property
    def ep_enabled(self) -> bool:
        return self._ep > 1

    def ep_group(self) -> Any:
        """This process's expert-parallel group: ``ep_size`` consecutive ranks, a process group
        of its own even when it spans the world (DDP's bucket all-reduces run on the world group
        while backward runs the token all-to-alls, in an order that differs between ranks: on
        one group they would cross). Built once, a collective on first call."""
        if self._ep_group is None:
            import torch.distributed as dist

            self._ep_group, _ = dist.new_subgroups(group_size=self._ep)
        return self._ep_group

    def ep_replica_group(self) -> Any:
        """The processes holding this process's experts in the other expert-parallel groups
        (ranks ``r, r + ep_size, r + 2 ep_size, ...``), over which the expert gradients are
        averaged; ``None`` where ``ep_size`` is every process (no replicas). Built once, a
        collective on first call."""
        import torch.distributed as dist

        world = dist.get_world_size()
        if world == self._ep:
            return None
        if self._ep_replicas is None:
            ranks = [list(range(r, world, self._ep)) for r in range(self._ep)]
            self._ep_replicas, _ = dist.new_subgroups_by_enumeration(ranks)
        return self._ep_replicas

    @property
    def tp_enabled(self) -> bool:
        return self._tp > 1

    # Accelerate's read-only surface (dp_replicate and cp are always 1 here)
    @property
    def dp_shard_enabled(self) -> bool:
        return (self.dp_shard_size or 1) > 1

    dp_replicate_enabled = cp_enabled = sp_enabled = property(lambda self: False)

    @property
    def total_size(self) -> int:
        return (self.dp_shard_size or 1) * self._tp

    @property
    def data_parallel_size(self) -> int:
        return self.dp_shard_size or 1

    @property
    def non_data_parallel_size(self) -> int:
        return self._tp

    def get_device_mesh(self, device_type: Optional[str] = None):
        """Accelerate's name for :meth:`mesh`."""
        if self._mesh is None and device_type is None:
            raise ValueError("ParallelismConfig.get_device_mesh: pass a device_type (e.g. 'cuda') to build the mesh")
        return self.mesh(device_type or self._mesh.device_type)

    def mesh(self, device_type: str):
        """The ``(dp_shard, tp)`` device mesh (built once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(
                device_type, (cast(int, self.dp_shard_size), self._tp), mesh_dim_names=("dp_shard", "tp")
            )
        return self._mesh
