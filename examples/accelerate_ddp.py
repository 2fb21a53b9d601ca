"""FP8 training with DistributedDataParallel through the Accelerate API.

    PYTHONPATH=src torchrun --nproc_per_node 2 examples/accelerate_ddp.py

(CPU: gloo; GPU: nccl.) The recipe comes from ``NativeRecipeKwargs`` (lowprec's engine, by
recipe name); the baseline builds the same DDP run by hand and must produce the same losses.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import SEED, check, loss_fn, make_loader, make_model, rank_and_world, shard_batches  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec import Accelerator  # noqa: E402
from lowprec.utils import NativeRecipeKwargs, set_seed  # noqa: E402

EPOCHS, LR, RECIPE = 6, 1e-2, "tensorwise"


def train_accelerate() -> list[float]:
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[NativeRecipeKwargs(recipe=RECIPE)])
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, make_loader())
    losses = []
    for _ in range(EPOCHS):
        for x, y in dataloader:
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def train_baseline() -> list[float]:
    rank, world = rank_and_world()
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    fp8.convert(model, fp8.Recipe.from_name(RECIPE))  # first and last Linear stay high precision
    ddp = DistributedDataParallel(model)
    losses = []
    batches = shard_batches(make_loader(), rank, world)
    for _ in range(EPOCHS):
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
                logits = ddp(x).float()
            loss = loss_fn(logits, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append((avg / world).item())
    return losses


if __name__ == "__main__":
    accel = train_accelerate()  # initialises the process group from torchrun's variables
    base = train_baseline()
    check("ddp", accel, base, rank_and_world()[0])
    dist.barrier()  # every process done before the group is torn down
    dist.destroy_process_group()
