"""Overhead of the FP8 health signals (issue 27 target: <= 3% of step time on CPU, SQNR 1 in 50).

Times training steps of the built-in llama-tiny (tensorwise FP8, bf16 autocast, the quickstart's
shapes) in four kinds, interleaved so that a busy machine slows them alike, median of each:

* ``plain``: a step without telemetry (what 9 of 10 steps are at logging_steps: 10);
* ``telemetry``: a logging step as today (telemetry on, read);
* ``health``: a logging step with the probe's max-to-rms and the signals (what fp8_health adds);
* ``health_sqnr``: the same and the float32 shadow GEMMs (1 logging step in 5 at every 50).

The overhead of ``fp8_health: true`` over today's run, per 50 steps at logging_steps 10:
(5 x (health - telemetry) + (health_sqnr - health)) / (50 x mean step of today's run).

    PYTHONPATH=src python benchmarks/health_overhead.py [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.observe.health import HealthProbe, signals  # noqa: E402
from lowprec.train.model import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("llama-tiny"))
    fp8.convert(model, recipe="tensorwise")
    probe = HealthProbe(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (8, 128))
    batch = {"input_ids": ids, "labels": ids}
    previous = None

    def step(kind: str) -> float:
        nonlocal previous
        t0 = time.perf_counter()
        if kind != "plain":
            fp8.enable_telemetry(model)
        if kind.startswith("health"):
            probe.arm(outliers=True, sqnr=kind == "health_sqnr")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
        if kind != "plain":
            tele = fp8.telemetry(model)
            fp8.disable_telemetry(model)
            if kind.startswith("health"):
                previous = signals(tele, probe.layers, probe.take(), previous)
        return (time.perf_counter() - t0) * 1e3

    kinds = ("plain", "telemetry", "health", "health_sqnr")
    for k in kinds:  # warm-up
        step(k)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.reps):
        for k in kinds:
            times[k].append(step(k))
    ms = {k: statistics.median(v) for k, v in times.items()}
    today_step = (45 * ms["plain"] + 5 * ms["telemetry"]) / 50
    added = 5 * (ms["health"] - ms["telemetry"]) + (ms["health_sqnr"] - ms["health"])
    overhead = added / (50 * today_step)
    print(", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    print(f"fp8_health overhead at logging_steps 10, sqnr 1 in 50: {100 * overhead:.2f}% of step time")
    write_json(
        {
            "device": device_name(torch.device("cpu")),
            "median_ms": ms,
            "reps": args.reps,
            "today_mean_step_ms": today_step,
            "health_overhead_fraction": overhead,
            "all_ms": times,
        },
        args.out,
        "health_overhead.json",
    )


if __name__ == "__main__":
    main()
