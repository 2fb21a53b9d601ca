"""A prepared DataLoader: shards batches across processes, moves them to the device, knows its
position (for ``save_state``/``load_state``) and the last batch (for gradient accumulation and
``gather_for_metrics``).

Sharding follows Accelerate's ``BatchSamplerShard`` (:mod:`lowprec.utils.batch_shard`, also the
prepared loader's ``batch_sampler``): the original batch sampler's batches are dealt round-robin,
process ``r`` gets batches ``r, r + W, r + 2W, ...``. With several processes the last step is
completed from the start of the epoch (``even_batches``) so every process runs the same number of
steps, the padding dropped again by ``gather_for_metrics``, or, under the batch sampler's
``drop_last``, dropped. One process gets the original batches unchanged.

Shuffling (a ``RandomSampler``): with the user's ``DataLoader(generator=g)``, the order is the one
PyTorch and Accelerate give: ``g`` as it stands when the epoch starts (process 0's state on every
process, as Accelerate's ``rng_types=["generator"]``), advanced as PyTorch's DataLoader advances
it; its state at the start of the epoch is saved, so a resumed run replays the same order.
Without a generator, Accelerate draws a fresh seed from the global RNG each epoch; lowprec uses
``seed + epoch`` instead (the same on every process, and after a resume, without touching the
global RNG that dropout reads), and says so once in the log.

Accelerate's public constructor, ``DataLoaderShard(dataset, device=None, ..., **dataloader_kwargs)``,
builds a DataLoader and iterates it as given (its batch sampler does any sharding, as in Accelerate).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Optional, Sized, cast

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lowprec.logs import log_once
from lowprec.utils.aliases import alias
from lowprec.utils.batch_shard import BatchSamplerShard
from lowprec.utils.operations import send_to_device
from lowprec.utils.random import synchronize_rng_states
from lowprec.state.gradient import GradientState
from lowprec.utils.dataclasses import require_torchdata

__all__ = ["GradientState", "DataLoaderStateMixin", "DataLoaderShard", "SkipDataLoader", "skip_first_batches"]


def _batches_of(loader: DataLoader) -> Optional[Iterable[list[int]]]:
    """What yields ``loader``'s batches of indices: its batch sampler, or a ``BatchSampler`` given
    as its ``sampler`` with ``batch_size=None`` (the dataset then fetches each list at once, as a
    ``datasets.Dataset`` does); None for an unbatched loader."""
    if loader.batch_sampler is not None:
        return loader.batch_sampler
    return loader.sampler if isinstance(loader.sampler, BatchSampler) else None


def _random_sampler(loader: DataLoader) -> Optional[RandomSampler]:
    """The ``RandomSampler`` that shuffles ``loader``: its sampler, or the sampler of a batch sampler
    the user passed (``DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), ...))``), whose
    draws must be the same on every process too (each drew its own permutation: samples repeated
    across processes and others never seen, within an epoch); None when nothing shuffles."""
    batches = _batches_of(loader)
    for sampler in (loader.sampler, getattr(batches, "sampler", None)):
        if isinstance(sampler, RandomSampler):
            return sampler
    return None


class SkipDataLoader(DataLoader):
    """A plain DataLoader whose iterations start ``skip_batches`` batches in (what
    ``skip_first_batches`` returns for a dataloader that was not prepared)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches

    # a generator, not DataLoader's _BaseDataLoaderIter (as Accelerate's subclasses)
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for i, batch in enumerate(super().__iter__()):
            if i >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)

    @property
    def base_dataloader(self) -> DataLoader:
        """Itself: a DataLoader subclass, not a wrapper (Accelerate's attribute name)."""
        return self


class DataLoaderStateMixin:
    """Where the current iteration of one dataloader is (Accelerate's mixin, for ``isinstance``):
    ``end_of_dataloader`` is True while its last batch is out, ``remainder`` the real samples of a
    padded last global batch (-1: nothing padded). ``GradientState`` holds the same for the
    innermost active loader."""

    end_of_dataloader: bool = False
    remainder: int = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1


def _check_constructor(use_stateful_dataloader: bool, torch_device_mesh: Any) -> None:
    """Accelerate constructor arguments lowprec's loaders do not take another way."""
    if torch_device_mesh is not None:
        raise ValueError(
            "torch_device_mesh: lowprec's dataloaders take the data-parallel shard from the Accelerator "
            "(Accelerator(parallelism_config=ParallelismConfig(...)).prepare(dataloader)); build them without it"
        )
    if use_stateful_dataloader:
        require_torchdata("use_stateful_dataloader=True")  # the same check and log line as prepare()


