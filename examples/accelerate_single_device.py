"""FP8 training on one device with the Accelerate API (TransformerEngine recipe).

    PYTHONPATH=src python examples/accelerate_single_device.py

Without TransformerEngine installed, ``TERecipeKwargs`` runs the same delayed-scaling recipe on
lowprec's native engine (one log line says so). The baseline below does the same by hand.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_common import SEED, check, loss_fn, make_loader, make_model  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec import Accelerator  # noqa: E402
from lowprec.utils import TERecipeKwargs, set_seed  # noqa: E402

EPOCHS, ACCUM, LR = 4, 2, 1e-2


def train_accelerate() -> list[float]:
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 100)
    accelerator = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=ACCUM,
        kwarg_handlers=[TERecipeKwargs(amax_history_len=16, amax_compute_algo="max")],
    )
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, make_loader(), scheduler)
    losses = []
    for _ in range(EPOCHS):
        for x, y in dataloader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def train_baseline() -> list[float]:
    """The same run with the raw engine: convert, bf16 autocast + fp8 autocast, manual accumulation."""
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 100)
    recipe = fp8.Recipe.from_name("delayed", amax_history_len=16, amax_compute_algo="max")
    # TransformerEngine converts every Linear with dims divisible by 16, first and last included
    fp8.convert(model, recipe, skip_first_last=False, skip_patterns=())
    losses = []
    batches = list(make_loader())
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
                logits = model(x).float()
            loss = loss_fn(logits, y)
            (loss / ACCUM).backward()
            if (i + 1) % ACCUM == 0 or i == len(batches) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses


if __name__ == "__main__":
    check("single_device", train_accelerate(), train_baseline())
