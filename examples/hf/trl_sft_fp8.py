"""FP8 under TRL's ``SFTTrainer``: a tiny Llama (built from a config, with the local byte-level
tokenizer of examples/make_tiny_llama.py; no hub) fine-tuned on the bundled notes twice, in bf16
and in FP8, with TRL's defaults (gradient checkpointing on, bf16 autocast) and the same seed.

    python examples/hf/trl_sft_fp8.py                  # tensorwise, 20 steps
    python examples/hf/trl_sft_fp8.py --recipe delayed --lora
    torchrun --nproc_per_node 2 examples/hf/trl_sft_fp8.py --opt_level O2   # DDP (gloo on CPU); or
    lowprec launch --cpu --num_processes 2 examples/hf/trl_sft_fp8.py --recipe delayed

As with ``transformers.Trainer``: ``enable_fp8(model, recipe)`` before building the trainer and
``FP8Callback()`` among its callbacks (SFTTrainer is a Trainer). Prints one JSON line: both
losses over the last 5 steps, their relative difference, how many Linear calls ran in FP8 and in
high precision, and the keys a ``save_pretrained`` -> ``from_pretrained`` round trip found
missing or unexpected (none expected). Under several processes the counts are per rank
(``*_per_rank``) and rank 0 prints and reloads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
NOTES = os.path.join(HERE, "..", "data", "notes.jsonl")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _maker():
    """examples/make_tiny_llama.py: the byte-level tokenizer and the tiny Llama."""
    spec = importlib.util.spec_from_file_location("make_tiny_llama", os.path.join(HERE, "..", "make_tiny_llama.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dataset():
    from datasets import Dataset

    with open(NOTES, encoding="utf-8") as f:
        return Dataset.from_list([{"text": json.loads(line)["text"]} for line in f])


def train(fp8_recipe: str | None, args, out: str):
    """One SFT run; returns (last logged loss, FP8 counts or {}, model)."""
    from trl import SFTConfig, SFTTrainer

    from lowprec.integrations.transformers import FP8Callback, enable_fp8, fp8_counts

    maker = _maker()
    tokenizer = maker.make_tokenizer()
    model = maker.make_model(tokenizer, hidden=64, layers=2, seed=0)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS)
    callbacks = []
    if fp8_recipe:
        enable_fp8(model, fp8_recipe)  # before SFTTrainer wraps it in peft: base layers FP8, adapters not
        callbacks.append(FP8Callback())
    cfg = SFTConfig(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        max_length=64,
        packing=True,
    )
    trainer = SFTTrainer(
        model=model,
        args=cfg,
        train_dataset=dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    if fp8_recipe and args.opt_level:
        from lowprec.integrations.transformers import apply_opt_level

        apply_opt_level(trainer, args.opt_level)  # after SFTTrainer built (and peft-wrapped) the model
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    counts = fp8_counts(trainer) if fp8_recipe else {}  # per rank under several processes (collective)
    return float(logs[-1]["loss"]), counts, trainer.model


def reload_check(model, out: str) -> dict:
    from transformers import LlamaForCausalLM

    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    path = os.path.join(out, "saved")
    model.save_pretrained(path)
    loaded, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    ref = model.state_dict()
    same = all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    return {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "weights_equal": same,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lora", action="store_true", help="peft LoRA through SFTTrainer(peft_config=...)")
    p.add_argument("--batch", type=int, default=8, help="per process (the global batch is this x processes)")
    p.add_argument(
        "--opt_level",
        choices=["O1", "O2"],
        default=None,
        help="MS-AMP style FP8 gradients (O1) and FP8AdamW (O2) for the FP8 run",
    )
    p.add_argument("--output_dir", default=None, help="default: a temporary directory")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp  # nothing is saved during training: a directory per rank is fine
        loss_bf16, _, _ = train(None, args, os.path.join(out, "bf16"))
        loss_fp8, counts, model = train(args.recipe, args, os.path.join(out, "fp8"))
        result = {
            "recipe": args.recipe,
            "steps": args.steps,
            "lora": args.lora,
            "opt_level": args.opt_level,
            "world_size": world,
            "loss_bf16": loss_bf16,
            "loss_fp8": loss_fp8,
            "rel_diff": abs(loss_fp8 - loss_bf16) / loss_bf16,
            **{k + ("_per_rank" if world > 1 else ""): v for k, v in counts.items()},
        }
        if int(os.environ.get("RANK", 0)) == 0:
            result.update(reload_check(model, os.path.join(out, "fp8")))
            print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
