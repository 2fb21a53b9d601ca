"""The FP8 engine on its own: convert a Llama-style model, train it in FP8 on CPU.

    python examples/fp8_engine_demo.py --steps 300 --recipe delayed

Prints the conversion report, the loss every 25 steps, and the final FP8 telemetry of one
layer. No Accelerator, no YAML: just ``lowprec.fp8``.
"""

from __future__ import annotations

import argparse
import time

import torch

import lowprec.fp8 as fp8
from lowprec.train.data import TokenBatches, build_datasets
from lowprec.train.model import build_model


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipe", default="delayed", choices=fp8.RECIPE_NAMES)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    train, _ = build_datasets("builtin:stdlib", seq_len=args.seq_len, max_bytes=2_000_000, seed=args.seed)
    batches = TokenBatches(train, args.batch_size, args.seq_len, seed=args.seed).forever()
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    report = fp8.convert(model, fp8.Recipe.from_name(args.recipe))
    print(report)
    fp8.enable_telemetry(model)

    t0, loss = time.time(), torch.tensor(float("nan"))
    for step in range(1, args.steps + 1):
        batch = next(batches)
        with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.1f}s)")
    name = report.converted[0][0]
    print(f"telemetry of {name}:", fp8.telemetry(model)[name])
    return loss.item()


if __name__ == "__main__":
    main()
