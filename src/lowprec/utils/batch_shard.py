"""Which of a batch sampler's batches one process gets: Accelerate's ``BatchSamplerShard`` rules.

A prepared dataloader (:class:`lowprec.utils.data_loader.DataLoaderShard`) deals one epoch's
batches out with :meth:`BatchSamplerShard.plan` and shows that object as its ``batch_sampler``
(``batch_size``, ``drop_last``, ``even_batches``, ``num_processes``, ``process_index`` as on
Accelerate's); built directly, ``BatchSamplerShard(batch_sampler, num_processes, process_index,
split_batches=, even_batches=)`` iterates this process's share of ``batch_sampler``.

The rules, for ``W`` processes, process ``r``:

- Whole batches (not ``split_batches``): batches ``r, r + W, r + 2W, ...``. ``drop_last`` (the
  batch sampler's) drops a last step that lacks a batch for some process. Otherwise, with
  ``even_batches``, the last step is completed from the start of the epoch: over batches of the
  sampler's ``batch_size``, a short last batch is filled and the missing batches are made of the
  indices that follow, cycling over the first ``W`` batches; where batches have no one size, the
  missing ones are the first batches, whole. Without ``even_batches`` nothing is added.
- ``split_batches``: every batch is cut into ``W`` equal slices, process ``r`` taking slice
  ``r``; a short last batch is filled from the first batch first (``even_batches``), or cut as it
  is, a process whose slice would be empty getting none (without ``even_batches``), or dropped
  (``drop_last``).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from torch.utils.data import BatchSampler

__all__ = ["BatchSamplerShard"]


class BatchSamplerShard(BatchSampler):
    """This process's batches of ``batch_sampler`` (Accelerate's class and constructor; the rules
    are in the module docstring)."""

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        self._set(batch_sampler, num_processes, process_index, split_batches, even_batches)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise ValueError(
                f"split_batches=True cuts every batch into {num_processes} equal slices: the batch size "
                f"({self.batch_size}) needs to be a round multiple of the number of processes ({num_processes}); "
                "use such a batch size, or split_batches=False to deal out whole batches"
            )

    @classmethod
    def bound(
        cls, batch_sampler: Any, num_processes: int, process_index: int, split_batches: bool, even_batches: bool
    ) -> "BatchSamplerShard":
        """A prepared dataloader's: no ``split_batches`` check (the loader checks its batch size
        itself, and cuts a batch sampler that has none by its first batch's size)."""
        self = cls.__new__(cls)
        self._set(batch_sampler, num_processes, process_index, split_batches, even_batches)
        return self

    def _set(
        self, batch_sampler: Any, num_processes: int, process_index: int, split_batches: bool, even_batches: bool
    ) -> None:
        # BatchSampler.__init__ is not called (as Accelerate's): its checks are for its own arguments
        self.batch_sampler = batch_sampler
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]  # None: no set size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    @property
    def total_length(self) -> int:
        """Batches of the whole ``batch_sampler`` (all processes together)."""
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return self.length(len(self.batch_sampler))

    def length(self, n: int) -> int:
        """Batches this process gets out of ``n`` (Accelerate's count; with ``split_batches`` every
        batch counts, the last one on every process)."""
        w = self.num_processes
        if self.split_batches:
            return n
        if self.drop_last or n % w == 0:
            return n // w
        return n // w + (1 if self.even_batches or self.process_index < n % w else 0)

    def __iter__(self) -> Iterator[list]:
        return iter(self.plan([list(b) for b in self.batch_sampler])[0])

    def plan(self, batches: list[list[int]]) -> tuple[list[list[int]], int]:
        """This process's batches out of one epoch's ``batches`` (in order), and the real samples
        of the last step when it was completed from the start of the epoch (-1: nothing added)."""
        if not batches:
            return [], -1
        if self.split_batches:
            return self._plan_split(batches)
        w, r, n = self.num_processes, self.process_index, len(batches)
        if self.drop_last:
            return batches[r : n - n % w : w], -1
        if not self.even_batches:
            return batches[r::w], -1
        steps = -(-n // w)
        out = [list(b) for b in batches]
        width = self.batch_size
        if width is not None and all(len(b) == width for b in batches[:-1]) and len(batches[-1]) <= width:
            start = itertools.cycle([i for b in batches[:w] for i in b])
            out[-1] += itertools.islice(start, width - len(out[-1]))
            out += [list(itertools.islice(start, width)) for _ in range(steps * w - n)]
        else:
            out += [list(batches[k % n]) for k in range(steps * w - n)]
        added = len(out) != n or len(out[n - 1]) != len(batches[-1])
        return out[r::w], (sum(len(b) for b in batches[(steps - 1) * w :]) if added else -1)

    def _plan_split(self, batches: list[list[int]]) -> tuple[list[list[int]], int]:
        w, r = self.num_processes, self.process_index
        width = self.batch_size or len(batches[0])
        per = width // w
        out, remainder = [], -1
        for b in batches:
            if len(b) < width:
                if self.drop_last or (not self.even_batches and len(b) <= r * per):
                    continue
                if self.even_batches:
                    remainder = len(b)
                    b = b + list(itertools.islice(itertools.cycle(batches[0]), width - len(b)))
            out.append(b[r * per : (r + 1) * per])
        return out, remainder
