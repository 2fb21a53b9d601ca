"""Tokens/s of ``transformers.Trainer`` steps in FP8 (``enable_fp8`` + ``FP8Callback``) against
the same Trainer in bf16 (its ``bf16=True`` autocast), on one process.

    PYTHONPATH=src python3 benchmarks/hf_trainer.py                       # CPU, the shapes below
    PYTHONPATH=src python3 benchmarks/hf_trainer.py --recipes tensorwise,delayed --rounds 5

A Llama built from a config (no hub; ``--hidden``, ``--layers``, ``--seq_len``, ``--batch_size``),
random token batches. Runs are interleaved: each round trains every variant once (a fresh model,
Trainer and optimizer, same seed; the order rotates each round) for ``--steps`` steps, so a machine
that gets busier mid-run affects them all alike. A callback times each optimizer step
(``on_step_begin`` -> ``on_step_end``: forward, backward, clipping, optimizer); the first
``--warmup`` steps of each run are dropped; the median over every timed step of every round is
reported, with the spread. ``--cpu_time`` (default on CPU, with ``--threads 1``) charges a step the
process CPU time it used instead of wall time, so other jobs on a shared machine do not skew the
ratio. Telemetry as in real use: FP8Callback collects it on logging steps (``--logging_steps``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, write_json  # noqa: E402


def build(args, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    return LlamaForCausalLM(cfg)


class Batches(torch.utils.data.Dataset):
    def __init__(self, args) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, args.vocab, (args.batch_size * args.steps, args.seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def step_timer(clock):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = clock()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(clock() - self.t0)

    return StepTimer()


def run(variant: str, args, out: str, clock) -> tuple[list[float], float]:
    """One Trainer run; returns (the timed steps' seconds, the mean training loss)."""
    from transformers import Trainer, TrainingArguments

    from lowprec.integrations.transformers import FP8Callback, enable_fp8, fp8_counts

    model = build(args)
    timer = step_timer(clock)
    callbacks: list = [timer]
    if variant != "bf16":
        enable_fp8(model, variant)
        callbacks.insert(0, FP8Callback())
    targs = TrainingArguments(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        bf16=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Batches(args), callbacks=callbacks)
    loss = trainer.train().training_loss  # the mean over the run's steps
    if variant != "bf16" and fp8_counts(trainer)["fp8_linear_calls"] == 0:
        raise SystemExit(f"{variant}: no Linear call ran in FP8; nothing to measure")
    return timer.times[args.warmup :], float(loss)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="tensorwise", help="comma-separated lowprec recipes, each against bf16")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--cpu_time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time steps by process CPU time (default: on CPU with --threads 1)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    torch.set_num_threads(args.threads)
    cpu_time = args.cpu_time if args.cpu_time is not None else (args.device == "cpu" and args.threads == 1)
    clock = time.process_time if cpu_time else time.perf_counter
    variants = ["bf16", *[r for r in args.recipes.split(",") if r]]
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                t, loss = run(v, args, f"{tmp}/{v}", clock)
                times[v] += t
                losses[v].append(loss)
                print(f"round {r} {v}: median {statistics.median(t) * 1e3:.1f} ms/step, loss {loss:.5f}", flush=True)
    tokens = args.batch_size * args.seq_len
    results = {}
    for v in variants:
        med = statistics.median(times[v])
        results[v] = {
            "median_ms": med * 1e3,
            "min_ms": min(times[v]) * 1e3,
            "max_ms": max(times[v]) * 1e3,
            "timed_steps": len(times[v]),
            "tokens_per_s": tokens / med,
            "mean_loss_per_round": losses[v],
        }
    for v in variants[1:]:
        results[v]["tokens_per_s_vs_bf16"] = results[v]["tokens_per_s"] / results["bf16"]["tokens_per_s"]
        print(
            f"{v}: {results[v]['tokens_per_s']:.0f} tokens/s = {results[v]['tokens_per_s_vs_bf16']:.3f}x bf16 "
            f"({results['bf16']['tokens_per_s']:.0f})"
        )
    import transformers

    write_json(
        {
            "benchmark": "hf_trainer",
            "device": device_name(torch.device(args.device)),
            "transformers": transformers.__version__,
            "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "vocab")},
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "tokens_per_step": tokens,
            "timing": (
                f"{args.rounds} interleaved rounds x {args.steps} Trainer steps, first {args.warmup} of "
                f"each run dropped; median seconds of {'process CPU' if cpu_time else 'wall'} time per step"
            ),
            "results": results,
        },
        args.out,
        f"hf_trainer_{args.device}.json",
    )


if __name__ == "__main__":
    main()
