"""FP8 under ``transformers.Trainer``: a tiny Llama (built from a config, no hub) trained on the
bundled notes twice, in bf16 and in FP8, with the same seed and batches; then the FP8 model is
saved with ``save_pretrained`` and loaded back in transformers.

    python examples/hf/trainer_fp8.py                        # tensorwise, 20 steps
    python examples/hf/trainer_fp8.py --recipe delayed --gradient_checkpointing reentrant
    python examples/hf/trainer_fp8.py --lora                 # peft LoRA on the FP8 base layers
    python examples/hf/trainer_fp8.py --opt_level O2         # + MS-AMP style FP8AdamW and FP8 gradients
    torchrun --nproc_per_node 2 examples/hf/trainer_fp8.py   # DDP (gloo on CPU); or:
    lowprec launch --cpu --num_processes 2 examples/hf/trainer_fp8.py --recipe delayed --opt_level O2

The FP8 part is two lines: ``enable_fp8(model, recipe)`` before building the Trainer and
``FP8Callback()`` among its callbacks. Prints one JSON line: both losses over the last 5 steps (Trainer logs every 5),
their relative difference, how many Linear calls ran in FP8 and in high precision, and the
keys the reload found missing or unexpected (none expected). Under several processes the
counts are per rank (``fp8_linear_calls_per_rank``) and rank 0 prints and reloads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.utils.data import Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTES = os.path.join(ROOT, "examples", "data", "notes.jsonl")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ByteWindows(Dataset):
    """Fixed windows of the notes' UTF-8 bytes (token id = byte value), labels = inputs."""

    def __init__(self, seq: int = 64) -> None:
        with open(NOTES, encoding="utf-8") as f:
            text = " ".join(json.loads(line)["text"] for line in f)
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.windows = ids[: len(ids) // seq * seq].view(-1, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # every Linear a multiple of 16 wide (FP8 GEMMs need it); vocab = the 256 byte values
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg)


def training_args(out: str, args, save_every: int = 0):
    """Trainer's arguments; ``save_every`` > 0: a checkpoint every that many steps, a log line every step."""
    from transformers import TrainingArguments

    ckpt = (
        {}
        if args.gradient_checkpointing == "off"
        else {
            "gradient_checkpointing": True,
            "gradient_checkpointing_kwargs": {"use_reentrant": args.gradient_checkpointing == "reentrant"},
        }
    )
    saving = (
        {"save_strategy": "steps", "save_steps": save_every, "logging_steps": 1}
        if save_every
        else {"save_strategy": "no", "logging_steps": 5}
    )
    return TrainingArguments(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=True,
        seed=0,
        **saving,
        **ckpt,
    )


def train(fp8_recipe: str | None, args, out: str, save_every: int = 0, resume: str | None = None):
    """One run; returns (last loss, the FP8 callback's counts or {}, model, {step: loss})."""
    from transformers import Trainer

    from lowprec.integrations.transformers import FP8Callback, enable_fp8, fp8_counts

    model = tiny_llama()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    callbacks = []
    if fp8_recipe:
        enable_fp8(model, fp8_recipe)  # conversion is the switch: FP8 wherever Trainer calls the model
        callbacks.append(FP8Callback())
    trainer = Trainer(
        model=model, args=training_args(out, args, save_every), train_dataset=ByteWindows(), callbacks=callbacks
    )
    if fp8_recipe and args.opt_level:
        from lowprec.integrations.transformers import apply_opt_level

        apply_opt_level(trainer, args.opt_level)  # before train(): Trainer keeps this optimizer
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    counts = fp8_counts(trainer) if fp8_recipe else {}  # per rank under several processes (collective)
    return float(logs[-1]["loss"]), counts, model, {h["step"]: h["loss"] for h in logs}


def resume_check(args, out: str) -> dict:
    """The FP8 run again with a checkpoint halfway, then resumed from it (Trainer's own
    ``resume_from_checkpoint``; FP8Callback restores each rank's FP8 scaling state): the largest
    difference between the resumed run's losses and the uninterrupted run's."""
    half = max(args.steps // 2, 1)
    _, _, _, full = train(args.recipe, args, out, save_every=half)
    _, _, _, resumed = train(args.recipe, args, out, save_every=half, resume=os.path.join(out, f"checkpoint-{half}"))
    after = [s for s in full if s > half]
    return {"resume_steps": after, "resume_max_abs_diff": max(abs(resumed[s] - full[s]) for s in after)}


def reload_check(model, out: str) -> dict:
    """save_pretrained -> from_pretrained: keys missing or unexpected, and whether weights match."""
    from transformers import LlamaForCausalLM

    if hasattr(model, "merge_and_unload"):  # peft: the merged model is what gets shipped
        model = model.merge_and_unload()
    path = os.path.join(out, "saved")
    model.save_pretrained(path)
    loaded, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    same = all(
        torch.equal(p, loaded.state_dict()[k]) for k, p in model.state_dict().items() if k in loaded.state_dict()
    )
    return {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "weights_equal": same,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gradient_checkpointing", choices=["off", "reentrant", "non_reentrant"], default="off")
    p.add_argument("--lora", action="store_true", help="peft LoRA adapters on the (FP8) base layers")
    p.add_argument("--batch", type=int, default=8, help="per process (the global batch is this x processes)")
    p.add_argument(
        "--opt_level",
        choices=["O1", "O2"],
        default=None,
        help="MS-AMP style FP8 gradients (O1) and FP8AdamW (O2) for the FP8 run",
    )
    p.add_argument(
        "--resume_check",
        action="store_true",
        help="also train FP8 with a checkpoint halfway and resume from it; report the loss difference",
    )
    p.add_argument("--output_dir", default=None, help="default: a temporary directory")
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.resume_check and world > 1 and not args.output_dir:
        p.error("--resume_check on several processes needs --output_dir (one checkpoint directory for all ranks)")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp  # nothing is saved during training: a directory per rank is fine
        loss_bf16, _, _, _ = train(None, args, os.path.join(out, "bf16"))
        loss_fp8, counts, model, _ = train(args.recipe, args, os.path.join(out, "fp8"))
        result = {
            "recipe": args.recipe,
            "steps": args.steps,
            "lora": args.lora,
            "opt_level": args.opt_level,
            "world_size": world,
            "gradient_checkpointing": args.gradient_checkpointing,
            "loss_bf16": loss_bf16,
            "loss_fp8": loss_fp8,
            "rel_diff": abs(loss_fp8 - loss_bf16) / loss_bf16,
            **{k + ("_per_rank" if world > 1 else ""): v for k, v in counts.items()},
        }
        if args.resume_check:
            result.update(resume_check(args, os.path.join(out, "resume")))
        if rank == 0:
            result.update(reload_check(model, os.path.join(out, "fp8")))
            print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
