"""Shared pieces of the accelerate_*.py examples: a tiny model, a fixed data set, the loss
check. Each example trains twice with the same seed: once through ``lowprec.Accelerator``, once
by hand with the raw engine (``lowprec.fp8``), and checks that

* the loss goes down (last-5-step mean below 0.7 x the first-5-step mean), and
* the two loss curves agree within ``TOLERANCE`` (relative, per step). Both runs do the same
  operations in the same order, so on CPU they agree to float rounding; the tolerance leaves
  room for nondeterministic GPU reductions (the way Accelerate's benchmarks/fp8 scripts compare
  a hand-written baseline with the integration).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TOLERANCE = 1e-4
SEED = 1234
STEPS_PER_EPOCH_BATCH = 16


def make_model() -> nn.Module:
    # every dim a multiple of 16, so FP8 GEMMs are eligible; the first and last Linear follow
    # each recipe's own rule
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 16),
    )


def make_dataset(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 16, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def make_loader(batch_size: int = STEPS_PER_EPOCH_BATCH) -> DataLoader:
    return DataLoader(make_dataset(), batch_size=batch_size, shuffle=False)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), target)


def shard_batches(loader: DataLoader, rank: int, world: int) -> list:
    """The hand-written baseline's data split: batch i goes to process i % world."""
    return [b for i, b in enumerate(loader) if i % world == rank]


def check(name: str, accel_losses: list[float], base_losses: list[float], rank: int = 0) -> None:
    first = sum(accel_losses[:5]) / 5
    last = sum(accel_losses[-5:]) / 5
    worst = max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(accel_losses, base_losses))
    ok = last < 0.7 * first and worst <= TOLERANCE and len(accel_losses) == len(base_losses)
    if rank == 0:
        print(
            json.dumps(
                {
                    "example": name,
                    "steps": len(accel_losses),
                    "loss_first5": round(first, 5),
                    "loss_last5": round(last, 5),
                    "max_rel_diff_vs_baseline": worst,
                    "tolerance": TOLERANCE,
                    "ok": ok,
                }
            )
        )
    if not ok:
        sys.exit(1)


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
