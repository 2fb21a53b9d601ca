"""``transformers.Trainer`` on ``lowprec.Accelerator`` (``LowprecAcceleratorMixin``): the tiny
Llama of trainer_fp8.py (built from a config, no hub) trained in FP8 with a checkpoint halfway,
then resumed from that checkpoint; under several processes with DDP or FSDP2, CPU included.

    python examples/hf/trainer_accelerator_fp8.py                       # delayed, 6 steps
    torchrun --nproc_per_node 2 examples/hf/trainer_accelerator_fp8.py --fsdp --opt_level O2 --output_dir out
                                                        # MS-AMP O2 (FP8AdamW) on FSDP2 shards
    torchrun --nproc_per_node 2 examples/hf/trainer_accelerator_fp8.py --fsdp --output_dir out
                                                        # FSDP2 from TrainingArguments (gloo on CPU)
    lowprec launch --cpu --num_processes 2 examples/hf/trainer_accelerator_fp8.py --output_dir out
                                                        # DDP
    accelerate launch --multi_gpu --num_processes 2 examples/hf/trainer_accelerator_fp8.py --output_dir out
                                                        # DDP through Accelerate's launcher (gloo on CPU)
    lowprec launch --cpu --num_processes 2 --use_fsdp --fsdp_transformer_layer_cls_to_wrap \\
        LlamaDecoderLayer examples/hf/trainer_accelerator_fp8.py --output_dir out   # FSDP2 from the launcher

The FP8 part: ``class FP8Trainer(LowprecAcceleratorMixin, Trainer)`` and
``kwargs_handlers=[NativeRecipeKwargs(recipe=...)]`` (or Accelerate's ``TERecipeKwargs`` /
``MSAMPRecipeKwargs``). Accelerate turns ``TrainingArguments(fsdp=...)`` on only on GPUs; on
lowprec's Accelerator it shards with FSDP2 on CPU too. Prints one JSON line (rank 0): every
step's loss, each rank's FP8 / high-precision Linear calls, whether the model was sharded, the
resumed run's steps and their largest difference from the uninterrupted run's, and what a
``from_pretrained`` of the saved model found missing or unexpected (none expected).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _trainer_fp8():
    """trainer_fp8.py beside this file: its data, model and reload check."""
    spec = importlib.util.spec_from_file_location("trainer_fp8", os.path.join(HERE, "trainer_fp8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train(args, out: str, resume: str | None = None):
    """One FP8 run with a checkpoint every ``args.steps // 2`` steps; returns the trainer."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer, TrainingArguments

    from lowprec.integrations.trainer_accelerator import LowprecAcceleratorMixin
    from lowprec.utils import MSAMPRecipeKwargs, NativeRecipeKwargs

    class FP8Trainer(LowprecAcceleratorMixin, Trainer):
        pass

    ex = _trainer_fp8()
    fsdp = (
        {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
        if args.fsdp
        else {}
    )
    targs = TrainingArguments(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=max(args.steps // 2, 1),
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=True,  # FP8 runs on bf16 autocast
        seed=0,
        **fsdp,
    )
    trainer = FP8Trainer(
        model=ex.tiny_llama(),
        args=targs,
        train_dataset=ex.ByteWindows(),
        kwargs_handlers=[
            MSAMPRecipeKwargs(opt_level=args.opt_level) if args.opt_level else NativeRecipeKwargs(recipe=args.recipe)
        ],
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.sharded = any(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules())
    return trainer


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="delayed", help="a lowprec engine recipe (NativeRecipeKwargs)")
    p.add_argument(
        "--opt_level",
        choices=("O1", "O2"),
        default=None,
        help="MS-AMP's level (MSAMPRecipeKwargs), in place of --recipe",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4, help="per process (the global batch is this x processes)")
    p.add_argument("--fsdp", action="store_true", help="TrainingArguments(fsdp=True): FSDP2 on lowprec's Accelerator")
    p.add_argument("--output_dir", default=None, help="default: a temporary directory (one process only)")
    args = p.parse_args(argv)
    from lowprec.integrations.transformers import fp8_counts

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not args.output_dir:
        p.error("several processes need --output_dir (one checkpoint directory for all ranks)")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or tmp
        full = train(args, out)
        counts = fp8_counts(full)  # collective under several processes: every rank's counts
        half = max(args.steps // 2, 1)
        resumed = losses(train(args, out, resume=os.path.join(out, f"checkpoint-{half}")))
        after = [s for s in losses(full) if s > half]
        result = {
            "recipe": args.opt_level or args.recipe,
            "optimizer": type(getattr(full.optimizer, "optimizer", full.optimizer)).__name__,
            "world_size": world,
            "distributed_type": str(full.accelerator.distributed_type),
            "sharded": full.sharded,
            "losses": losses(full),
            **{k + ("_per_rank" if world > 1 else ""): v for k, v in counts.items()},
            "resume_steps": after,
            "resume_max_abs_diff": max(abs(resumed[s] - losses(full)[s]) for s in after),
        }
        final = os.path.join(out, "final")
        full.save_model(final)  # plain weights, no FP8 scaling state (collective under FSDP2)
        weights = full.accelerator.get_state_dict(full.model)  # full tensors (collective under FSDP2)
        if rank == 0:
            result.update(reload_check(final, weights))
            print(json.dumps(result))
    return result


def reload_check(path: str, weights: dict) -> dict:
    """``from_pretrained`` of what Trainer saved: keys missing or unexpected, and whether the
    weights are the trained ones."""
    import torch
    from transformers import LlamaForCausalLM

    loaded, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    sd = loaded.state_dict()
    return {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "weights_equal": all(torch.equal(v, weights[k].to(v.dtype)) for k, v in sd.items()),
    }


if __name__ == "__main__":
    main()
