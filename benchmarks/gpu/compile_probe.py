"""Why is a compiled Float8Linear slow? A diagnosis for the GPU machine, one JSON.

    python3 benchmarks/gpu/compile_probe.py OUT.json [--m 8192 --k 4096 --n 4096]

The first H200 run measured ``torch.compile``d tensorwise fwd+bwd at 447-562 ms against 6 ms
eager (``benchmarks/results/gpu/NVIDIA_H200/run1-2026-11-28/linear.json``). For the tensorwise recipe, compiled
as ``benchmarks/linear.py`` compiles it (the layer, inductor), once with the Triton casts and
once with ``LOWPREC_DISABLE_TRITON=1``, this records: every call's wall time (a recompile or a
re-autotune shows as a slow call after the first), Dynamo's counters (graph breaks with their
reasons, unique graphs, frames), and a profile of one late call (the top CUDA kernels and CPU
ops by self time). Nothing here is a benchmark figure: it is the evidence for a fix.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _probe(m: int, k: int, n: int, calls: int, dev: str = "cuda", backend: str = "inductor") -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import lowprec.fp8 as fp8

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = fp8.Float8Linear.from_linear(
        torch.nn.Linear(k, n, bias=False, device=dev), fp8.Recipe.from_name("tensorwise")
    )
    compiled = torch.compile(layer, backend=backend)
    x = torch.randn(m, k, device=dev, requires_grad=True)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def step():
        with fp8.autocast(), torch.autocast(dev, dtype=torch.bfloat16):
            y = compiled(x)
        y.backward(g)
        x.grad = None
        layer.weight.grad = None

    times = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(round((time.perf_counter() - t) * 1e3, 3))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    events = prof.key_averages()

    def top(attr: str) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, attr, 0) or 0, reverse=True)[:15]
        return [
            {"name": e.key[:120], "calls": e.count, "self_us": round((getattr(e, attr, 0) or 0), 1)}
            for e in rows
            if (getattr(e, attr, 0) or 0) > 0
        ]

    return {
        "call_ms": times,
        "counters": {
            key: {str(k)[:400]: v for k, v in value.items()}
            for key, value in counters.items()
            if key in ("stats", "graph_break", "frames", "recompiles", "unimplemented")
        },
        "top_cuda": top("self_device_time_total"),
        "top_cpu": top("self_cpu_time_total"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--backend", default="inductor")
    args = p.parse_args(argv)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": [args.m, args.k, args.n],
    }
    for label, disable in (("triton_casts", None), ("torch_casts", "1")):
        if disable:
            os.environ["LOWPREC_DISABLE_TRITON"] = disable
        try:
            result[label] = _probe(args.m, args.k, args.n, args.calls, args.device, args.backend)
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            result[label] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(label, json.dumps(result[label])[:1500], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
