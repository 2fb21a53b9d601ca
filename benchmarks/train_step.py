"""Tokens/s and peak memory of a full training step of the built-in model, per precision.

    PYTHONPATH=src python3 benchmarks/train_step.py                 # llama-1b, seq 2048, compiled (GPU)
    PYTHONPATH=src python3 benchmarks/train_step.py --tiny          # llama-tiny, seq 64, eager, CPU smoke run

Variants in one run: bf16 (AMP, float32 master weights), every lowprec recipe (default
filter: first/last Linear and lm_head stay bf16; plus ``<recipe>+auto`` with the cost-model
filter), and torchao tensorwise / rowwise when torchao imports. Each variant builds the model
from the same seed, runs ``--warmup`` steps, then times ``--steps`` steps (median step time,
CUDA events on GPU). Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the
process's peak RSS growth is not comparable between variants run in one process, so it is
reported as null. torch only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
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
        out[f"{r}+auto"] = ((lambda m, r=r: fp8.convert(m, r, module_filter=fp8.auto_module_filter(
            tokens, r, device_kind, base_filter=lambda mod, fqn: fqn != "lm_head"))), True)
    for name in ("tensorwise", "rowwise"):
        conv = _torchao_convert(name)
        if conv is not None:
            out[f"torchao_{name}"] = (conv, False)
    return out


def run_variant(name, convert, use_fp8, args, device):
    torch.manual_seed(0)
    model = build_model(args.model, max_seq_len=args.seq_len).to(device)
    if convert is not None:
        convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if args.compile else model
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), device=device) for _ in range(4)]
    it = iter(range(10**9))

    def step():
        ids = batches[next(it) % len(batches)]
        ctx = fp8.autocast() if use_fp8 else contextlib.nullcontext()
        with ctx, torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_fn(step, device, warmup=args.warmup, iters=args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    n_fp8 = sum(isinstance(m, fp8.Float8Linear) for m in model.modules())
    del model, opt, step_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens = args.batch_size * args.seq_len
    return {"variant": name, "ms_per_step": ms, "tokens_per_s": tokens / (ms / 1e3), "peak_bytes": peak, "fp8_layers": n_fp8}


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
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or ("llama-tiny" if args.tiny else "llama-1b")
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.compile = (not args.tiny) if args.compile is None else args.compile
    args.steps = args.steps or (2 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    kind = "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else "h100"
    rows = []
    for name, (convert, use_fp8) in variants(args.recipes.split(","), args.batch_size * args.seq_len, kind).items():
        try:
            rows.append(run_variant(name, convert, use_fp8, args, device))
        except Exception as e:  # noqa: BLE001 - report and continue
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["variant"] == "bf16" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            if base["peak_bytes"] and r["peak_bytes"]:
                r["peak_memory_vs_bf16"] = r["peak_bytes"] / base["peak_bytes"]
    tag = "tiny" if args.tiny else device.type
    return write_json({"benchmark": "train_step", "device": device_name(device), "model": args.model,
                       "seq_len": args.seq_len, "batch_size": args.batch_size, "compile": args.compile,
                       "results": rows}, args.out, f"train_step_{tag}.json")


if __name__ == "__main__":
    main()
