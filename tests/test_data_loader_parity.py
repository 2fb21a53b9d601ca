"""lowprec's ``prepare_data_loader``, ``BatchSamplerShard`` and the prepared loaders'
``total_batch_size`` / ``total_dataset_length`` / ``batch_sampler`` against Accelerate's own
(the installed ``accelerate``) for the same inputs: one process, and each rank of a job given
explicitly (``num_processes``, ``process_index``) on this one process, with no process group."""

from __future__ import annotations

import functools
import itertools
import traceback

import accelerate.data_loader as acc
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

import lowprec.utils.dataclasses as lp_dataclasses
from lowprec import Accelerator
from lowprec.utils import DataLoaderConfiguration
from lowprec.utils.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    GradientState,
    prepare_data_loader,
)


def _seen(loader, epochs=1):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


def _facts(loader, world):
    bs = loader.batch_sampler
    shard = (bs.batch_size, bs.drop_last, bs.even_batches, bs.num_processes, bs.process_index) if world > 1 else None
    return _seen(loader), len(loader), loader.total_batch_size, loader.total_dataset_length, shard


def _both(make, world, rank, **kwargs):
    """(Accelerate's, lowprec's) facts for one rank, or "ValueError" where the arguments are refused."""
    out = []
    for prepare in (acc.prepare_data_loader, prepare_data_loader):
        try:
            out.append(_facts(prepare(make(), num_processes=world, process_index=rank, **kwargs), world))
        except ValueError:
            out.append("ValueError")
    return out


def test_prepare_data_loader_yields_accelerates_batches_on_every_rank():
    """Batches, len(), total_batch_size, total_dataset_length and the batch sampler's
    batch_size / drop_last / even_batches / num_processes / process_index, for dataset lengths
    that do and do not fill the last batch and the last step, drop_last, split_batches (refused by
    both where the batch size does not divide) and even_batches on and off."""
    checked = 0
    grid = itertools.product((1, 5, 8, 13), (1, 2, 3, 4), (False, True), (False, True), (False, True), (1, 2, 3))
    for n, batch_size, drop_last, split, even, world in grid:
        make = functools.partial(DataLoader, list(range(n)), batch_size=batch_size, drop_last=drop_last)
        for rank in range(world):
            a, mine = _both(make, world, rank, split_batches=split, even_batches=even)
            assert mine == a, (n, batch_size, drop_last, split, even, world, rank)
            checked += a != "ValueError"
    assert checked > 500


@pytest.mark.parametrize("world", [1, 2])
def test_shuffled_orders_are_accelerates(world):
    """Two epochs of a shuffled loader: with the DataLoader's own generator, with a batch sampler
    over a RandomSampler with a generator, and with use_seedable_sampler + data_seed (with and
    without a generator: the seed wins, as in Accelerate). Each rank builds its loader from a
    fresh generator, as each process of a job holds its own."""
    data = list(range(11))
    makers = {
        "generator": lambda: DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)),
        "batch sampler": lambda: DataLoader(
            data, batch_sampler=BatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(5)), 3, False)
        ),
    }
    seedable = {"use_seedable_sampler": True, "data_seed": 17}
    cases = [(name, make, {}) for name, make in makers.items()]
    cases += [("seedable", lambda: DataLoader(data, batch_size=3, shuffle=True), seedable)]
    cases += [("seedable over a generator", makers["generator"], seedable)]
    for name, make, kwargs in cases:
        for rank in range(world):
            a = _seen(acc.prepare_data_loader(make(), num_processes=world, process_index=rank, **kwargs), 2)
            mine = _seen(prepare_data_loader(make(), num_processes=world, process_index=rank, **kwargs), 2)
            assert mine == a, (name, rank)
            assert a[0] != a[1], name  # a new order each epoch


def test_batch_sampler_shard_is_accelerates():
    """Built directly, as Accelerate's tests build it: plain batch samplers, lists of batches of
    varying sizes (dealt whole, the missing ones being the first batches), a batch sampler that
    says drop_last, len() and total_length; split_batches refused where Accelerate refuses it."""

    class DropLast(list):
        drop_last = True

    samplers = [BatchSampler(range(n), bs, d) for n in (0, 2, 7, 20, 22) for bs in (3, 4) for d in (False, True)]
    samplers += [[[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]], [[0, 1, 2]]]
    samplers += [DropLast([[0], [1, 2], [3, 4, 5], [6], [7, 8]])]
    for sampler in samplers:
        for world in (1, 2, 3):
            for split in (False, True):
                for even in (False, True):
                    for rank in range(world):
                        args = (sampler, world, rank, split, even)
                        try:
                            a = acc.BatchSamplerShard(*args)
                        except ValueError:
                            with pytest.raises(ValueError, match="round multiple"):
                                BatchSamplerShard(*args)
                            continue
                        mine = BatchSamplerShard(*args)
                        assert (list(mine), len(mine), mine.total_length) == (list(a), len(a), a.total_length), args
                        assert (mine.batch_size, mine.drop_last) == (a.batch_size, a.drop_last)


