"""What a ``lowprec train`` run costs outside its training steps, on CPU: the process that
launches the workers of ``--num_processes N`` (its imports and the config check), and the end of
run's ``fp8_report.png``.

- ``launcher``: a fresh Python process that imports the train command's runner and validates
  ``examples/tiny.yaml`` (what ``lowprec train --num_processes 2`` does before it starts torchrun),
  wall and CPU seconds, and whether it imported torch;
- ``fp8_report``: :func:`lowprec.train.plots.plot_fp8_report` over a run's telemetry of the shape
  the quickstart writes (15 layers x 3 operands, ``--steps`` logged steps), in this process after a
  first call (matplotlib imported).

Medians of ``--repeats`` runs, the two measurements interleaved. Timings of this machine only.
``python benchmarks/run_overhead.py`` writes ``benchmarks/results/run_overhead_cpu.json``."""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, write_json  # noqa: E402

from lowprec.train.plots import plot_fp8_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = (
    "import sys, lowprec.cli.runners.train; from lowprec.train.config import load_config; "
    f"load_config({str(ROOT / 'examples' / 'tiny.yaml')!r}, {{'max_steps': 2}}); "
    "print('torch' in sys.modules)"
)


def launcher_once() -> tuple[float, float, bool]:
    """(wall s, CPU s, torch imported) of one fresh launching process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", LAUNCHER], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout.strip().splitlines()[-1] == "True"


def telemetry(steps: int) -> list[dict]:
    """fp8 metric records shaped as the trainer writes them (values random, fixed seed)."""
    rng = random.Random(0)
    layers = [
        f"model.layers.{i}.{p}"
        for i in range(3)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")
    ]
    ops = ("input", "weight", "grad_output")

    def stats() -> dict:
        return {
            "amax": rng.uniform(1e-4, 10),
            "scale": 2.0 ** rng.randint(4, 24),
            "saturated": 0.0,
            "underflow": rng.choice([0.0, 1e-4]),
        }

    return [
        {"kind": "fp8", "step": s, "layers": {lay: {op: stats() for op in ops} for lay in layers}}
        for s in range(1, steps + 1)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    records = telemetry(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        png = os.path.join(tmp, "fp8_report.png")
        plot_fp8_report(records, png)  # matplotlib imported, fonts cached
        walls, cpus, torch_seen, plots = [], [], set(), []
        for _ in range(args.repeats):
            wall, cpu, seen = launcher_once()
            walls.append(wall)
            cpus.append(cpu)
            torch_seen.add(seen)
            start = time.perf_counter()
            plot_fp8_report(records, png)
            plots.append(time.perf_counter() - start)
    results = {
        "launcher": {
            "wall_s_median": statistics.median(walls),
            "cpu_s_median": statistics.median(cpus),
            "imports_torch": sorted(torch_seen) == [True],
            "wall_s": walls,
        },
        "fp8_report": {"s_median": statistics.median(plots), "s": plots, "layers": 15, "steps": args.steps},
    }
    print(
        f"launcher: {results['launcher']['wall_s_median']:.2f} s wall, {results['launcher']['cpu_s_median']:.2f} s CPU, "
        f"torch imported: {results['launcher']['imports_torch']}; fp8_report: {results['fp8_report']['s_median']:.2f} s"
    )
    payload = {"device": device_name(torch.device("cpu")), "repeats": args.repeats, "results": results}
    write_json(payload, args.out, "run_overhead_cpu.json")


if __name__ == "__main__":
    main()
