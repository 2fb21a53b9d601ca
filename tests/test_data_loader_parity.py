"""lowprec's ``BatchSamplerShard`` and the prepared loaders' batches, ``total_batch_size`` /
``total_dataset_length`` / ``batch_sampler`` against Accelerate's own (the installed
``accelerate``) for the same inputs: one process, and each rank of a job given explicitly on this
one process, with no process group."""

from __future__ import annotations

import functools
import itertools
import traceback

import accelerate.data_loader as acc
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader

import lowprec.utils.dataclasses as lp_dataclasses
from lowprec import Accelerator
from lowprec.utils import DataLoaderConfiguration
from lowprec.utils.data_loader import BatchSamplerShard, DataLoaderDispatcher, DataLoaderShard, GradientState


def _seen(loader, epochs=1):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


def _prepared(loader, num_processes, process_index, split_batches=False, even_batches=True):
    """What Accelerator.prepare builds on process ``process_index`` of ``num_processes``."""
    return DataLoaderShard.wrap(
        loader,
        rank=process_index,
        world_size=num_processes,
        device=None,
        seed=0,
        gradient_state=GradientState(),
        split_batches=split_batches,
        even_batches=even_batches,
    )


def _facts(loader, world):
    bs = loader.batch_sampler
    shard = (bs.batch_size, bs.drop_last, bs.even_batches, bs.num_processes, bs.process_index) if world > 1 else None
    return _seen(loader), len(loader), loader.total_batch_size, loader.total_dataset_length, shard


def test_prepared_loaders_deal_accelerates_batches_on_every_rank():
    """Batches, len(), total_batch_size, total_dataset_length and the batch sampler's
    batch_size / drop_last / even_batches / num_processes / process_index against Accelerate's
    prepare_data_loader, for dataset lengths that do and do not fill the last batch and the last
    step, drop_last, split_batches and even_batches on and off."""
    checked = 0
    grid = itertools.product((1, 5, 8, 13), (1, 2, 3, 4), (False, True), (False, True), (False, True), (1, 2, 3))
    for n, batch_size, drop_last, split, even, world in grid:
        if split and batch_size % world:
            continue  # refused by both
        make = functools.partial(DataLoader, list(range(n)), batch_size=batch_size, drop_last=drop_last)
        for rank in range(world):
            kw = {"split_batches": split, "even_batches": even}
            a = _facts(acc.prepare_data_loader(make(), num_processes=world, process_index=rank, **kw), world)
            mine = _facts(_prepared(make(), world, rank, **kw), world)
            assert mine == a, (n, batch_size, drop_last, split, even, world, rank)
            checked += 1
    assert checked > 500


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

    loader = _prepared(make(), 2, 1)
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
    assert _prepared(DataLoader(range(10), batch_size=None), 1, 0).total_batch_size is None


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


def test_use_stateful_dataloader_without_torchdata_is_one_error_naming_the_fix(monkeypatch):
    """torchdata missing: one ImportError naming the call and ``pip install torchdata``, raised by
    lowprec's check right under the call, not by torchdata's import deep inside."""
    monkeypatch.setattr(lp_dataclasses, "is_torchdata_stateful_dataloader_available", lambda: False)
    calls = {
        "use_stateful_dataloader=True": [
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
    assert [b.tolist() for b in DataLoaderShard(range(4), batch_size=2, use_stateful_dataloader=True)] == [
        [0, 1],
        [2, 3],
    ]
