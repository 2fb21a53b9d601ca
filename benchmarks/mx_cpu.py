"""Where one Float8Linear fwd+bwd spends its time for the block-scaled recipes on CPU.

    PYTHONPATH=src python3 benchmarks/mx_cpu.py                    # 256x128x256 and 1024x512x1024
    PYTHONPATH=src python3 benchmarks/mx_cpu.py --shapes 256x128x256 --rounds 5

Two parts, JSON into ``benchmarks/results/mx_cpu.json``:

* ``cpu_ms``: median fwd+bwd milliseconds of this thread's CPU time (one torch thread by
  default: on a shared, overloaded machine CPU time is what stays comparable; ``wall_ms`` too)
  per variant (bf16 nn.Linear under autocast, tensorwise,
  mxfp8, nvfp4, and the block-scaled recipes with ``gemm="emulate"``, the exact float32
  reference), *interleaved*: each round times every variant once, so load on a shared machine
  hits all of them alike; the median is over rounds.
* ``profile``: torch.profiler self-CPU time per phase (quantize, the 2-D weight cast, transpose,
  Hadamard, dequantize/upcast, GEMM) for mxfp8 and nvfp4, labelled by wrapping the functions
  ``fp8/kinds/mxfp8.py``/``nvfp4.py``/``mx_gemm`` call with ``record_function``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.gemm import mx as mx_gemm  # noqa: E402
from lowprec.fp8.kinds import mxfp8, nvfp4  # noqa: E402

VARIANTS = ("bf16", "tensorwise", "mxfp8", "nvfp4", "mxfp8_emulate", "nvfp4_emulate")
# (module, function name, label): what the profile attributes time to
PHASES = [
    (mxfp8, "quantize_mx", "quantize 1-D"),
    (nvfp4, "quantize_nvfp4", "quantize 1-D"),
    (nvfp4, "quantize_nvfp4_2d", "quantize 2-D weight"),
    (nvfp4, "transpose_2d", "transpose weight"),
    (nvfp4, "apply_rht", "hadamard"),
    (mx_gemm, "_elements", "dequantize fp32"),
    (mx_gemm, "_bf16_operand", "dequantize bf16"),
    (mx_gemm, "_matmul", "gemm"),
]


def _build(name: str, k: int, n: int) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    if name == "bf16":
        return lin
    recipe, _, gemm = name.partition("_")
    return fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(recipe, **({"gemm": gemm} if gemm else {})))


def _step(mod: nn.Module, x: torch.Tensor):
    """fwd+bwd as a trainer runs it: float32 master weight, bf16 autocast, fresh input grad."""

    def run():
        xi = x.detach().requires_grad_(True)
        with (
            fp8.autocast(enabled=not isinstance(mod, nn.Linear) or isinstance(mod, fp8.Float8Linear)),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            y = mod(xi)
        y.float().sum().backward()
        mod.weight.grad = None

    return run


def time_shape(m, k, n, rounds: int) -> dict:
    x = torch.randn(m, k)
    runs = {v: _step(_build(v, k, n), x) for v in VARIANTS}
    for fn in runs.values():  # warm-up (and the one-time CPU GEMM probe)
        fn(), fn()
    wall = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v, fn in runs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[v].append((time.thread_time() - c0) * 1e3)
            wall[v].append((time.perf_counter() - t0) * 1e3)
    med = {v: round(statistics.median(t), 3) for v, t in cpu.items()}
    return {
        "shape": f"{m}x{k}x{n}",
        "cpu_ms": med,
        "vs_bf16": {v: round(med[v] / med["bf16"], 2) for v in VARIANTS},
        "wall_ms": {v: round(statistics.median(t), 3) for v, t in wall.items()},
    }


def _wrap(mod, name, label):
    fn = getattr(mod, name, None)
    if fn is None:
        return None

    def wrapped(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)

    setattr(mod, name, wrapped)
    return fn


def profile_shape(m, k, n, recipe: str) -> dict:
    saved = {(mod, name): _wrap(mod, name, label) for mod, name, label in PHASES}
    try:
        x = torch.randn(m, k)
        run = _step(_build(recipe, k, n), x)
        run(), run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                with torch.profiler.record_function("total"):
                    run()
    finally:
        for (mod, name), fn in saved.items():
            if fn is not None:
                setattr(mod, name, fn)
    labels = {label for _, _, label in PHASES} | {"total"}
    phases = {e.key: round(e.cpu_time_total / 5 / 1e3, 3) for e in prof.key_averages() if e.key in labels}
    top = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    ops = {e.key: round(e.self_cpu_time_total / 5 / 1e3, 3) for e in top[:12]}
    return {"shape": f"{m}x{k}x{n}", "recipe": recipe, "phase_ms_inclusive": phases, "top_aten_self_ms": ops}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="256x128x256,1024x512x1024")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    timing = [time_shape(*s, args.rounds) for s in shapes]
    for row in timing:
        print(row["shape"], row["cpu_ms"])
    prof = [profile_shape(*s, r) for s in shapes for r in ("mxfp8", "nvfp4")]
    for row in prof:
        print(row["shape"], row["recipe"], row["phase_ms_inclusive"])
    write_json(
        {"device": device_name(torch.device("cpu")), "timing": timing, "profile": prof, "load": list(os.getloadavg())},
        args.out,
        "mx_cpu.json",
    )


if __name__ == "__main__":
    main()