def test_even_batches_set_on_the_batch_sampler_takes_effect():
    """A prepared loader's batch_sampler is its BatchSamplerShard: Accelerate's scripts read
    even_batches / batch_size / drop_last there and join_uneven_inputs sets even_batches there."""

    def make():
        return DataLoader(list(range(5)), batch_size=2)

    loader = prepare_data_loader(make(), num_processes=2, process_index=1)
    assert isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.even_batches
    loader.batch_sampler.even_batches = False
    assert loader.even_batches is False and loader.batch_sampler.even_batches is False
    uneven = acc.prepare_data_loader(make(), num_processes=2, process_index=1, even_batches=False)
    assert _seen(loader) == _seen(uneven) == [[[2, 3]]] and len(loader) == len(uneven) == 1
    loader.even_batches = True  # the loader's own attribute is the same setting
    even = acc.prepare_data_loader(make(), num_processes=2, process_index=1)
    assert loader.batch_sampler.even_batches and _seen(loader) == _seen(even) == [[[2, 3], [1, 2]]]
    # transformers' Trainer makes the shard a passthrough for a rank-aware batch sampler this way
    loader.batch_sampler.num_processes, loader.batch_sampler.process_index = 1, 0
    assert _seen(loader) == [[[0, 1], [2, 3], [4]]]
    # prepared by the Accelerator (one process here): the configuration's values, the sampler's
    cfg = DataLoaderConfiguration(even_batches=False)
    prepared = Accelerator(cpu=True, dataloader_config=cfg).prepare(DataLoader(range(6), batch_size=3, drop_last=True))
    bs = prepared.batch_sampler
    assert (bs.even_batches, bs.batch_size, bs.drop_last) == (False, 3, True)
    assert bs.batch_sampler is prepared.base.batch_sampler  # the user's, as Accelerate's shard holds it


def test_total_batch_size_and_dataset_length_of_prepared_and_dispatched_loaders():
    """The dispatcher counts as Accelerate's sharded loader does for the same arguments
    (Accelerate 1.15's own dispatcher reads ``dataset.batch_size`` and raises); the public
    constructors, the Accelerator's split_batches, a dataset's total_length, no batch size."""

    class Sharded(list):
        total_length = 40

    for world, split in ((1, False), (2, False), (2, True)):
        reference = acc.prepare_data_loader(
            DataLoader(Sharded(range(10)), batch_size=4), num_processes=world, process_index=0, split_batches=split
        )
        dispatched = DataLoaderDispatcher.wrap(
            DataLoader(Sharded(range(10)), batch_size=4),
            rank=0,
            world_size=world,
            device=None,
            seed=0,
            gradient_state=GradientState(),
            split_batches=split,
        )
        assert dispatched.total_batch_size == reference.total_batch_size
        assert reference.total_dataset_length == 40 and dispatched.total_dataset_length == 10  # as Accelerate's
    shard = acc.DataLoaderShard(list(range(10)), batch_size=4)
    assert DataLoaderShard(list(range(10)), batch_size=4).total_batch_size == shard.total_batch_size == 4
    assert DataLoaderDispatcher(list(range(10)), batch_size=4).total_dataset_length == 10
    cfg = DataLoaderConfiguration(split_batches=True)
    prepared = Accelerator(cpu=True, dataloader_config=cfg).prepare(DataLoader(range(10), batch_size=4))
    assert (prepared.total_batch_size, prepared.total_dataset_length) == (4, 10)
    assert prepare_data_loader(DataLoader(range(10), batch_size=None)).total_batch_size is None


