"""Accelerate's public dataloader constructors and helpers on lowprec: ``DataLoaderShard`` and
``DataLoaderDispatcher`` built from a dataset and DataLoader keyword arguments, ``set_epoch``
reaching a custom batch sampler, ``recursively_apply``'s arguments and nested-tensor padding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lowprec import Accelerator
from lowprec.utils import CannotPadNestedTensorWarning, pad_across_processes, skip_first_batches
from lowprec.utils.data_loader import DataLoaderShard, DataLoaderStateMixin
from lowprec.utils.dispatcher import DataLoaderDispatcher
from lowprec.utils.operations import recursively_apply


class EpochBatchSampler(BatchSampler):
    """Batches in an order that depends on the epoch it was told (reverses on odd epochs)."""

    def __init__(self, n: int, batch_size: int) -> None:
        super().__init__(SequentialSampler(range(n)), batch_size, drop_last=False)
        self.epoch = 0

    def __iter__(self):
        batches = list(super().__iter__())
        return iter(batches[::-1] if self.epoch % 2 else batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.mark.parametrize("cls", [DataLoaderShard, DataLoaderDispatcher])
def test_public_constructor_iterates_the_loader_it_builds(cls):
    dl = cls(list(range(10)), batch_size=4)
    assert isinstance(dl, DataLoader) and isinstance(dl, DataLoaderStateMixin)
    assert isinstance(dl.base_dataloader, DataLoader) and dl.batch_size == 4 and len(dl) == 3
    with pytest.raises(AttributeError):
        cls.base_dataloader  # noqa: B018  (only instances have one)
    for _ in range(2):  # the end is found again on the next epoch
        seen = [(b.tolist(), dl.end_of_dataloader) for b in dl]
        assert seen == [([0, 1, 2, 3], False), ([4, 5, 6, 7], False), ([8, 9], True)]
    assert dl.iteration == 2


def test_shard_skip_batches_device_and_resume_position():
    dl = DataLoaderShard(list(range(10)), device=torch.device("cpu"), skip_batches=1, batch_size=4)
    assert len(dl) == 2 and [b.tolist() for b in dl] == [[4, 5, 6, 7], [8, 9]]
    assert [b.tolist() for b in skip_first_batches(dl, 1)] == [[8, 9]]  # once, on top of skip_batches
    assert [b.tolist() for b in dl] == [[4, 5, 6, 7], [8, 9]]


def test_skip_first_batches_of_a_prepared_loader_is_a_new_loader():
    """``skip_first_batches(prepared, 1)`` returned the prepared loader itself with len() 4 of
    range(10) in threes; Accelerate gives a new loader of 3 batches and leaves the prepared one
    whole. The copy skips in its first epoch only; its epoch is the loader's next order."""
    acc = Accelerator(cpu=True)
    p = acc.prepare(DataLoader(range(10), batch_size=3, shuffle=True))
    epoch0 = [b.tolist() for b in p.skipping(0)]  # the order of the loader's epoch 0
    p.set_epoch(0)
    s = acc.skip_first_batches(p, 1)
    assert s is not p and len(s) == 3 and len(p) == 4 and p.epoch == 0
    seen = []
    for b in s:
        seen.append(b.tolist())
        if len(seen) == 1:  # save_state while the copy runs records the copy's position for p
            assert p.state_dict()["batches_yielded"] == 2 and p.state_dict()["epoch"] == 0
    assert seen == epoch0[1:] and p.epoch == 1
    assert [b.tolist() for b in p] != epoch0 and len(p) == 4  # the next epoch's order, whole
    assert len(s) == 4 and len([b for b in s]) == 4  # the copy's later epochs are whole too
    p.load_state_dict({"epoch": 3, "batches_yielded": 2, "seed": p.seed})  # a resumed position
    s = skip_first_batches(p, 2)  # the caller resumes through the copy: p no longer skips
    assert len(s) == 2 and len([b for b in s]) == 2 and len([b for b in p]) == 4 and p.epoch == 5


def test_set_epoch_reaches_a_custom_batch_sampler_through_prepare():
    sampler = EpochBatchSampler(6, 2)
    dl = Accelerator(cpu=True).prepare_data_loader(DataLoader(list(range(6)), batch_sampler=sampler))
    assert sampler.epoch == 0
    dl.set_epoch(1)
    assert sampler.epoch == 1 and dl.iteration == 1
    assert [b.tolist() for b in dl] == [[4, 5], [2, 3], [0, 1]]  # the sampler's odd-epoch order
    assert [b.tolist() for b in dl] == [[0, 1], [2, 3], [4, 5]]  # next epoch passed on by iterating


