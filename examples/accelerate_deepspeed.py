"""FP8 training with DeepSpeed ZeRO 1, 2 or 3 through the Accelerate API (optional extra).

    DS_ACCELERATOR=cpu PYTHONPATH=src torchrun --nproc_per_node 2 examples/accelerate_deepspeed.py --zero_stage 2

DeepSpeed trains in bf16 (fp8 sits on bf16); the model is converted to FP8 before DeepSpeed
wraps it and its forward runs in the FP8 region with the user's recipe (here TransformerEngine's
delayed scaling, run by lowprec's engine). The baseline calls ``deepspeed.initialize`` by hand.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import SEED, check, loss_fn, make_loader, make_model, rank_and_world, shard_batches  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec import Accelerator  # noqa: E402
from lowprec.distributed.amax_sync import reduce_delayed_amaxes  # noqa: E402
from lowprec.utils import DeepSpeedPlugin, TERecipeKwargs, set_seed  # noqa: E402

EPOCHS, LR, BATCH = 6, 1e-2, 16


def recipe():
    return dict(amax_history_len=16, amax_compute_algo="max")


def train_accelerate(stage: int) -> list[float]:
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = Accelerator(
        mixed_precision="fp8",
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage),
        kwargs_handlers=[TERecipeKwargs(**recipe())],
    )
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, make_loader(BATCH))
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


def train_baseline(stage: int) -> list[float]:
    import deepspeed

    rank, world = rank_and_world()
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    fp8.convert(model, fp8.Recipe.from_name("delayed", **recipe()), skip_first_last=False, skip_patterns=())
    config = {
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    batches = shard_batches(make_loader(BATCH), rank, world)
    for _ in range(EPOCHS):
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
                logits = engine(x).float()
            loss = loss_fn(logits, y)
            engine.backward(loss)
            engine.step()
            # what the Accelerator does after each step: delayed amaxes agree across ranks (TE's reduce_amax)
            reduce_delayed_amaxes(engine.module)
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append((avg / world).item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=2, choices=(1, 2, 3))
    stage = parser.parse_args().zero_stage
    accel = train_accelerate(stage)
    base = train_baseline(stage)
    check(f"deepspeed_zero{stage}", accel, base, rank_and_world()[0])
    dist.barrier()
    dist.destroy_process_group()