def test_dispatch_batches_without_a_process_group_is_refused_with_the_fix():
    """dispatch_batches needs put_on_device (Accelerate's rule) and, on several processes, the
    job's process group (process 0 broadcasts every batch); on one process it runs as
    Accelerate's. An IterableDataset over several processes is dispatched, not split."""
    make = lambda: DataLoader(list(range(10)), batch_size=4)  # noqa: E731
    for prepare in (acc.prepare_data_loader, prepare_data_loader):
        with pytest.raises(ValueError, match="put_on_device"):
            prepare(make(), dispatch_batches=True)
    with pytest.raises(ValueError, match=r"dispatch_batches=True, num_processes=2.*dispatch_batches=False"):
        prepare_data_loader(make(), num_processes=2, process_index=0, dispatch_batches=True, put_on_device=True)
    kw = {"num_processes": 1, "process_index": 0, "dispatch_batches": True, "put_on_device": True}
    mine = prepare_data_loader(make(), **kw)
    assert isinstance(mine, DataLoaderDispatcher)
    assert _seen(mine) == _seen(acc.prepare_data_loader(make(), **kw)) == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="dispatch_batches=True, put_on_device=True"):
        prepare_data_loader(DataLoader(Stream(), batch_size=2), num_processes=2, process_index=0)


def test_dispatched_drop_last_drops_the_last_short_step(monkeypatch):
    """Process 0 of two, dispatched: the DataLoader's drop_last drops the step that lacks a batch
    for every process, as Accelerate's dispatcher (it filled it); the batches process 0 keeps are
    Accelerate's sharded ones for the same arguments."""
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda box, src=0: box)
    make = lambda: DataLoader(list(range(10)), batch_size=2, drop_last=True)  # noqa: E731
    dispatched = DataLoaderDispatcher.wrap(
        make(), rank=0, world_size=2, device=None, seed=0, gradient_state=GradientState()
    )
    reference = acc.prepare_data_loader(make(), num_processes=2, process_index=0)
    assert _seen(dispatched) == _seen(reference) == [[[0, 1], [4, 5]]] and len(dispatched) == len(reference)


def test_torch_device_mesh_gives_tensor_parallel_ranks_the_same_batches():
    """Accelerate's reading of a device mesh: ranks differing only along tp share batches."""

    class Dim:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    class Mesh:
        mesh_dim_names = ("dp_shard", "tp")

        def __getitem__(self, name):
            return Dim(2)

    for rank in range(4):
        make = lambda: DataLoader(list(range(10)), batch_size=2)  # noqa: E731
        kw = {"num_processes": 4, "process_index": rank, "torch_device_mesh": Mesh()}
        assert _seen(prepare_data_loader(make(), **kw)) == _seen(acc.prepare_data_loader(make(), **kw))
    with pytest.raises(ValueError, match="dispatch_batches=False"):
        prepare_data_loader(make(), dispatch_batches=True, put_on_device=True, torch_device_mesh=Mesh())


def test_use_stateful_dataloader_without_torchdata_is_one_error_naming_the_fix(monkeypatch):
    """torchdata missing: one ImportError naming the call and ``pip install torchdata``, raised by
    lowprec's check right under the call, not by torchdata's import deep inside."""
    monkeypatch.setattr(lp_dataclasses, "is_torchdata_stateful_dataloader_available", lambda: False)
    calls = {
        "use_stateful_dataloader=True": [
            lambda: prepare_data_loader(DataLoader(range(4)), use_stateful_dataloader=True),
            lambda: DataLoaderShard(range(4), use_stateful_dataloader=True),
            lambda: DataLoaderDispatcher(range(4), use_stateful_dataloader=True),
        ],
        r"DataLoaderConfiguration\(use_stateful_dataloader=True\)": [
            lambda: DataLoaderConfiguration(use_stateful_dataloader=True)
        ],
    }
    for named, makers in calls.items():
        for build in makers:
            with pytest.raises(ImportError, match=named + r" needs torchdata.*pip install torchdata") as info:
                build()
            frames = traceback.extract_tb(info.tb)
            assert frames[-1].name == "require_torchdata" and len(frames) <= 5, frames
    monkeypatch.setattr(lp_dataclasses, "is_torchdata_stateful_dataloader_available", lambda: True)
    assert _seen(prepare_data_loader(DataLoader(range(4), batch_size=2), use_stateful_dataloader=True)) == [
        [[0, 1], [2, 3]]
    ]


def test_the_prepared_loader_is_the_one_accelerates_import_path_names():
    """``from accelerate.data_loader import ...`` -> ``from lowprec.utils.data_loader import ...``."""
    import lowprec.utils.data_loader as lp

    missing = [name for name in lp.__all__ if not hasattr(acc, name)]
    assert missing == [] and {"prepare_data_loader", "BatchSamplerShard"} <= set(lp.__all__)
    assert isinstance(prepare_data_loader(DataLoader(range(4), sampler=SequentialSampler(range(4)))), DataLoaderShard)