def test_dispatcher_rank0_of_two_drop_last_skip_and_slice_fn(monkeypatch):
    """Process 0's side of a 2-process dispatch (the broadcast is the identity on one process)."""
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src=0: box)
    dl = DataLoaderDispatcher(list(range(10)), batch_size=2, _drop_last=True)
    dl.world_size = 2  # as process 0 of two sees it: 5 batches are 2 full steps, the third dropped
    assert len(dl) == 2 and [b.tolist() for b in dl] == [[0, 1], [4, 5]] and dl.end_of_dataloader
    dl = DataLoaderDispatcher(list(range(10)), batch_size=2, skip_batches=1)
    dl.world_size = 2  # a short last step is cut in equal slices; skip_batches counts steps
    assert len(dl) == 2 and [b.tolist() for b in dl] == [[4, 5], [8]]

    def halves(batch, sl, process_index, num_processes):
        return batch[sl] * 10

    dl = DataLoaderDispatcher(list(range(8)), split_batches=True, slice_fn=halves, batch_size=4)
    dl.world_size = 2
    assert [b.tolist() for b in dl] == [[0, 10], [40, 50]]


@pytest.mark.parametrize("n", [1, 3, 5, 7, 10, 11])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
@pytest.mark.parametrize("world", [2, 3])
def test_dispatched_steps_give_every_process_a_batch_of_one_size(n, batch_size, world):
    """Process 0's plan for every step: one batch per process, all of one size (``gather`` and
    ``gather_for_metrics`` need it), every sample of the epoch once among the real ones, the
    filling (the epoch's first samples) at the end, counted by the last step's remainder. Was:
    a short last batch on one process beside a whole filling batch on another."""
    dl = DataLoaderDispatcher(list(range(n)), batch_size=batch_size)
    dl.world_size = world
    steps = list(dl._steps(0))
    seen = []
    for k, (per_process, real) in enumerate(steps):
        assert len(per_process) == world and len({len(b) for b in per_process}) == 1, steps
        flat = [int(v) for b in per_process for v in b]
        assert real == -1 or k == len(steps) - 1
        seen += flat[:real] if real != -1 else flat
        filling = flat[len(flat) if real == -1 else real :]
        assert filling == [i % min(n, world * batch_size) for i in range(len(filling))]  # the first samples
    assert seen == list(range(n))
    assert len(steps) == len(dl)


@pytest.mark.parametrize("n, batch_size", [(7, 4), (10, 4), (5, 4), (3, 4), (9, 2), (8, 4)])
def test_split_batches_give_equal_slices_and_count_the_filling(n, batch_size):
    """split_batches on 2 processes, sharded and dispatched: every process's slice of a step has
    one size and the real samples of the epoch come once, the filling (the epoch's first samples)
    at the end of the last step, counted by its remainder; the slices are Accelerate 1.15's
    (checked on 2 CPU processes). Was: a short last batch cut unevenly when dispatched (gloo
    aborted in gather), and, sharded, padded with no remainder (gather_for_metrics kept the
    filling) or, for an epoch of one short batch, cut to the first slices (samples lost)."""
    from lowprec.utils.data_loader import DataLoaderShard, GradientState

    slices = {}
    for rank in (0, 1):
        loader = DataLoader(list(range(n)), batch_size=batch_size)
        shard = DataLoaderShard.wrap(
            loader, rank=rank, world_size=2, device=None, seed=0, gradient_state=GradientState(), split_batches=True
        )
        slices[rank], remainder = shard._local_batches()
    sharded = [[a, b] for a, b in zip(slices[0], slices[1])]
    dl = DataLoaderDispatcher(list(range(n)), batch_size=batch_size, split_batches=True)
    dl.world_size = 2
    dispatched = list(dl._steps(0))
    for steps, real in ((sharded, remainder), ([[b.tolist() for b in s] for s, _ in dispatched], dispatched[-1][1])):
        assert all(len(a) == len(b) for a, b in steps), steps
        flat = [i for a, b in steps for i in a + b]
        kept = flat if real == -1 else flat[: len(flat) - sum(map(len, steps[-1])) + real]
        assert kept == list(range(n)), (steps, real)


