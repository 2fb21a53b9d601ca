"""Tokens/s and peak memory of a full training step of the built-in model, per precision.

    PYTHONPATH=src python3 benchmarks/train_step.py                 # llama-1b, seq 2048, compiled (GPU)
    PYTHONPATH=src python3 benchmarks/train_step.py --tiny          # llama-tiny, seq 64, eager, CPU smoke run

Variants in one run: bf16 (AMP, float32 master weights), every lowprec recipe (default
filter: first/last Linear and lm_head stay bf16; plus ``<recipe>+auto`` with the cost-model
filter), and torchao tensorwise / rowwise when torchao imports. Every variant's model and
optimizer is built first (same seed), then the variants take turns, one timed step each per
round (``--warmup`` untimed rounds, then ``--steps`` timed ones), so that a machine that gets
busier or cooler mid-run affects them all alike; the median step time is reported, with the
spread (min, max). CUDA events on GPU. Peak memory is not reported here (every variant is
resident at once): ``benchmarks/memory.py`` measures it one variant per process. torch only.

    PYTHONPATH=src python3 benchmarks/train_step.py --model llama-tiny --seq_len 128 --batch_size 8 \
        --no-compile --steps 30 --threads 1     # the quickstart's shapes on CPU

On a shared CPU, ``--cpu_time`` times each step by this thread's CPU time (``time.thread_time``,
with ``--threads 1``) instead of wall time: a step that is descheduled by another process's work
is not charged for the wait, so the fp8/bf16 ratio stays readable under load (cache contention
still shows). ``--variants bf16,tensorwise`` runs only the named variants. ``--telemetry_every 10``
turns FP8 telemetry on one step in ten, as ``lowprec train`` does (its ``logging_steps``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, time_fn, write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.train.model import build_model  # noqa: E402


def _torchao_convert(name):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # noqa: BLE001
        return None

    def convert(model):
        # the same layers as lowprec's default filter (first/last Linear, lm_head, dims % 16),
        # so the engines are compared on the same GEMMs
        rule = fp8.default_module_filter(model)

        def keep(mod, fqn):
            return rule(mod, fqn) is None

        convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(name))

    return convert


def variants(recipes, tokens, device_kind):
    out = {"bf16": (None, False)}
    for r in recipes:
        out[r] = ((lambda m, r=r: fp8.convert(m, r)), True)
        out[f"{r}+auto"] = (
            (
                lambda m, r=r: fp8.convert(
                    m,
                    r,
                    module_filter=fp8.auto_module_filter(
                        tokens, r, device_kind, base_filter=lambda mod, fqn: fqn != "lm_head"
                    ),
                )
            ),
            True,
        )
    for name in ("tensorwise", "rowwise"):
        conv = _torchao_convert(name)
        if conv is not None:
            out[f"torchao_{name}"] = (conv, False)
    return out


class Variant:
    """One model + optimizer + step function; built once, stepped in turns with the others."""

    def __init__(self, name, convert, use_fp8, args, device):
        torch.manual_seed(0)
        self.name, self.device = name, device
        self.model = build_model(args.model, max_seq_len=args.seq_len).to(device)
        if convert is not None:
            convert(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.step_model = torch.compile(self.model) if args.compile else self.model
        vocab = self.model.config.vocab_size
        self.batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), device=device) for _ in range(4)]
        self.use_fp8, self.calls, self.times = use_fp8, 0, []
        self.fp8_layers = sum(isinstance(m, fp8.Float8Linear) for m in self.model.modules())
        self.telemetry_every = getattr(args, "telemetry_every", 0)

    def step(self):
        ids = self.batches[self.calls % len(self.batches)]
        self.calls += 1
        # FP8 telemetry on every Nth step, as the trainer does (its logging_steps, default 10)
        telemetry = self.fp8_layers and self.telemetry_every and self.calls % self.telemetry_every == 0
        if telemetry:
            fp8.enable_telemetry(self.model)
        ctx = fp8.autocast() if self.use_fp8 else contextlib.nullcontext()
        with ctx, torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if telemetry:
            fp8.telemetry(self.model)
            fp8.disable_telemetry(self.model)

    def timed_step(self, cpu_time: bool = False):
        if cpu_time:  # this thread's CPU time (--cpu_time): descheduled time is not counted
            start = time.thread_time()
            self.step()
            self.times.append((time.thread_time() - start) * 1e3)
        else:
            self.times.append(time_fn(self.step, self.device, warmup=0, iters=1))


def run_interleaved(built: list, warmup: int, steps: int, cpu_time: bool = False) -> None:
    for _ in range(warmup):
        for v in built:
            v.step()
    for _ in range(steps):
        for v in built:
            v.timed_step(cpu_time)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--recipes", default="delayed,tensorwise,rowwise")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU); default: torch's")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all)")
    p.add_argument("--cpu_time", action="store_true", help="CPU: time steps by thread CPU time (needs --threads 1)")
    p.add_argument(
        "--telemetry_every",
        type=int,
        default=0,
        help="FP8 telemetry on every Nth step of lowprec's FP8 variants, as the trainer does (10); 0: off",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cpu_time and (torch.cuda.is_available() or args.threads != 1):
        p.error("--cpu_time measures one CPU thread: use it on CPU with --threads 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or ("llama-tiny" if args.tiny else "llama-1b")
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.compile = (not args.tiny) if args.compile is None else args.compile
    args.steps = args.steps or (2 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    kind = "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else "h100"
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, built = [], []
    table = variants(args.recipes.split(","), args.batch_size * args.seq_len, kind)
    if args.variants:
        wanted = args.variants.split(",")
        unknown = [w for w in wanted if w not in table]
        if unknown:
            p.error(f"unknown variant(s) {unknown}; choose from {sorted(table)}")
        table = {w: table[w] for w in wanted}
    for name, (convert, use_fp8) in table.items():
        try:
            built.append(Variant(name, convert, use_fp8, args, device))
            built[-1].step()  # fails here, not mid-run, if the variant cannot run
        except Exception as e:  # noqa: BLE001 - report and continue
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
    run_interleaved(built, args.warmup, args.steps, args.cpu_time)
    tokens = args.batch_size * args.seq_len
    for v in built:
        ms = statistics.median(v.times)
        rows.append(
            {
                "variant": v.name,
                "ms_per_step": ms,
                "ms_min": min(v.times),
                "ms_max": max(v.times),
                # the mean counts the occasional telemetry step (--telemetry_every) the median skips
                "ms_mean": statistics.fmean(v.times),
                "tokens_per_s": tokens / (ms / 1e3),
                "fp8_layers": v.fp8_layers,
                "peak_bytes": None,
            }
        )  # all variants are resident at once: benchmarks/memory.py measures memory
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["variant"] == "bf16" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
    tag = "tiny" if args.tiny else device.type
    return write_json(
        {
            "benchmark": "train_step",
            "device": device_name(device),
            "model": args.model,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "compile": args.compile,
            "telemetry_every": args.telemetry_every,
            "timing": f"interleaved rounds: {args.warmup} warm-up, {args.steps} timed; median ms"
            + (" of thread CPU time" if args.cpu_time else ""),
            "results": rows,
        },
        args.out,
        f"train_step_{tag}.json",
    )


if __name__ == "__main__":
    main()
