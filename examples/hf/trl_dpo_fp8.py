"""FP8 under TRL's ``DPOTrainer``: a tiny Llama (built from a config, with the local byte-level
tokenizer of examples/make_tiny_llama.py; no hub) trained with DPO twice, in bf16 and in FP8,
with TRL's defaults (gradient checkpointing on, bf16 autocast) and the same seed.

    python examples/hf/trl_dpo_fp8.py                  # tensorwise, 20 steps
    python examples/hf/trl_dpo_fp8.py --recipe delayed
    torchrun --nproc_per_node 2 examples/hf/trl_dpo_fp8.py    # DDP (gloo on CPU)

The preference pairs come from the bundled notes: the prompt is a note's opening, ``chosen`` its
true continuation, ``rejected`` another note's. The reference model is built from the same config
and seed (DPOTrainer would otherwise load it from the policy's hub name, which a model built
from a config has not); it is not converted: TRL runs it in eval mode, where converted layers
would run in high precision anyway. FP8 is ``enable_fp8(model, recipe)`` on the policy and
``FP8Callback()`` among the callbacks, as for every Trainer.

Prints one JSON line: the DPO loss of the last 5 steps in both runs and their relative difference,
the same for the reward accuracy and margin TRL logs, how many Linear calls ran in FP8 and in high
precision, and what a ``save_pretrained`` -> ``from_pretrained`` round trip found missing or
unexpected (none expected). Under several processes the counts are per rank and rank 0 prints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NOTES = os.path.join(HERE, "..", "data", "notes.jsonl")


def _sft_example():
    """trl_sft_fp8.py beside this file: the tiny Llama maker and the reload check."""
    spec = importlib.util.spec_from_file_location("trl_sft_fp8", os.path.join(HERE, "trl_sft_fp8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def preference_pairs(prompt_chars: int = 24, answer_chars: int = 32):
    """prompt = a note's opening; chosen = how that note goes on; rejected = how the next note does."""
    from datasets import Dataset

    with open(NOTES, encoding="utf-8") as f:
        texts = [t for t in (json.loads(line)["text"] for line in f) if len(t) >= prompt_chars + answer_chars]
    rows = []
    for i, text in enumerate(texts):
        other = texts[(i + 1) % len(texts)]
        rows.append(
            {
                "prompt": text[:prompt_chars],
                "chosen": text[prompt_chars : prompt_chars + answer_chars],
                "rejected": other[prompt_chars : prompt_chars + answer_chars],
            }
        )
    return Dataset.from_list(rows)


def train(fp8_recipe: str | None, args, out: str):
    """One DPO run; returns (the trainer's training logs, FP8 counts or {}, the policy)."""
    from trl import DPOConfig, DPOTrainer

    from lowprec.integrations.transformers import FP8Callback, enable_fp8, fp8_counts

    maker = _sft_example()._maker()
    tokenizer = maker.make_tokenizer()
    model = maker.make_model(tokenizer, hidden=64, layers=2, seed=0)
    ref_model = maker.make_model(tokenizer, hidden=64, layers=2, seed=0)  # the same weights, kept fixed
    callbacks = []
    if fp8_recipe:
        enable_fp8(model, fp8_recipe)
        callbacks.append(FP8Callback())
    cfg = DPOConfig(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=64,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=cfg,
        train_dataset=preference_pairs(),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    counts = fp8_counts(trainer) if fp8_recipe else {}  # per rank under several processes (collective)
    return logs, counts, trainer.model


def last(logs: list[dict], key: str, n: int = 5) -> float:
    values = [h[key] for h in logs[-n:]]
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="per process (the global batch is this x processes)")
    p.add_argument("--output_dir", default=None, help="default: a temporary directory")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp  # nothing is saved during training: a directory per rank is fine
        bf16, _, _ = train(None, args, os.path.join(out, "bf16"))
        fp8, counts, model = train(args.recipe, args, os.path.join(out, "fp8"))
        result = {"recipe": args.recipe, "steps": args.steps, "world_size": world}
        for key, name in (("loss", "loss"), ("rewards/accuracies", "accuracy"), ("rewards/margins", "margin")):
            a, b = last(bf16, key), last(fp8, key)
            result.update({f"{name}_bf16": a, f"{name}_fp8": b})
        result["rel_diff"] = abs(result["loss_fp8"] - result["loss_bf16"]) / result["loss_bf16"]
        result["loss_first"] = fp8[0]["loss"]
        result.update({k + ("_per_rank" if world > 1 else ""): v for k, v in counts.items()})
        if int(os.environ.get("RANK", 0)) == 0:
            result.update(_sft_example().reload_check(model, os.path.join(out, "fp8")))
            print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
