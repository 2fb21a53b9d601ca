"""``ParallelismConfig``: data-parallel sharding x tensor parallelism on one device mesh
(Accelerate's class and environment names, ``Accelerator(parallelism_config=...)``; the mesh is
``accelerator.parallelism_config.mesh(device_type)``).

``tp_size`` processes split each Linear of the model's ``_tp_plan`` (the transformers convention:
``{"model.layers.*.self_attn.q_proj": "colwise", ...}``; lowprec's built-in Llama has one) with
:mod:`lowprec.distributed.tensor_parallel` (FP8 layers) or torch's styles (the others), then
FSDP2 shards over the ``dp_shard`` dimension; the data is split over ``dp_shard`` only (the
processes of one tensor-parallel group read the same batch). Environment:
``PARALLELISM_CONFIG_TP_SIZE``, ``PARALLELISM_CONFIG_DP_SHARD_SIZE``. Context parallelism and
replicated data parallelism (``cp_size``, ``dp_replicate_size`` > 1) are not implemented.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Optional

from lowprec.kwargs import env_int

__all__ = ["ParallelismConfig", "apply_tp_plan", "for_accelerator", "data_shard", "apply_tp", "dp_mesh"]


@dataclass
class ParallelismConfig:
    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    # lowprec's: Megatron-style sequence parallelism inside the tensor-parallel group (the
    # model's _sp_plan; block inputs all-gathered in FP8). Accelerate has no such field.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        self.tp_size = self.tp_size if self.tp_size is not None else env_int("PARALLELISM_CONFIG_TP_SIZE", 1)
        for name in ("dp_replicate_size", "cp_size"):
            if (getattr(self, name) or 1) != 1:
                raise ValueError(f"ParallelismConfig({name}={getattr(self, name)}): lowprec runs data-parallel "
                                 "sharding (dp_shard_size) and tensor parallelism (tp_size) only; set it to 1")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"ParallelismConfig(tp_size={self.tp_size!r}): a positive integer")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("ParallelismConfig(sequence_parallel=True) shards the sequence inside the tensor-parallel "
                             "group: set tp_size > 1 or drop sequence_parallel")
        self._mesh: Any = None

    def resolve(self, world: int) -> None:
        """Fill ``dp_shard_size`` for ``world`` processes; one error naming both sizes if they
        do not multiply to it."""
        if self.dp_shard_size is None:
            self.dp_shard_size = env_int("PARALLELISM_CONFIG_DP_SHARD_SIZE", max(world // self.tp_size, 1))
        if self.dp_shard_size * self.tp_size != world:
            raise ValueError(f"ParallelismConfig: dp_shard_size {self.dp_shard_size} x tp_size {self.tp_size} != "
                             f"{world} processes; launch {self.dp_shard_size * self.tp_size} processes or change "
                             "the sizes")

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    def mesh(self, device_type: str):
        """The ``(dp_shard, tp)`` device mesh (built once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, (self.dp_shard_size, self.tp_size),
                                          mesh_dim_names=("dp_shard", "tp"))
        return self._mesh


def _styles(sequence_parallel: bool) -> dict:
    """Plan value -> style factory (FP8 layers get lowprec's Float8 styles)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    from lowprec.distributed.sequence_parallel import PrepareFloat8ModuleInput
    from lowprec.distributed.tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    # under sequence parallelism the rowwise outputs are reduce-scattered to sequence slices
    row = {"output_layouts": Shard(1)} if sequence_parallel else {}
    return {
        ("colwise", False): ColwiseParallel, ("colwise", True): Float8ColwiseParallel,
        ("rowwise", False): lambda: RowwiseParallel(**row), ("rowwise", True): lambda: Float8RowwiseParallel(**row),
        "sequence_parallel": SequenceParallel,
        "sequence_gather": lambda: PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "sequence_gather_local": lambda: PrepareFloat8ModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True),
        "sequence_shard_output": lambda: PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
    }


def apply_tp_plan(model: Any, tp_mesh: Any, sequence_parallel: bool = False) -> int:
    """Parallelize every module the model's ``_tp_plan`` names (and, with ``sequence_parallel``,
    its ``_sp_plan``); returns how many. FP8 layers get lowprec's Float8 styles (tensorwise),
    the others torch's. A model without a plan is an error, raised before ``tp_mesh`` is used.

    ``_sp_plan`` values: ``sequence_parallel`` (a norm on sequence slices, torch's style),
    ``sequence_gather`` (the module's first input arrives sharded on the sequence and is
    all-gathered, in FP8 when its Linears are FP8), ``sequence_gather_local`` (the same, handed
    on as a plain tensor: a consumer whose weights are not split), ``sequence_shard_output``
    (a replicated output split along the sequence)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lowprec.fp8.linear import Float8Linear

    plan = getattr(model, "_tp_plan", None) or getattr(model, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"tp_size > 1 but {type(model).__name__} has no _tp_plan "
                         "({'<module pattern>': 'colwise' | 'rowwise'}); add one or set tp_size to 1")
    sp_plan = getattr(model, "_sp_plan", None) if sequence_parallel else {}
    if sp_plan is None:
        raise ValueError(f"sequence_parallel with {type(model).__name__}, which has no _sp_plan ({{'<module pattern>': "
                         "'sequence_parallel' | 'sequence_gather' | ...}}); add one or turn sequence_parallel off")
    styles = _styles(sequence_parallel)
    applied = {}
    for name, module in model.named_modules():
        for pattern, style in [*plan.items(), *sp_plan.items()]:
            if fnmatch.fnmatchcase(name, pattern):
                key = (style, isinstance(module, Float8Linear)) if style in ("colwise", "rowwise") else style
                if key not in styles:
                    raise ValueError(f"plan entry {pattern!r}: {style!r} is not a style; use one of "
                                     f"colwise, rowwise{', ' + ', '.join(k for k in styles if isinstance(k, str)) if sp_plan else ''}")
                applied[name] = styles[key]()
                break
    parallelize_module(model, tp_mesh, applied)
    return len(applied)


def for_accelerator(config: Optional[ParallelismConfig], world: int,
                    distributed_type: str) -> Optional[ParallelismConfig]:
    """The Accelerator's resolved config (None: plain data parallelism, nothing to do)."""
    if config is None and env_int("PARALLELISM_CONFIG_TP_SIZE", 1) == 1:
        return None
    config = config or ParallelismConfig()
    config.resolve(world)
    if config.tp_enabled and config.dp_shard_size > 1 and distributed_type != "FSDP":
        raise ValueError(f"tp_size {config.tp_size} with dp_shard_size {config.dp_shard_size} needs FSDP2 for the "
                         "data-parallel dimension: launch with --use_fsdp (or fsdp_version: 2)")
    return config if config.tp_enabled else None


def data_shard(config: Optional[ParallelismConfig], rank: int, world: int, device_type: str) -> tuple[int, int]:
    """(rank, world size) the data is split over: the dp_shard dimension under tensor parallelism."""
    if config is None:
        return rank, world
    return config.mesh(device_type)["dp_shard"].get_local_rank(), config.dp_shard_size


def apply_tp(config: Optional[ParallelismConfig], model: Any, device_type: str) -> None:
    """The Accelerator's step between FP8 conversion and FSDP2 (nothing without tensor parallelism)."""
    if config is not None:
        apply_tp_plan(model, config.mesh(device_type)["tp"], config.sequence_parallel)


def dp_mesh(config: Optional[ParallelismConfig], device_type: str) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard`` under tensor parallelism, else None (all processes)."""
    return None if config is None else config.mesh(device_type)["dp_shard"]
