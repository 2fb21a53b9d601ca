"""Training part of the GPU command: 4 Llama-3-8B decoder layers, one variant at a time.

    python3 benchmarks/gpu/train_part.py --out train.json            # CUDA: seq 8192, batch 2
    python3 benchmarks/gpu/train_part.py --out train.json --dry-run  # CPU, a tiny model

The model is the built-in Llama (``lowprec.train.model``) with Llama-3-8B's decoder shape
(dim 4096, 32 heads, 8 KV heads, SwiGLU 14336, RoPE theta 5e5) and 4 layers. Vocabulary 16384,
not 128256: in the 32-layer 8B model the LM head is about 7% of the GEMM FLOPs, and with 4
layers a 128256-row head would be 38% of them (a bf16 GEMM under every variant, by the default
filter), so the FP8 comparison would be mostly about a layer FP8 leaves alone; 16384 rows keep
the head at the 8B model's share.

Variants, each built, stepped and freed before the next (so peak memory is its own): bf16
(AMP, float32 master weights), every lowprec recipe the GPU runs natively among
tensorwise/rowwise/blockwise/delayed (MXFP8/NVFP4 on sm_100+), torchao tensorwise/rowwise;
eager first, then ``torch.compile``d bf16, tensorwise and torchao tensorwise. Same seed, same
initial weights and the same batches for all. Per variant: tokens/s from the median step
(CUDA events), peak memory (``max_memory_allocated`` above what was allocated before the
build), the loss at the last step, and its ratio to bf16's. A batch that does not fit is halved
once (recorded). The JSON is rewritten after each variant (``complete: false`` until the end).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "gpu"))
from _common import device_name, replace_json, time_fn  # noqa: E402
from linear_part import supported_recipes  # noqa: E402
from train_step import _torchao_convert  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.train.model import LlamaConfig, build_model  # noqa: E402

LLAMA3_8B_4L = LlamaConfig(
    vocab_size=16384,
    dim=4096,
    n_layers=4,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_seq_len=8192,
    rope_theta=500000.0,
    name="llama3-8b-4layers",
)
TINY = LlamaConfig(
    vocab_size=272, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64, name="tiny-4layers"
)
TRAIN_RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "nvfp4")
COMPILED = ("bf16", "tensorwise", "torchao_tensorwise")
FIRST = ("bf16", "tensorwise")


def variants(recipes: list[str]) -> list[tuple[str, object, bool]]:
    """(name, convert or None, uses lowprec's fp8.autocast)."""
    out: list[tuple[str, object, bool]] = [("bf16", None, False)]
    out += [(r, (lambda m, r=r: fp8.convert(m, r)), True) for r in TRAIN_RECIPES if r in recipes]
    for name in ("tensorwise", "rowwise"):
        conv = _torchao_convert(name)
        if conv is not None:
            out.append((f"torchao_{name}", conv, False))
    return out


def run_variant(name, convert, use_fp8, cfg, batch, seq, steps, warmup, compiled, device, backend) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with device:  # parameters created on the GPU directly (0.9 B parameters)
        model = build_model(cfg)
    if convert is not None:
        convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    step_model = torch.compile(model, backend=backend) if compiled else model
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2)]
    losses: list[float] = []
    calls = [0]

    def step():
        ids = batches[calls[0] % len(batches)]
        calls[0] += 1
        ctx = fp8.autocast() if use_fp8 else contextlib.nullcontext()
        with ctx, torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t0 = time.monotonic()
    for _ in range(warmup):
        step()
    first_s = time.monotonic() - t0
    times = [time_fn(step, device, warmup=0, iters=1) for _ in range(steps)]
    ms = statistics.median(times)
    row = {
        "variant": name,
        "mode": "compiled" if compiled else "eager",
        "n_layers": cfg.n_layers,
        "batch_size": batch,
        "seq_len": seq,
        "ms_per_step": round(ms, 3),
        "ms_min": round(min(times), 3),
        "ms_max": round(max(times), 3),
        "tokens_per_s": round(batch * seq / (ms / 1e3), 1),
        "warmup_seconds": round(first_s, 1),
        "steps": warmup + steps,
        "loss_first": round(float(losses[0]), 4),
        "loss_last": round(float(losses[-1]), 4),
        # lowprec's and torchao's FP8 Linear classes
        "fp8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    }
    row["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if cuda else None
    return row  # the model, optimizer and batches are freed with this frame (the caller collects)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, compiled with the 'eager' backend")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps (after the warm-up ones)")
    p.add_argument("--warmup", type=int, default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("train_part.py measures a CUDA GPU; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    cfg = LLAMA3_8B_4L if cuda else TINY
    batch, seq = a.batch_size or 2, a.seq_len or (8192 if cuda else 32)
    steps, warmup = a.steps or (8 if cuda else 1), a.warmup if a.warmup is not None else (2 if cuda else 1)
    recipes = supported_recipes(device) if cuda else supported_recipes(device, sm=(9, 0))
    backend = "inductor" if cuda else "eager"  # the rehearsal traces with Dynamo, skips code generation
    table = variants(recipes)
    plan = [(n, c, f, False) for n, c, f in table] + [(n, c, f, True) for n, c, f in table if n in COMPILED]
    # bf16 and tensorwise, eager and compiled, first: the rows the targets read are measured
    # before a budget stops the part (the third H200 run reached compiled tensorwise last)
    plan.sort(key=lambda s: s[0] not in FIRST)
    if not cuda:  # the rehearsal compiles one variant of a 1-layer model: Dynamo's tracing on 2 CPU cores costs
        # about 10 s per layer and variant, and the code path is the same
        plan = [s for s in plan if not s[3] or s[0] == "tensorwise"]
    payload = {
        "benchmark": "gpu/train",
        "device": device_name(device),
        "torch": torch.__version__,
        "dry_run": a.dry_run,
        "model": dataclasses.asdict(cfg),
        "batch_size": batch,
        "seq_len": seq,
        "tokens_per_step": batch * seq,
        "timed_steps": steps,
        "warmup_steps": warmup,
        "compile_backend": backend,
        "plan": [f"{n} ({'compiled' if c else 'eager'})" for n, _, _, c in plan],
        "results": [],
        "complete": False,
    }
    out = Path(a.out)

    def save():
        replace_json(out, payload)

    save()
    for name, convert, use_fp8, compiled in plan:
        torch._dynamo.reset()
        b = batch
        cfg_v = cfg.replace(n_layers=1) if compiled and not cuda else cfg
        try:
            row = None
            try:
                row = run_variant(name, convert, use_fp8, cfg_v, b, seq, steps, warmup, compiled, device, backend)
            except torch.OutOfMemoryError:
                pass  # retried below, once the failed attempt's frame (and its tensors) is gone
            if row is None:
                gc.collect()
                torch.cuda.empty_cache()
                b = max(1, batch // 2)
                row = run_variant(name, convert, use_fp8, cfg_v, b, seq, steps, warmup, compiled, device, backend)
                row["note"] = f"batch {batch} did not fit; halved to {b}"
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, the others go on
            row = {
                "variant": name,
                "mode": "compiled" if compiled else "eager",
                "error": f"{type(e).__name__}: {e}"[:400],
            }
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        payload["results"].append(row)
        print(json.dumps(row), flush=True)
        _relative(payload["results"])
        save()
    payload["complete"] = True
    save()
    return 0


def _relative(rows: list[dict]) -> None:
    """Each row's tokens/s, peak memory and final loss over bf16's in the same mode."""
    base = {r["mode"]: r for r in rows if r["variant"] == "bf16" and "tokens_per_s" in r}
    for r in rows:
        b = base.get(r.get("mode"))
        if b is None or "tokens_per_s" not in r or r.get("n_layers") != b.get("n_layers"):
            continue
        r["speedup_vs_bf16"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3)
        if r.get("peak_gib") and b.get("peak_gib"):
            r["peak_vs_bf16"] = round(r["peak_gib"] / b["peak_gib"], 3)
        r["loss_last_vs_bf16"] = round(r["loss_last"] / b["loss_last"], 4)


if __name__ == "__main__":
    sys.exit(main())
