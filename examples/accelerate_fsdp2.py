"""FP8 training with FSDP2 (``fully_shard``) through the Accelerate API.

    PYTHONPATH=src torchrun --nproc_per_node 2 examples/accelerate_fsdp2.py

FP8 layers sit inside the bf16 ``MixedPrecisionPolicy`` (parameters all-gathered in bf16,
gradients reduced in fp32), and the FP8 region is entered on this path too (Accelerate's TE +
FSDP2 path never enters it). The baseline shards the model by hand and must match.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import SEED, check, loss_fn, make_loader, make_model, rank_and_world, shard_batches  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec import Accelerator  # noqa: E402
from lowprec.utils import FullyShardedDataParallelPlugin, NativeRecipeKwargs, set_seed  # noqa: E402

EPOCHS, LR, RECIPE = 6, 1e-2, "tensorwise"


def train_accelerate() -> list[float]:
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = Accelerator(
        mixed_precision="fp8",
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        kwargs_handlers=[NativeRecipeKwargs(recipe=RECIPE)],
    )
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
    fp8.convert(model, fp8.Recipe.from_name(RECIPE))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(
        model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # built on the sharded parameters
    losses = []
    batches = shard_batches(make_loader(), rank, world)
    for _ in range(EPOCHS):
        for x, y in batches:
            with fp8.autocast():
                logits = model(x).float()
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
    accel = train_accelerate()
    base = train_baseline()
    check("fsdp2", accel, base, rank_and_world()[0])
    dist.barrier()  # every process done before the group is torn down
    dist.destroy_process_group()
