"""A prepared DataLoader: shards batches across processes, moves them to the device, knows its
position (for ``save_state``/``load_state``) and the last batch (for gradient accumulation and
``gather_for_metrics``).

Sharding follows Accelerate's ``BatchSamplerShard``: the original batch sampler's batches are
dealt round-robin, process ``r`` gets batches ``r, r + W, r + 2W, ...``. With several processes
the last step is padded from the start (a short last batch filled, missing batches added as whole
batches) so every process runs the same number of steps; the padding is dropped again by
``gather_for_metrics``. One process gets the original batches unchanged. Shuffling uses a generator seeded with
``seed + epoch``, identical on every process, so shards never overlap.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lowprec.utils.operations import send_to_device

__all__ = ["GradientState", "DataLoaderShard", "skip_first_batches"]


class GradientState:
    """Shared between the Accelerator and its dataloaders: where the loop is."""

    def __init__(self, num_steps: int = 1, sync_with_dataloader: bool = True) -> None:
        self.num_steps = num_steps
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.remainder = -1  # real samples in the last global batch (-1: no padding)
        self.active: list["DataLoaderShard"] = []


class DataLoaderShard:
    def __init__(
        self,
        dataloader: DataLoader,
        *,
        rank: int,
        world_size: int,
        device: Optional[torch.device],
        seed: int,
        gradient_state: GradientState,
    ) -> None:
        self.base = dataloader
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.seed = seed
        self.gradient_state = gradient_state
        self.epoch = 0
        self.batches_yielded = 0
        self._skip = 0
        # an IterableDataset, or batch_size=None (no batching), is passed through unsharded
        self.iterable = isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None
        if self.iterable and world_size > 1:
            raise ValueError(
                "prepare() can shard only a DataLoader with a batch size over a map-style dataset; "
                "shard an IterableDataset inside the dataset (e.g. by torch.distributed.get_rank()) "
                "and pass that DataLoader per process"
            )

    # ------------------------------------------------------------------ batches of this process
    def _global_batches(self) -> list[list[int]]:
        sampler = self.base.sampler
        if isinstance(sampler, RandomSampler):
            # every process draws the same permutation for this epoch
            sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return [list(b) for b in self.base.batch_sampler]

    def _local_batches(self) -> tuple[list[list[int]], int]:
        batches = self._global_batches()
        if self.world_size == 1 or not batches:
            return batches, -1  # one process: exactly the original batches (PyTorch's behaviour)
        n, width = len(batches), len(batches[0])
        steps = -(-n // self.world_size)
        last_step = range((steps - 1) * self.world_size, n)
        remainder = sum(len(batches[i]) for i in last_step)
        padded = [list(b) for b in batches]
        regular = all(len(b) == width for b in batches[:-1])
        if regular and len(batches[-1]) < width:
            # a plain BatchSampler's short last batch: fill it from the start (as Accelerate), so
            # every process holds equal-sized batches for gather()
            flat = [i for b in batches for i in b]
            padded[-1] += [flat[k % len(flat)] for k in range(width - len(batches[-1]))]
        # missing batches: whole batches cycled from the start, so a custom batch sampler's
        # boundaries are kept
        padded += [list(batches[k % n]) for k in range(steps * self.world_size - n)]
        changed = len(padded) != n or len(padded[n - 1]) != len(batches[-1])
        return padded[self.rank::self.world_size], (remainder if changed else -1)

    def __len__(self) -> int:
        if self.iterable:
            return len(self.base)
        return -(-len(self.base.batch_sampler) // self.world_size)

    def __iter__(self) -> Iterator[Any]:
        gs = self.gradient_state
        gs.active.append(self)
        gs.end_of_dataloader = False
        try:
            if self.iterable:
                source, count, remainder, skip = iter(self.base), None, -1, 0
            else:
                mine, remainder = self._local_batches()
                skip, self._skip = self._skip, 0
                loader = DataLoader(
                    self.base.dataset,
                    batch_sampler=mine[skip:],
                    collate_fn=self.base.collate_fn,
                    num_workers=self.base.num_workers,
                    pin_memory=self.base.pin_memory,
                    worker_init_fn=self.base.worker_init_fn,
                    # its own generator: starting an epoch must not draw from the global RNG, or
                    # a run resumed mid-epoch would see a shifted dropout/noise stream
                    generator=torch.Generator().manual_seed(self.seed + self.epoch),
                )
                source, count = iter(loader), len(mine)
            self.batches_yielded = skip
            for batch in source:
                self.batches_yielded += 1
                last = count is not None and self.batches_yielded == count
                gs.end_of_dataloader = last
                gs.remainder = remainder if last else -1
                yield send_to_device(batch, self.device) if self.device is not None else batch
            self.epoch += 1
            self.batches_yielded = 0
        finally:
            gs.active.remove(self)
            gs.end_of_dataloader = False if not gs.active else gs.end_of_dataloader

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration resumes where the saved one was (same epoch, same shuffle)."""
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self._skip = int(state["batches_yielded"])
        self.batches_yielded = self._skip

    @property
    def dataset(self):
        return self.base.dataset

    @property
    def batch_size(self):
        return self.base.batch_size


def skip_first_batches(dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
    """The next iteration of ``dataloader`` starts ``num_batches`` in (Accelerate's helper)."""
    if not isinstance(dataloader, DataLoaderShard):
        raise TypeError("skip_first_batches needs a dataloader returned by accelerator.prepare()")
    dataloader._skip = int(num_batches)
    return dataloader
