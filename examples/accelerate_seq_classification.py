"""Sequence classification in the Accelerate style (the shape of Accelerate's nlp_example.py): a
transformers BERT built from a config with a local WordPiece tokenizer, trained in FP8 with
gradient accumulation, TensorBoard tracking, evaluation through ``gather_for_metrics`` and a
checkpoint that a fresh run resumes from.

    PYTHONPATH=src python examples/accelerate_seq_classification.py OUT_DIR
    PYTHONPATH=src lowprec launch --cpu --num_processes 2 examples/accelerate_seq_classification.py OUT_DIR

Written for Hugging Face Accelerate: only the imports name lowprec. The task: does a sentence of
examples/data/notes.jsonl mention FP8 or scaling (100 of its 200 sentences do). The vocabulary is
built from those sentences (no hub download). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from lowprec import Accelerator, ProjectConfiguration
from lowprec.utils import TERecipeKwargs, set_seed

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, BATCH, ACCUM, EPOCHS, LR, SEED = 32, 8, 2, 6, 1e-3, 0


def sentences() -> list[str]:
    with open(os.path.join(HERE, "data", "notes.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    return [s.strip() for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if s.strip()]


def local_tokenizer(out_dir: str) -> BertTokenizer:
    words = sorted({w for s in sentences() for w in re.findall(r"\w+|[^\w\s]", s.lower())})
    path = os.path.join(out_dir, "vocab.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return BertTokenizer(path)


def datasets(tokenizer: BertTokenizer) -> tuple[TensorDataset, TensorDataset]:
    sents = sentences()
    labels = torch.tensor([int("fp8" in s.lower() or "scale" in s.lower()) for s in sents])
    enc = tokenizer(sents, padding="max_length", truncation=True, max_length=SEQ, return_tensors="pt")
    data = TensorDataset(enc["input_ids"], enc["attention_mask"], labels)
    g = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(len(sents), generator=g)
    return TensorDataset(*data[perm[:160]]), TensorDataset(*data[perm[160:]])


def build(accelerator: Accelerator, tokenizer: BertTokenizer):
    set_seed(SEED)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train, val = datasets(tokenizer)
    train_dl = DataLoader(train, batch_size=BATCH, shuffle=True)
    val_dl = DataLoader(val, batch_size=BATCH)
    steps = EPOCHS * len(train_dl) // ACCUM
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / (4 * steps)))
    return accelerator.prepare(model, optimizer, train_dl, val_dl, scheduler)


def train_epoch(accelerator, model, optimizer, train_dl, scheduler) -> float:
    model.train()
    total = torch.zeros((), device=accelerator.device)
    for ids, mask, labels in train_dl:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        total += loss.detach()
    return accelerator.reduce(total / len(train_dl), reduction="mean").item()


def evaluate(accelerator, model, val_dl) -> float:
    model.eval()
    correct = count = 0
    for ids, mask, labels in val_dl:
        with torch.no_grad():
            preds = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        preds, labels = accelerator.gather_for_metrics((preds, labels))
        correct += int((preds == labels).sum())
        count += len(labels)
    return correct / count


def main(out_dir: str) -> None:
    project = ProjectConfiguration(project_dir=out_dir, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=ACCUM,
        log_with="tensorboard",
        project_config=project,
        kwargs_handlers=[TERecipeKwargs()],
    )
    with accelerator.main_process_first():
        tokenizer = local_tokenizer(os.path.join(out_dir, "tokenizer"))
    accelerator.init_trackers("seq_cls", config={"lr": LR, "epochs": EPOCHS})
    model, optimizer, train_dl, val_dl, scheduler = build(accelerator, tokenizer)
    losses, accs = [], []
    for epoch in range(EPOCHS):
        losses.append(train_epoch(accelerator, model, optimizer, train_dl, scheduler))
        accs.append(evaluate(accelerator, model, val_dl))
        accelerator.log({"train/loss": losses[-1], "eval/accuracy": accs[-1]}, step=epoch)
        if epoch == EPOCHS // 2 - 1:
            accelerator.save_state()

    # resume from the checkpoint after epoch EPOCHS // 2 in a fresh Accelerator: same later epochs
    again = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=ACCUM,
        kwargs_handlers=[TERecipeKwargs()],
        project_config=ProjectConfiguration(project_dir=out_dir, automatic_checkpoint_naming=True),
    )
    model, optimizer, train_dl, val_dl, scheduler = build(again, tokenizer)
    again.load_state()
    resumed = [train_epoch(again, model, optimizer, train_dl, scheduler) for _ in range(EPOCHS // 2, EPOCHS)]
    fp8_layers = sum(type(m).__name__ == "Float8Linear" for m in again.unwrap_model(model).modules())
    if again.is_main_process:
        print(
            json.dumps(
                {
                    "ok": True,
                    "processes": again.num_processes,
                    "losses": losses,
                    "accuracy": accs,
                    "resume_max_abs_diff": max(abs(a - b) for a, b in zip(resumed, losses[EPOCHS // 2 :])),
                    "fp8_layers": fp8_layers,
                }
            )
        )
    accelerator.end_training()  # closes the trackers, then the process group (both runs')


if __name__ == "__main__":
    main(sys.argv[1])
