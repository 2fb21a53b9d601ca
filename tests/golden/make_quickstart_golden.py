"""Regenerate tests/golden/quickstart_loss.json (the quickstart's per-step loss curve on CPU).

    PYTHONPATH=src OMP_NUM_THREADS=1 python3 tests/golden/make_quickstart_golden.py

Only regenerate after a change that is meant to alter the numerics, and say so in the commit.
The corpus fingerprint is stored with the curve: a machine whose Python standard library differs
trains on different text, and the golden test says so instead of failing on the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "examples", "quickstart.yaml")
GOLDEN = os.path.join(ROOT, "tests", "golden", "quickstart_loss.json")
# the quickstart, cut to 16 steps (warmup 10 + 6 of cosine decay), every step logged
OVERRIDES = {
    "max_steps": 16,
    "logging_steps": 1,
    "eval_steps": None,
    "save_steps": None,
    "progress_bar": False,
    "use_tensorboard": False,
}


def run_curve(output_dir: str) -> dict:
    from lowprec.fp8.gemm import cpu as cpu_gemm
    from lowprec.train.config import load_config
    from lowprec.train.data import corpus_fingerprint
    from lowprec.train.trainer import train

    cfg = load_config(CONFIG, {**OVERRIDES, "output_dir": output_dir})
    # The curve is of the CPU path every machine can run (the bf16-upcast FP8 GEMM), not of
    # whichever kernel this CPU's probe would pick (torch._scaled_mm rounds differently).
    saved = os.environ.get(cpu_gemm.CPU_GEMM_ENV)
    os.environ[cpu_gemm.CPU_GEMM_ENV] = "upcast"
    try:
        result = train(cfg)
    finally:
        if saved is None:
            os.environ.pop(cpu_gemm.CPU_GEMM_ENV)
        else:
            os.environ[cpu_gemm.CPU_GEMM_ENV] = saved
    return {
        "config": "examples/quickstart.yaml",
        "overrides": OVERRIDES,
        "corpus_fingerprint": corpus_fingerprint(cfg.dataset_max_bytes),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "losses": [loss for _, loss in result.train_losses],
        "final_eval_loss": result.final_eval_loss,
    }


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "src"))
    with tempfile.TemporaryDirectory() as tmp:
        data = run_curve(tmp)
    with open(GOLDEN, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {GOLDEN}: {len(data['losses'])} steps, fingerprint {data['corpus_fingerprint']}")