@pytest.mark.parametrize("own_generator", [False, True], ids=["unseeded", "sampler-generator"])
def test_a_users_batch_sampler_over_a_random_sampler_shuffles_alike_on_every_process(own_generator):
    """DataLoader(batch_sampler=BatchSampler(RandomSampler(ds), ...)) on 2 processes: each process
    drew its own permutation, so within an epoch some samples came twice and others never
    (Accelerate's own test_distributed_data_loop.py caught it). Now one permutation per epoch,
    dealt out: every sample once, shuffled, and a new order the next epoch."""
    from torch.utils.data import RandomSampler

    from lowprec.utils.data_loader import GradientState

    epochs: list[list[int]] = [[], []]
    for rank in (0, 1):
        torch.manual_seed(100 + rank)  # each process's global RNG differs
        gen = torch.Generator().manual_seed(7) if own_generator else None
        data = list(range(24))
        loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data, generator=gen), 4, False))
        shard = DataLoaderShard.wrap(
            loader, rank=rank, world_size=2, device=None, seed=0, gradient_state=GradientState()
        )
        for seen in epochs:  # two epochs, the loader's own epoch counting
            seen += [int(i) for b in shard for i in b]
    first, second = epochs
    assert sorted(first) == list(range(24)) and first != sorted(first)
    assert sorted(second) == list(range(24)) and second != first


def test_a_batch_sampler_given_as_the_sampler_is_sharded_and_read_a_list_at_a_time():
    """DataLoader(ds, sampler=BatchSampler(...), batch_size=None): the dataset reads each list of
    indices at once (as a datasets.Dataset does); on 2 processes the lists are dealt out (it was
    refused as an unbatched loader)."""
    from lowprec.utils.data_loader import GradientState

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, index):  # a list of indices: one read
            return torch.tensor(index) * 10

    seen = {}
    for rank in (0, 1):
        loader = DataLoader(Rows(), sampler=BatchSampler(SequentialSampler(range(10)), 3, False), batch_size=None)
        shard = DataLoaderShard.wrap(
            loader, rank=rank, world_size=2, device=None, seed=0, gradient_state=GradientState()
        )
        seen[rank] = [b.tolist() for b in shard]
    assert seen[0] == [[0, 10, 20], [60, 70, 80]] and seen[1] == [[30, 40, 50], [90, 0, 10]]


def test_dispatched_batches_that_cannot_be_cut_are_filled_whole():
    # strings have no batch dimension to cut: the last step takes whole first batches
    data = [f"s{i}" for i in range(5)]
    dl = DataLoaderDispatcher(data, batch_size=2)
    dl.world_size = 2
    assert list(dl._steps(0)) == [([["s0", "s1"], ["s2", "s3"]], -1), ([["s4"], ["s0", "s1"]], 1)]


def test_constructor_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="split_batches=True"):
        DataLoaderDispatcher(list(range(4)), slice_fn=lambda *a, **k: a[0])
    with pytest.raises(ValueError, match="parallelism_config"):
        DataLoaderShard(list(range(4)), torch_device_mesh=object())


def test_recursively_apply_arguments_and_other_types():
    out = recursively_apply(torch.add, {"a": (torch.ones(1), "x")}, 2, alpha=3)
    assert out["a"][0].item() == 7 and out["a"][1] == "x"
    assert recursively_apply(len, ["ab", [1, 2, 3]], test_type=lambda x: isinstance(x, str)) == [2, [1, 2, 3]]
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'int'>\) passed to `as_tensor`"):
        recursively_apply(torch.as_tensor, (torch.tensor(1), 1), error_on_other_type=True)


def test_pad_across_processes_returns_a_nested_tensor_unpadded_with_a_warning():
    nt = torch.nested.nested_tensor([torch.ones(3), torch.ones(1)])
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes(nt) is nt
    t = torch.ones(2, 3)
    assert pad_across_processes(t, dim=-3) is t


def test_prepared_stream_marks_its_last_batch():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    accelerator = Accelerator(cpu=True)
    dl = accelerator.prepare(DataLoader(Stream(), batch_size=2))
    seen = [(b.tolist(), accelerator.gradient_state.end_of_dataloader, dl.end_of_dataloader) for b in dl]
    assert seen == [([0, 1], False, False), ([2, 3], False, False), ([4], True, True)]
