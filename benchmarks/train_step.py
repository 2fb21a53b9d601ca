"""Tokens/s and peak memory of a full training step of the built-in model, per precision.

    PYTHONPATH=src python3 benchmarks/train_step.py                 # llama-1b, seq 2048, compiled (GPU)
    PYTHONPATH=src python3 benchmarks/train_step.py --tiny          # llama-tiny, seq 64, eager, CPU smoke run

Variants in one run: bf16 (AMP, float32 master weights), every lowprec recipe (default
filter: first/last Linear and lm_head stay bf16; plus ``<recipe>+auto`` with the cost-model
filter), and torchao tensorwise / rowwise when torchao imports. Every variant's model and
optimizer is built first (same seed), then the variants take turns, one timed step each per
round, in an order rotated by one each round (``--warmup`` untimed rounds, then ``--steps`` timed
ones), so that a machine that gets
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
import json
import os
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


def run_interleaved(built: list, warmup: int, steps: int, cpu_time: bool = False, block: int = 1) -> None:
    """Rounds in which every variant takes turns, the order rotated by one each round.

    ``block`` > 1: each turn is one untimed step, then ``block`` timed ones of the same variant.
    On CPU the step after another variant's costs more (measured on moe-tiny, 2026-11-28: the
    step after an FP8 variant's took ~40% longer, bf16's included, likely the allocator handing
    back and faulting in memory), while in training every step follows one of its own kind; the
    untimed step absorbs that switch. ``block`` 1 is the plain alternation."""
    n = len(built)
    for r in range(warmup):
        for v in built[r % n :] + built[: r % n]:
            v.step()
    done = 0
    r = 0
    while done < steps:
        k = min(block, steps - done)
        for v in built[r % n :] + built[: r % n]:
            if block > 1:
                v.step()
            for _ in range(k):
                v.timed_step(cpu_time)
        done += k
        r += 1


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
    p.add_argument(
        "--block",
        type=int,
        default=1,
        help="timed steps per turn after one untimed switch step (CPU: 4; see run_interleaved)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU); default: torch's")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all)")
    p.add_argument("--cpu_time", action="store_true", help="CPU: time steps by thread CPU time (needs --threads 1)")
    p.add_argument(
        "--telemetry_every",
        type=int,
        default=0,
        help="FP8 telemetry on every Nth step of lowprec's FP8 variants, as the trainer does (10); 0: off",
    )
    p.add_argument(
        "--solo_rounds",
        type=int,
        default=0,
        help="CPU: run each variant in a process of its own, R alternating rounds (see _solo)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.solo_rounds:
        return _solo(p, args, argv if argv is not None else sys.argv[1:])
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
    run_interleaved(built, args.warmup, args.steps, args.cpu_time, args.block)
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
                "times_ms": v.times,
            }
        )  # all variants are resident at once: benchmarks/memory.py measures memory
        print({k: x for k, x in rows[-1].items() if k != "times_ms"}, flush=True)
    base = next((r for r in rows if r["variant"] == "bf16" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
    timing = f"interleaved rounds (rotated, blocks of {args.block} after a switch step): {args.warmup} warm-up, "
    extra = {"compile": args.compile, "telemetry_every": args.telemetry_every}
    return _write(args, device, timing + f"{args.steps} timed; median ms", rows, extra, "tiny" if args.tiny else "")


def _write(args: argparse.Namespace, device: torch.device, timing: str, rows: list, extra: dict, tag: str) -> Path:
    return write_json(
        {
            "benchmark": "train_step",
            "device": device_name(device),
            "model": args.model,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            **extra,
            "timing": timing + (" of thread CPU time" if args.cpu_time else ""),
            "results": rows,
        },
        args.out,
        f"train_step_{tag or device.type}.json",
    )


def _drop(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def _solo(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> Path:
    """Each variant trained alone in a fresh process, ``--solo_rounds`` rounds, the variants
    alternating (round r starts at variant r): what a user's run of one precision sees. In one
    process the step time of a variant depends on which variant stepped before it, through the
    allocator's state (moe-tiny on CPU, 2026-11-28: the same bf16 computation at 97 ms after
    another model's step and 130 ms in a block of its own, while two solo processes of it agreed
    at 120 ms); solo processes have no such neighbour. The JSON holds every step time."""
    import subprocess
    import tempfile

    names = (args.variants or "").split(",") if args.variants else None
    if not names:
        p.error("--solo_rounds needs --variants (the variants to alternate)")
    base = _drop(argv, ("--solo_rounds", "--variants", "--out"))
    times: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.solo_rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out = os.path.join(tmp, f"{r}_{name}.json")
                cmd = [sys.executable, os.path.abspath(__file__), *base, "--variants", name, "--out", out]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                row = json.loads(Path(out).read_text())["results"][0]
                if "error" in row:
                    raise SystemExit(f"{name}: {row['error']}")
                times[name] += row["times_ms"]
                last[name] = row
                print(f"round {r} {name}: median {row['ms_per_step']:.1f} ms", flush=True)
    tokens = args.batch_size * args.seq_len if args.batch_size and args.seq_len else None
    rows = []
    for name in names:
        ms = statistics.median(times[name])
        row = {k: last[name][k] for k in ("variant", "fp8_layers")}
        row.update(ms_per_step=ms, ms_min=min(times[name]), ms_max=max(times[name]), times_ms=times[name])
        if tokens:
            row["tokens_per_s"] = tokens / (ms / 1e3)
        rows.append(row)
    bf16 = next((r for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        if bf16:
            r["speedup_vs_bf16"] = bf16["ms_per_step"] / r["ms_per_step"]
        print({k: v for k, v in r.items() if k != "times_ms"}, flush=True)
    timing = (
        f"each variant alone in a fresh process, {args.solo_rounds} alternating rounds of "
        f"{args.steps} timed steps after {args.warmup} warm-up; median ms over all rounds"
    )
    return _write(args, torch.device("cpu"), timing, rows, {}, "cpu_solo")


if __name__ == "__main__":
    main()
