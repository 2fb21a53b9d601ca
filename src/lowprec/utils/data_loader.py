"""Accelerate's ``accelerate.data_loader``: the prepared dataloaders and their helpers, and the
module-level ``prepare_data_loader``.

The classes live in their own modules: :class:`DataLoaderShard` (every process reads its share;
:mod:`lowprec.utils.loader_shard`), :class:`DataLoaderDispatcher` (process 0 reads and sends;
:mod:`lowprec.utils.dispatcher`), :class:`BatchSamplerShard` (which batches a process gets;
:mod:`lowprec.utils.batch_shard`).

``prepare_data_loader`` builds what ``Accelerator.prepare`` builds for a dataloader, for the
processes and the process it is told: ``num_processes=2, process_index=r`` on one process gives
process ``r``'s batches of a 2-process job, Accelerate's for a map-style dataset. What differs
from Accelerate, each refused with the fix or said here: shuffling without a generator uses
``data_seed`` (default: the torch seed) ``+ epoch`` rather than a seed drawn from the global RNG
(set the seed on every process, or pass ``data_seed``); an ``IterableDataset`` is not split on
several processes but dispatched (``dispatch_batches=True``, which needs the job's process group);
``slice_fn_for_dispatch`` cuts batches under ``split_batches`` only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lowprec.state.partial import DistributedType, PartialState
from lowprec.utils.batch_shard import BatchSamplerShard
from lowprec.utils.dispatcher import DataLoaderDispatcher, check_slice_fn
from lowprec.utils.loader_shard import (
    DataLoaderShard,
    DataLoaderStateMixin,
    GradientState,
    SkipDataLoader,
    _check_constructor,
    skip_first_batches,
)

__all__ = [
    "GradientState",
    "BatchSamplerShard",
    "DataLoaderStateMixin",
    "DataLoaderShard",
    "DataLoaderDispatcher",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]


def data_seed_default(broadcast: bool = False) -> int:
    """The shuffling seed when none is given: the torch seed (``torch.manual_seed`` / ``set_seed``),
    below 2**31; ``broadcast``: process 0's on every process (a collective: every process calls it)."""
    seed = torch.tensor([torch.initial_seed() % (2**31)], dtype=torch.int64)
    if broadcast:
        dist.broadcast(seed, src=0)
    return int(seed)


def _mesh_shard(mesh: Any, rank: int, world: int, deepspeed: bool) -> tuple[int, int]:
    """(rank, world size) the data is dealt over on ``mesh`` (Accelerate's reading of it):
    processes that differ only in their tensor- or context-parallel coordinate share batches."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())

    def size(name: str) -> int:
        return int(mesh[name].size()) if name in names else 1

    if deepspeed:
        return rank // size("tp"), world // size("tp")
    return rank // (size("tp") * size("cp")), size("dp_replicate") * size("dp_shard")


def prepare_data_loader(
    dataloader: DataLoader,
    device: Optional[torch.device] = None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Optional[list] = None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable] = None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader:
    """``dataloader`` for process ``process_index`` of ``num_processes`` (default: this job's,
    ``PartialState``), its batches moved to ``device`` when ``put_on_device``; Accelerate's
    arguments and meaning (see the module docstring for the few differences).

    - ``split_batches``: each batch cut into ``num_processes`` slices (its size must divide);
      otherwise whole batches are dealt out. ``even_batches``: a last step short of batches is
      completed from the start of the epoch (the DataLoader's ``drop_last`` drops it instead).
    - ``dispatch_batches`` (default: for an ``IterableDataset`` when ``put_on_device``): process 0
      reads and sends each process its batch; needs ``put_on_device`` and, on several processes,
      the job's process group. ``slice_fn_for_dispatch(batch, slice, process_index=,
      num_processes=)`` cuts a dispatched batch (with ``split_batches``).
    - ``use_seedable_sampler``: shuffle with ``data_seed + epoch`` even where the sampler has a
      generator of its own; ``rng_types``: random states copied from process 0 at every epoch.
    - ``torch_device_mesh``: processes that differ only along ``tp`` / ``cp`` get the same batches.
    """
    _check_constructor(use_stateful_dataloader, None)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "prepare_data_loader(dispatch_batches=True) needs put_on_device=True (as in Accelerate): dispatched "
            "batches arrive on the device; pass put_on_device=True, or dispatch_batches=False"
        )
    if num_processes is None or process_index is None or torch_device_mesh is not None:
        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
        if torch_device_mesh is not None:
            if dispatch_batches:
                raise ValueError(
                    "prepare_data_loader(torch_device_mesh=..., dispatch_batches=True): lowprec's dispatcher "
                    "sends every process its own batch; pass dispatch_batches=False (tensor-parallel ranks "
                    "then read the same batches), or leave torch_device_mesh out"
                )
            deepspeed = state.distributed_type == DistributedType.DEEPSPEED
            process_index, num_processes = _mesh_shard(torch_device_mesh, process_index, num_processes, deepspeed)
    if dispatch_batches and num_processes > 1:
        _check_dispatch_group(num_processes, process_index)
        check_slice_fn(slice_fn_for_dispatch, split_batches, "slice_fn_for_dispatch")
    loader = (DataLoaderDispatcher if dispatch_batches else DataLoaderShard).wrap(
        dataloader,
        rank=process_index,
        world_size=num_processes,
        device=device if put_on_device else None,
        seed=data_seed_default() if data_seed is None else data_seed,
        gradient_state=GradientState(),
        split_batches=split_batches,
        even_batches=even_batches,
        non_blocking=non_blocking,
        seedable=use_seedable_sampler,
    )
    # the sampler's generator is replayed from process 0's state by the loader itself
    loader.rng_types = [t for t in rng_types or [] if getattr(t, "value", t) != "generator"] or None
    if dispatch_batches:
        loader.slice_fn = slice_fn_for_dispatch
    return loader


def _check_dispatch_group(num_processes: int, process_index: int) -> None:
    """Dispatching sends each batch from process 0 over the job's process group: one must exist,
    of ``num_processes`` processes, this one being ``process_index``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"prepare_data_loader(dispatch_batches=True, num_processes={num_processes}): process 0 sends every "
            "batch over the process group, and there is none (torch.distributed is not initialized); run under "
            "lowprec launch / torchrun (or init_process_group first), or pass dispatch_batches=False to have "
            "each process read its own batches by process_index"
        )
    if (num_processes, process_index) != (dist.get_world_size(), dist.get_rank()):
        raise ValueError(
            f"prepare_data_loader(dispatch_batches=True, num_processes={num_processes}, process_index="
            f"{process_index}): dispatching goes over the process group, which has {dist.get_world_size()} "
            f"processes, this one {dist.get_rank()}; leave num_processes / process_index out, or pass "
            "dispatch_batches=False"
        )
