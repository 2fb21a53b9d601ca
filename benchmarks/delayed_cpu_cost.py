"""Where delayed scaling loses time against tensorwise on CPU: one Float8Linear forward +
backward at the Llama shapes of benchmarks/hf_trainer.py (hidden 512, intermediate 1408, 1024
tokens), per recipe, and delayed with its casts' saturation passes removed (an estimate of what
skipping them when the tensor is known to be in range would save; not a correct cast).

    PYTHONPATH=src python3 benchmarks/delayed_cpu_cost.py            # writes results/delayed_cpu_cost.json

Why a third variant: with a scale from the tensor's own amax (tensorwise) the CPU cast is one
multiply and the FP8 conversion; with a scale from the amax history (delayed) ``quantize_tensorwise``
adds ``nan_to_num_`` (inf -> NaN) and ``clamp_`` (saturation) over the float32 temporary, since
the history's scale may be too large for this tensor. The rest of delayed's extra time is the
history update (``host_scale.delayed_step``: ``roll``, host reads, ``torch.tensor``) per operand.
Variants are interleaved in rounds; process CPU time, median per shape; "per_step" weighs each
shape by how often a 4-layer Llama step runs it (q, k, v, o: 512x512; gate, up: 512->1408;
down: 1408->512).
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

SHAPES = {(512, 512): 4, (512, 1408): 2, (1408, 512): 1}  # (in, out): uses per decoder layer
VARIANTS = ("tensorwise", "delayed", "delayed_no_saturation_passes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from lowprec import fp8

    quantize = sys.modules["lowprec.fp8.cast.quantize"]  # the module (lowprec.fp8 exports a function of that name)
    saturate = quantize.saturate_

    def no_passes(y, dtype, *, may_hold_inf=True):
        return y.to(dtype)

    torch.manual_seed(0)
    inputs = {k: torch.randn(args.tokens, k, dtype=torch.bfloat16) for k, _ in SHAPES}
    layers = {}
    for variant in VARIANTS:
        for k, n in SHAPES:
            layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
            fp8.convert(layer, variant.split("_")[0], skip_first_last=False)
            layers[(variant, (k, n))] = layer

    def run(layer, x0):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()

    times: dict = {}
    for _ in range(args.rounds):
        for (variant, shape), layer in layers.items():
            quantize.saturate_ = no_passes if variant.endswith("passes") else saturate
            try:
                run(layer, inputs[shape[0]])
                t = time.process_time()
                for _ in range(args.iters):
                    run(layer, inputs[shape[0]])
                times.setdefault((variant, shape), []).append((time.process_time() - t) / args.iters * 1e3)
            finally:
                quantize.saturate_ = saturate
    results = {v: {"per_shape_ms": {}, "per_step_ms": 0.0} for v in VARIANTS}
    for (variant, shape), ms in times.items():
        med = statistics.median(ms)
        results[variant]["per_shape_ms"][f"{shape[0]}x{shape[1]}"] = med
        results[variant]["per_step_ms"] += args.layers * SHAPES[shape] * med
    gap = results["delayed"]["per_step_ms"] - results["tensorwise"]["per_step_ms"]
    saved = results["delayed"]["per_step_ms"] - results["delayed_no_saturation_passes"]["per_step_ms"]
    for v in VARIANTS:
        print(f"{v}: {results[v]['per_step_ms']:.1f} ms of FP8 Linear fwd+bwd per step")
    print(f"delayed - tensorwise: {gap:.1f} ms/step; the saturation passes: {saved:.1f} ms of it (estimate)")
    write_json(
        {
            "benchmark": "delayed_cpu_cost",
            "device": device_name(torch.device("cpu")),
            "timing": f"{args.rounds} interleaved rounds x {args.iters} fwd+bwd, {args.tokens} tokens, "
            "median process CPU time per shape, 1 thread",
            "results": results,
            "delayed_minus_tensorwise_ms_per_step": gap,
            "saturation_passes_ms_per_step_estimate": saved,
        },
        args.out,
        "delayed_cpu_cost.json",
    )


if __name__ == "__main__":
    main()