class DataLoaderShard(DataLoader, DataLoaderStateMixin):
    """A ``DataLoader`` (for ``isinstance`` checks) that iterates this process's share of the
    wrapped one; other DataLoader attributes are the wrapped loader's. With ``split_batches``
    each batch is cut into ``world_size`` equal slices instead of dealt whole; with
    ``even_batches=False`` nothing is padded (processes may run a different number of steps).

    Two ways to build one: ``prepare()`` wraps a user's DataLoader (:meth:`wrap`: lowprec shards,
    shuffles and pads it); Accelerate's public constructor, ``DataLoaderShard(dataset, device=None,
    ..., **dataloader_kwargs)``, builds a DataLoader from ``dataset`` and the keyword arguments and
    iterates it as given (any sharding is its batch sampler's, as in Accelerate), adding device
    placement, ``skip_batches``, ``set_epoch`` and the end-of-dataloader state."""

    dispatches = False  # DataLoaderDispatcher (utils/dispatcher.py): process 0 reads, the others receive
    _skipped_from: Optional["DataLoaderShard"] = None  # set on what skip_first_batches returns
    _len_skip = 0  # batches len() leaves out: those a skip_first_batches copy skips this epoch

    def __init__(
        self,
        dataset: Any,
        device: Optional[torch.device] = None,
        rng_types: Optional[list] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        _check_constructor(use_stateful_dataloader, torch_device_mesh)
        self._setup(
            DataLoader(dataset, **kwargs),
            rank=0,
            world_size=1,
            device=device,
            seed=None,
            gradient_state=GradientState(),
            non_blocking=_non_blocking,
        )
        self.skip_batches = skip_batches
        self.rng_types, self.synchronized_generator = rng_types, synchronized_generator
        self.epoch = iteration

    @classmethod
    def wrap(
        cls,
        dataloader: DataLoader,
        *,
        rank: int,
        world_size: int,
        device: Optional[torch.device],
        seed: int,
        gradient_state: GradientState,
        split_batches: bool = False,
        even_batches: bool = True,
        non_blocking: bool = False,
        seedable: bool = False,
    ) -> "DataLoaderShard":
        """What ``prepare()`` builds: ``dataloader`` sharded over ``world_size`` processes, shuffled
        with ``seed + epoch`` on every process (``seedable``: also where the sampler has a
        generator of its own, as Accelerate's ``use_seedable_sampler``)."""
        self = cls.__new__(cls)
        self._setup(
            dataloader,
            rank=rank,
            world_size=world_size,
            device=device,
            seed=seed,
            gradient_state=gradient_state,
            split_batches=split_batches,
            even_batches=even_batches,
            non_blocking=non_blocking,
            seedable=seedable,
        )
        return self

    def _setup(
        self,
        dataloader: DataLoader,
        *,
        rank: int,
        world_size: int,
        device: Optional[torch.device],
        seed: Optional[int],
        gradient_state: GradientState,
        split_batches: bool = False,
        even_batches: bool = True,
        non_blocking: bool = False,
        seedable: bool = False,
    ) -> None:
        # DataLoader.__init__ is not called: this object builds a fresh DataLoader per epoch
        self.skip_batches = 0
        if isinstance(dataloader, SkipDataLoader):
            self.skip_batches = dataloader.skip_batches
        self.base = dataloader
        # who gets which batches (rank, world_size, split_batches, even_batches read and write it)
        self._shard = BatchSamplerShard.bound(_batches_of(dataloader), world_size, rank, split_batches, even_batches)
        self.device = device
        self.seed = seed  # None: built by the public constructor, iterated as given
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.rng_types, self.synchronized_generator = None, None
        sampler = _random_sampler(dataloader)
        shuffled = sampler is not None and seed is not None
        own = cast(RandomSampler, sampler).generator if shuffled and not seedable else None
        self.user_generator: Optional[torch.Generator] = own
        self._generator_state: Optional[torch.Tensor] = None  # user_generator at this epoch's start
        if shuffled and self.user_generator is None and not seedable:
            log_once(
                "lowprec: a prepared DataLoader without generator= shuffles with seed + epoch (the same order on "
                "every process and after a resume), not with a seed drawn from the global RNG as Accelerate; "
                "pass DataLoader(generator=torch.Generator().manual_seed(...)) for PyTorch's and Accelerate's order"
            )
        self._drop_last = bool(getattr(dataloader, "drop_last", False))  # a dispatcher's last short step
        self.epoch = 0
        self.batches_yielded = 0
        self._skip = 0
        if (
            split_batches
            and world_size > 1
            and dataloader.batch_size is not None
            and dataloader.batch_size % world_size
        ):
            raise ValueError(
                f"split_batches=True splits each batch across {world_size} processes, but batch_size="
                f"{dataloader.batch_size} does not divide by {world_size}; use a multiple of {world_size}"
            )
        # an IterableDataset, or batch_size=None (no batching), is passed through unsharded
        self.iterable = isinstance(dataloader.dataset, IterableDataset) or _batches_of(dataloader) is None
        if self.iterable and world_size > 1 and not self.dispatches:
            raise ValueError(
                "prepare() can shard only a DataLoader with a batch size over a map-style dataset; "
                "shard an IterableDataset inside the dataset (e.g. by torch.distributed.get_rank()) "
                "and pass that DataLoader per process, or let process 0 read it and dispatch: "
                "DataLoaderConfiguration(dispatch_batches=True) (prepare_data_loader: dispatch_batches=True, "
                "put_on_device=True)"
            )

    @property
    def given(self) -> bool:
        """Built by the public constructor: its DataLoader is iterated as given, not resharded."""
        return self.seed is None

    iteration = alias("epoch", "Accelerate's name for the epoch counter.")
    rank = alias("_shard.process_index", "This process's place among the ``world_size`` the data is dealt to.")
    world_size = alias("_shard.num_processes", "The processes the data is dealt to.")
    split_batches = alias("_shard.split_batches", "Each batch cut into ``world_size`` slices.")
    even_batches = alias("_shard.even_batches", "Complete the last step from the start (join_uneven_inputs sets it).")

    @property
    def _deals(self) -> bool:
        """Whether this loader deals out its batch sampler's batches itself (``prepare()``'s, over a
        map-style dataset, not dispatched): its ``BatchSamplerShard`` then stands for the sampler."""
        return not (self.given or self.iterable or self.dispatches)

    @property
    def batch_sampler(self) -> Any:  # type: ignore[override]  # DataLoader's attribute; read-only, it follows the loader
        """Accelerate's ``BatchSamplerShard`` where this loader deals out the batches (``batch_size``,
        ``drop_last``, ``num_processes``, ``process_index``, ``split_batches``, and ``even_batches``,
        which takes effect at the next iteration), else the wrapped loader's batch sampler."""
        base = self.base
        return self._shard if self._deals and base.batch_sampler is not None else base.batch_sampler

    @property
    def sampler(self) -> Any:  # type: ignore[override]  # DataLoader's attribute; read-only, it follows the loader
        """The wrapped loader's sampler; its ``BatchSamplerShard`` where that sampler is a batch
        sampler this loader deals out (``DataLoader(ds, sampler=BatchSampler(...), batch_size=None)``)."""
        base = self.base
        return self._shard if self._deals and base.batch_sampler is None else base.sampler

    @property
    def total_batch_size(self) -> Optional[int]:
        """Samples in one step over all processes, as Accelerate counts them: the batch size, times
        the number of processes unless ``split_batches``; None where batches have no set size
        (``batch_size=None``, a batch sampler without ``batch_size``)."""
        batches = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        size = getattr(batches, "batch_size", None)
        if size is None or getattr(batches, "split_batches", False):
            return size
        return size * getattr(batches, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        """Samples in the dataset over all processes (a sharded dataset's ``total_length``)."""
        dataset = self.dataset
        return dataset.total_length if hasattr(dataset, "total_length") else len(dataset)

    # ------------------------------------------------------------------ batches of this process
    def _epoch_seed(self) -> int:
        """``seed + epoch``; only on the resharding path, where ``seed`` is set (not :attr:`given`)."""
        return cast(int, self.seed) + self.epoch

    def _batch_sampler(self) -> Iterable[list[int]]:
        """The base loader's batch sampler; set whenever batches are resharded (not :attr:`iterable`)."""
        return cast("Iterable[list[int]]", _batches_of(self.base))

    def _epoch_loader(self, batches: list[list[int]]) -> DataLoader:
        """A DataLoader over ``batches`` (lists of indices) as the base loader fetches them: through
        its collate_fn, or, for a ``BatchSampler`` given as the sampler, one dataset read per list.
        Its own generator: starting an epoch must not draw from the global RNG, or a run resumed
        mid-epoch would see a shifted dropout/noise stream."""
        base = self.base
        how: dict[str, Any] = (
            {"batch_sampler": batches} if base.batch_sampler is not None else {"sampler": batches, "batch_size": None}
        )
        return DataLoader(
            base.dataset,
            **how,
            collate_fn=base.collate_fn,
            num_workers=base.num_workers,
            pin_memory=base.pin_memory,
            worker_init_fn=base.worker_init_fn,
            generator=torch.Generator().manual_seed(self._epoch_seed()),
        )

    def _global_batches(self) -> list[list[int]]:
        sampler = _random_sampler(self.base)
        if sampler is None:
            return [list(b) for b in self._batch_sampler()][self.skip_batches :]
        if self.user_generator is not None:
            self._replay_user_generator(self.user_generator)
            return [list(b) for b in self._batch_sampler()][self.skip_batches :]
        # every process draws the same permutation for this epoch; the user's sampler is left as it was
        own, sampler.generator = sampler.generator, torch.Generator().manual_seed(self._epoch_seed())
        try:
            return [list(b) for b in self._batch_sampler()][self.skip_batches :]
        finally:
            sampler.generator = own

    def _replay_user_generator(self, g: torch.Generator) -> None:
        """The user's generator ``g`` as at the start of this epoch (recorded the first time, process 0's
        under several processes), then PyTorch's first draw: a DataLoader iterator takes its workers'
        base seed from the generator before the sampler's permutation."""
        if self._generator_state is None:
            state = g.get_state()
            if self.world_size > 1 and not self.dispatches and dist.is_available() and dist.is_initialized():
                box = [state]
                dist.broadcast_object_list(box, src=0)
                state = box[0]
            self._generator_state = state
        g.set_state(self._generator_state)
        if g is self.base.generator:  # the loader's own: its iterator draws first (a sampler's own: not)
            torch.empty((), dtype=torch.int64).random_(generator=g)

    def _local_batches(self) -> tuple[list[list[int]], int]:
        batches = self._global_batches()
        if self.world_size == 1:
            return batches, -1  # one process: exactly the original batches (PyTorch's behaviour)
        return self._shard.plan(batches)

    def __len__(self) -> int:
        return max(0, self._epoch_len() - self._len_skip)

    def _epoch_len(self) -> int:
        """Batches in a whole epoch of this process (``skip_batches`` left out)."""
        if self.given:
            return max(0, len(self.base) - self.skip_batches)
        if self.iterable:
            return len(self.base)
        n = max(0, len(cast(Sized, self._batch_sampler())) - self.skip_batches)
        return n if self.world_size == 1 else self._shard.length(n)

    def __getattr__(self, name: str) -> Any:
        # DataLoader attributes this object does not set (sampler, collate_fn, num_workers, ...)
        # (not a property: on the class itself ``base_dataloader`` is an AttributeError, as in Accelerate)
        base = self.__dict__.get("base")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return base if name == "base_dataloader" else getattr(base, name)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("gradient_state", None)  # process-wide; re-attached on load
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    # a generator, not DataLoader's _BaseDataLoaderIter (as Accelerate's DataLoaderShard)
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        gs = self.gradient_state
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.set_epoch(self.epoch)  # a custom sampler / dataset with set_epoch reshuffles per epoch
        gs.active.append(self)
        gs.end_of_dataloader = False
        self.reset()
        try:
            skip = self._take_skip()
            source: Iterator[Any]
            count: Optional[int]
            if self.iterable or self.given:
                source = itertools.islice(iter(self.base), skip + (self.skip_batches if self.given else 0), None)
                count, remainder = None, -1
            else:
                mine, remainder = self._local_batches()
                source, count = iter(self._epoch_loader(mine[skip:])), len(mine)
            self.batches_yielded = skip
            for batch, last in _with_last(source, count, skip):
                self.batches_yielded += 1
                self.end_of_dataloader = gs.end_of_dataloader = last
                self.remainder = gs.remainder = remainder if last else -1
                yield send_to_device(batch, self.device, self.non_blocking) if self.device is not None else batch
            self._end_epoch()
        finally:
            if self in gs.active:  # a new Accelerator may have reset the loop state meanwhile
                gs.active.remove(self)
            gs.end_of_dataloader = False if not gs.active else gs.end_of_dataloader

    def _take_skip(self) -> int:
        """The batches this iteration skips (a position load_state restored, or skip_first_batches'),
        used once; a skip_first_batches copy's len() leaves them out until this epoch ends."""
        skip, self._skip = self._skip, 0
        self._len_skip = skip if self._skipped_from is not None else 0
        return skip

    def _end_epoch(self) -> None:
        self.epoch += 1
        self.batches_yielded = 0
        self._generator_state = None
        self._len_skip = 0
        origin = self._skipped_from
        if origin is not None and origin.epoch < self.epoch:
            # the copy ran the loader's epoch: the loader goes on with the next one (the next
            # shuffle), not this one's order again
            origin.epoch, origin._generator_state = self.epoch, None

    def skipping(self, num_batches: int) -> "DataLoaderShard":
        """What ``skip_first_batches`` returns: a new loader over the same data, sampler, seed,
        epoch, device placement and gradient state whose first iteration starts ``num_batches``
        in (its ``len()`` the batches left) and whose later ones are whole (Accelerate's copy
        skips every epoch). This loader is left as it is: iterated again, it yields whole epochs,
        the next one once the copy has finished one; a position ``load_state`` restored here passes
        to the copy, which the caller resumes through. While the copy is iterated, ``save_state``
        records its position for this loader."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)  # not copy.copy: __getstate__ drops the gradient state
        twin._skip = twin._len_skip = num_batches
        twin._skipped_from = self
        self._skip = 0
        return twin

    def set_epoch(self, epoch: int) -> None:
        """The epoch, passed on (as Accelerate) to a batch sampler, its sampler, or else the dataset
        that has ``set_epoch`` (a custom or distributed sampler, an HF dataset)."""
        self.epoch = epoch
        batch_sampler = _batches_of(self.base)
        samplers: list[Any] = [
            t
            for t in (
                batch_sampler,
                getattr(batch_sampler, "sampler", None),
                getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None),
            )
            if hasattr(t, "set_epoch")
        ]
        dataset = self.base.dataset
        for t in samplers or ([dataset] if hasattr(dataset, "set_epoch") else []):
            t.set_epoch(epoch)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        live = next((d for d in self.gradient_state.active if d._skipped_from is self), None)
        if live is not None:  # mid-epoch through a skip_first_batches copy: where the copy is
            return live.state_dict()
        state: dict[str, Any] = {"epoch": self.epoch, "batches_yielded": self.batches_yielded, "seed": self.seed}
        generator_state = self._generator_state  # mid-epoch: the user's generator at this epoch's start
        if generator_state is None and getattr(self, "user_generator", None) is not None:
            # between epochs: the state the next epoch starts from (else a resumed run would
            # replay the freshly seeded generator's first epoch)
            generator_state = cast(torch.Generator, self.user_generator).get_state()
        if generator_state is not None:  # a list of bytes: save_state writes this dict as JSON
            state["generator_state"] = generator_state.tolist()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The next iteration resumes where the saved one was (same epoch, same shuffle)."""
        self.epoch = int(state["epoch"])
        self.seed = None if state["seed"] is None else int(state["seed"])
        if hasattr(self, "user_generator"):
            saved = state.get("generator_state")
            self._generator_state = None if saved is None else torch.as_tensor(saved, dtype=torch.uint8)
        self._skip = int(state["batches_yielded"])
        self.batches_yielded = self._skip

    @property
    def dataset(self):
        return self.base.dataset

    @property
    def batch_size(self):
        return self.base.batch_size


def _with_last(source: Iterator[Any], count: Optional[int], start: int) -> Iterator[tuple[Any, bool]]:
    """(batch, is it the last) for each batch; without a known ``count``, by reading one ahead."""
    if count is not None:
        for i, batch in enumerate(source, start + 1):
            yield batch, i == count
        return
    sentinel = object()
    current = next(source, sentinel)
    while current is not sentinel:
        following = next(source, sentinel)
        yield current, following is sentinel
        current = following


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A prepared dataloader: a new one whose first iteration starts ``num_batches`` in (resume
    mid-epoch; :meth:`DataLoaderShard.skipping`), the given one unchanged. A plain DataLoader: a
    ``SkipDataLoader`` over the same data whose every iteration skips them (prepare it as usual)."""
    if isinstance(dataloader, DataLoaderShard):
        return dataloader.skipping(int(num_batches))
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches takes a DataLoader, got {type(dataloader).__name__}")
    if dataloader.batch_sampler is None or isinstance(dataloader.dataset, IterableDataset):
        raise TypeError("skip_first_batches on an unprepared DataLoader needs a map-style dataset with batches")
    return SkipDataLoader(
        dataloader.dataset,
        skip_batches=int(num_batches),
        batch_sampler=dataloader.batch_sampler,
        collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
        worker_init_fn=dataloader.worker_init_fn,
    )
