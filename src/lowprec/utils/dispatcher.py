"""``dispatch_batches=True``: process 0 reads the dataloader and sends each process its batch.

Accelerate's ``DataLoaderDispatcher``. Where :class:`DataLoaderShard` has every process read its
own shard of the batch sampler (map-style datasets only), here only process 0 iterates the
original loader, so an ``IterableDataset`` (a stream that cannot be indexed or sharded) trains
on several processes too, each step on different data. Per step process 0 takes
``num_processes`` batches (with ``split_batches``, one batch cut into ``num_processes`` equal
slices), and broadcasts them (``broadcast_object_list``: pickled, fine for CPU/gloo batches;
Accelerate broadcasts the concatenated tensors); each process keeps its own. A last step with
fewer samples is made even as Accelerate makes it: its real samples, then the epoch's first
samples up to a multiple of ``num_processes``, cut into equal slices, so every process holds a
batch of the same size (``gather`` needs it; a short last batch on one process and a whole
filling batch on another aborted the job). ``GradientState.remainder`` says how many samples
were real, so ``gather_for_metrics`` drops the filling. Batches holding anything but tensors
with a batch dimension (strings, say) cannot be cut: their last step is filled with whole
first batches. Process 0 reads one step ahead to know which step is the last.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional, Sized, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lowprec.state.partial import PartialState
from lowprec.utils.loader_shard import DataLoaderShard, GradientState, _check_constructor
from lowprec.utils.operations import recursively_apply, send_to_device

__all__ = ["DataLoaderDispatcher"]


def _cuttable(batch: Any, n: int) -> bool:
    """Whether every leaf of ``batch`` is a tensor whose first dimension is its ``n`` samples."""
    ok = [True]

    def check(leaf: Any) -> Any:
        ok[0] = ok[0] and isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == n
        return leaf

    recursively_apply(check, batch, test_type=lambda _: True)
    return ok[0]


def _join(parts: list) -> Any:
    """Batches of one structure concatenated along the samples (tensor leaves only)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return type(first)({k: _join([p[k] for p in parts]) for k in first})
    out = [_join([p[i] for p in parts]) for i in range(len(first))]
    return type(first)(*out) if hasattr(first, "_fields") else type(first)(out)


