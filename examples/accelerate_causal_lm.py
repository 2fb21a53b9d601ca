"""Causal language modelling in the Accelerate style: a transformers Llama built from a config
(no hub download), trained in FP8 with gradient accumulation, TensorBoard tracking and
automatically named checkpoints; the run then resumes from its mid-run checkpoint and must
reproduce the rest of its own losses.

    PYTHONPATH=src python examples/accelerate_causal_lm.py OUT_DIR
    PYTHONPATH=src lowprec launch --cpu --num_processes 2 examples/accelerate_causal_lm.py OUT_DIR

Written for Hugging Face Accelerate: only the imports name lowprec. Tokens are the UTF-8 bytes of
examples/data/notes.jsonl (a local, 256-symbol tokenizer), so it runs offline. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lowprec import Accelerator, DistributedType, ProjectConfiguration
from lowprec.utils import TERecipeKwargs, set_seed

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, BATCH, ACCUM, STEPS, LR, SEED = 32, 4, 2, 12, 3e-3, 0


def byte_dataset() -> TensorDataset:
    with open(os.path.join(HERE, "data", "notes.jsonl")) as f:
        text = " ".join(json.loads(line)["text"] for line in f)
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    n = (len(ids) - 1) // SEQ
    return TensorDataset(ids[: n * SEQ].view(n, SEQ))


def build(accelerator: Accelerator):
    set_seed(SEED)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (4 * STEPS))
    loader = DataLoader(byte_dataset(), batch_size=BATCH, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def run(accelerator, model, optimizer, loader, scheduler, steps: int, save_at: int | None = None) -> list[float]:
    """``steps`` optimizer steps (each ACCUM micro-batches); saves the state after ``save_at``."""
    losses: list[float] = []
    micro = 0
    while len(losses) < steps:
        for (ids,) in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro += 1
            if accelerator.sync_gradients:
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                losses.append(mean)
                accelerator.log({"train/loss": mean, "lr": scheduler.get_last_lr()[0]}, step=len(losses))
                if save_at is not None and len(losses) == save_at:
                    accelerator.save_state()
            if len(losses) == steps:
                break
    return losses


def main(out_dir: str) -> None:
    project = ProjectConfiguration(project_dir=out_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=ACCUM,
        log_with="tensorboard",
        project_config=project,
        kwargs_handlers=[TERecipeKwargs()],
    )
    accelerator.init_trackers("causal_lm", config={"lr": LR, "steps": STEPS, "accum": ACCUM})
    parts = build(accelerator)
    half = STEPS // 2
    losses = run(accelerator, *parts, steps=STEPS, save_at=half)

    # resume: a fresh Accelerator and model, the newest automatically named checkpoint
    resumed_acc = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=ACCUM,
        project_config=ProjectConfiguration(project_dir=out_dir, automatic_checkpoint_naming=True),
        kwargs_handlers=[TERecipeKwargs()],
    )
    model, optimizer, loader, scheduler = build(resumed_acc)
    resumed_acc.load_state()
    resumed = run(resumed_acc, model, optimizer, loader, scheduler, steps=STEPS - half)
    unwrapped = resumed_acc.unwrap_model(model)
    fp8_layers = sum(type(m).__name__ == "Float8Linear" for m in unwrapped.modules())
    if resumed_acc.is_main_process:
        events = [f for _, _, fs in os.walk(os.path.join(out_dir, "causal_lm")) for f in fs if "tfevents" in f]
        print(
            json.dumps(
                {
                    "ok": True,
                    "processes": resumed_acc.num_processes,
                    "ddp": resumed_acc.distributed_type != DistributedType.NO,
                    "loss_first": losses[0],
                    "loss_last": losses[-1],
                    "resume_max_abs_diff": max(abs(a - b) for a, b in zip(resumed, losses[half:])),
                    "fp8_layers": fp8_layers,
                    "tensorboard_files": len(events),
                    "checkpoints": sorted(os.listdir(os.path.join(out_dir, "checkpoints"))),
                }
            )
        )
    accelerator.end_training()  # closes the trackers, then the process group (both runs')


if __name__ == "__main__":
    main(sys.argv[1])
