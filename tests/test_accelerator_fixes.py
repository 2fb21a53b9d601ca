"""Regression tests for reviewer-found Accelerator bugs (one test per bug)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowprec import Accelerator
from lowprec.kwargs import GradientAccumulationPlugin
from lowprec.utils import set_seed

ENV = ["ACCELERATE_MIXED_PRECISION", "ACCELERATE_FP8_BACKEND", "LOWPREC_FP8_RECIPE", "LOWPREC_FP8_FALLBACK",
       "WORLD_SIZE", "RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU",
       "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def loader(n: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    return DataLoader(TensorDataset(x, (x[:, :4]).argmax(1)), batch_size=batch_size)


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def test_sync_each_batch_keeps_the_accumulation_boundary():
    set_seed(0)
    plugin = GradientAccumulationPlugin(num_steps=4, sync_each_batch=True)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    base = mlp()
    inner = CountingSGD(base.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(base, inner, loader(32, 4))
    entered = []
    acc.no_sync = lambda m: entered.append(m) or contextlib.nullcontext()  # sync_each_batch: never used
    syncs = []
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(nn.functional.cross_entropy(model(x), y))
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    assert syncs == [False, False, False, True] * 2
    assert inner.steps == 2
    assert entered == []


def _shard(loader_, rank, world):
    from lowprec.utils.data_loader import DataLoaderShard, GradientState

    return DataLoaderShard(loader_, rank=rank, world_size=world, device=None, seed=0, gradient_state=GradientState())


def test_one_process_keeps_the_short_last_batch():
    ds = TensorDataset(torch.arange(10))
    acc = Accelerator()
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    got = [b[0].tolist() for b in dl]
    assert got == [b[0].tolist() for b in DataLoader(ds, batch_size=4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert acc.gather_for_metrics(torch.tensor([8, 9])).tolist() == [8, 9]


def test_padding_keeps_custom_batch_boundaries_and_remainder():
    ds = TensorDataset(torch.arange(9))
    custom = [[0, 1, 2], [3], [4, 5, 6, 7, 8]]  # uneven custom batch sampler
    loaders = [_shard(DataLoader(ds, batch_sampler=custom), r, 2) for r in range(2)]
    mine = [loaders[r]._local_batches() for r in range(2)]
    assert mine[0] == ([[0, 1, 2], [4, 5, 6, 7, 8]], 5)
    assert mine[1] == ([[3], [0, 1, 2]], 5)  # a whole batch, not a re-chunked index list
    # a plain sampler over 2 processes still fills the short last batch (equal shapes for gather)
    plain = [_shard(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), r, 2)._local_batches() for r in range(2)]
    assert plain == [([[0, 1, 2, 3], [8, 9, 0, 1]], 2), ([[4, 5, 6, 7], [0, 1, 2, 3]], 2)]