def _even_step(step: list, first: list, w: int) -> tuple[list, int]:
    """One batch per process for a step's batches (``step``: ``w`` of them, or fewer at the end of
    an epoch) and the step's real samples, or -1 when nothing was filled. ``w`` batches of one
    size go as they are. Otherwise the samples are cut into ``w`` equal slices, the epoch's first
    samples (``first``: its first batches) filling up to a multiple of ``w``; batches that are not
    made of tensors with a batch dimension are filled with whole first batches instead."""
    lens = [_batch_len(b) for b in step]
    if len(step) == w and len(set(lens)) == 1:
        return step, -1
    if not all(_cuttable(b, n) for b, n in zip(step + first, lens + [_batch_len(b) for b in first])):
        whole = step + [first[k % len(first)] for k in range(w - len(step))]
        return whole, (sum(lens) if len(step) < w else -1)
    real = sum(lens)
    per = -(-real // w)
    fill = per * w - real
    pool = _join(first)
    while _batch_len(pool) < fill:  # an epoch shorter than the filling: its samples again
        pool = _join([pool, pool])
    samples = _join([*step, recursively_apply(lambda t: t[:fill], pool)]) if fill else _join(step)
    return [recursively_apply(lambda t, r=r: t[r * per : (r + 1) * per], samples) for r in range(w)], (
        real if fill else -1
    )


def _batch_len(batch: Any) -> int:
    found: list[int] = []

    def record(t: Any) -> Any:
        found.append(t.shape[0] if t.ndim else 1)
        return t

    recursively_apply(record, batch)
    return found[0] if found else 1


def check_slice_fn(slice_fn: Optional[Callable], split_batches: bool, name: str) -> None:
    """``slice_fn`` cuts batches under ``split_batches`` only: lowprec dispatches whole batches
    otherwise (Accelerate cuts the concatenated step with it)."""
    if slice_fn is not None and not split_batches:
        raise ValueError(
            f"{name}: lowprec's dispatcher sends whole batches unless split_batches=True; "
            f"pass split_batches=True to have each batch cut by {name}, or drop {name}"
        )


class DataLoaderDispatcher(DataLoaderShard):
    """A prepared dataloader whose batches are read on process 0 and dispatched."""

    dispatches = True

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Optional[Callable] = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        """Accelerate's public constructor: a DataLoader over ``dataset`` from the keyword
        arguments, read on process 0 and dispatched to this job's processes (``PartialState``),
        batches on the process's device. ``skip_batches`` steps are skipped every epoch;
        ``_drop_last`` drops a last step without a batch for every process instead of filling it;
        ``slice_fn(batch, slice, process_index=, num_processes=)`` cuts a batch under ``split_batches``."""
        _check_constructor(use_stateful_dataloader, torch_device_mesh)
        check_slice_fn(slice_fn, split_batches, "slice_fn")
        state = PartialState()
        self._setup(
            DataLoader(dataset, **kwargs),
            rank=state.process_index,
            world_size=state.num_processes,
            device=state.device,
            seed=None,
            gradient_state=GradientState(),
            split_batches=split_batches,
            non_blocking=_non_blocking,
        )
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self.slice_fn = slice_fn
        self.epoch = iteration

    def _epoch_len(self) -> int:
        if self.given:
            n = len(self.base)
            steps = (
                n
                if self.split_batches or self.world_size == 1
                else (n // self.world_size if self._drop_last else -(-n // self.world_size))
            )
            return max(0, steps - self.skip_batches)
        n = len(self.base) if self.iterable else len(cast(Sized, self._batch_sampler())) - self.skip_batches
        if self.split_batches or self.world_size == 1:
            return n
        return n // self.world_size if self._drop_last else -(-n // self.world_size)

    @property
    def total_batch_size(self) -> Optional[int]:
        """Samples in one step over all processes: the loader's batch size, times the number of
        processes unless ``split_batches`` (what Accelerate 1.15's dispatcher means; its own reads
        the dataset's ``batch_size`` and raises); None for ``batch_size=None``."""
        size = self.base.batch_size
        return size if size is None or self.split_batches else size * self.world_size

    @property
    def total_dataset_length(self) -> int:
        """Samples in the dataset (Accelerate's dispatcher: its ``len``)."""
        return len(self.dataset)

    def _source(self, skip_steps: int) -> Iterator[Any]:
        """Process 0: the original loader's batches of this epoch (same shuffle as a shard)."""
        per_step = 1 if self.split_batches else self.world_size
        if self.iterable or self.given:
            return itertools.islice(iter(self.base), skip_steps * per_step, None)
        return iter(self._epoch_loader(self._global_batches()[skip_steps * per_step :]))

    def _steps(self, skip_steps: int) -> Iterator[tuple[list, int]]:
        """Process 0: (one batch per process, real samples or -1 when nothing was filled)."""
        w = self.world_size
        if self.split_batches:
            head = None  # the epoch's first batch: what fills a short last one
            for b in self._source(skip_steps):
                head = b if head is None else head
                slice_fn = getattr(self, "slice_fn", None)  # unset on a loader built by wrap()
                if slice_fn is not None:
                    k = _batch_len(b) // w
                    yield (
                        [slice_fn(b, slice(r * k, (r + 1) * k), process_index=r, num_processes=w) for r in range(w)],
                        -1,
                    )
                elif _cuttable(b, _batch_len(b)) and _cuttable(head, _batch_len(head)):
                    yield _even_step([b], [head], w)  # a short last batch filled to equal slices
                else:
                    yield [recursively_apply(lambda t, r=r: t.tensor_split(w)[r], b) for r in range(w)], -1
            return
        step: list = []
        first: list = []
        for b in self._source(skip_steps):
            step.append(b)
            if len(first) < w:
                first.append(b)
            if len(step) == w:
                yield _even_step(step, first, w)
                step = []
        if step and not self._drop_last:
            yield _even_step(step, first, w)

    def _next(self, steps: Optional[Iterator]) -> Optional[tuple[Any, int]]:
        box = [next(steps, None) if steps is not None else None]
        dist.broadcast_object_list(box, src=0)
        return None if box[0] is None else (box[0][0][self.rank], box[0][1])

    # a generator, not DataLoader's _BaseDataLoaderIter (as Accelerate's DataLoaderDispatcher)
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.world_size == 1:
            yield from super().__iter__()  # one process: the original batches, as a shard
            return
        gs = self.gradient_state
        self.set_epoch(self.epoch)
        gs.active.append(self)
        gs.end_of_dataloader = False
        self.reset()
        try:
            skip = self._take_skip()
            steps = self._steps(skip + (self.skip_batches if self.given else 0)) if self.rank == 0 else None
            self.batches_yielded = skip
            nxt = self._next(steps)
            while nxt is not None:
                (batch, remainder), nxt = nxt, self._next(steps)
                self.batches_yielded += 1
                self.end_of_dataloader = gs.end_of_dataloader = nxt is None
                self.remainder = gs.remainder = remainder if nxt is None else -1
                yield send_to_device(batch, self.device, self.non_blocking) if self.device is not None else batch
            self._end_epoch()
        finally:
            if self in gs.active:
                gs.active.remove(self)
            gs.end_of_dataloader = False if not gs.active else gs.end_of_dataloader
