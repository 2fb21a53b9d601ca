"""Fit the FP8 cost model's efficiencies to published H100 speedups (torch only, CPU).

    PYTHONPATH=src python3 benchmarks/fit_cost_model.py

Data: torchao's rowwise Float8Linear fwd+bwd speedup table (H100, compiled; reference
fp8-engines.md section 1.7, 72 shapes) and its two tensorwise points. A grid search over the
efficiency constants; prints the best fit and its errors, writes benchmarks/results/cost_model_fit.json.
These are *published* numbers: replace them with a lent GPU's `benchmarks/linear.py` JSON.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_json  # noqa: E402

from lowprec.fp8.observe.cost_model import PROFILES, predict_speedup  # noqa: E402

NS = [1024, 2048, 4096, 8192, 16384, 32768]
ROWWISE = {  # (M, K): speedups for N in NS
    (1024, 4096): [0.48, 0.43, 0.46, 0.53, 0.57, 0.60],
    (4096, 4096): [0.44, 0.64, 0.84, 1.01, 1.01, 1.04],
    (4096, 8192): [0.53, 0.72, 0.91, 1.01, 1.07, 1.13],
    (8192, 4096): [0.52, 0.76, 1.00, 1.13, 1.17, 1.19],
    (8192, 8192): [0.59, 0.85, 1.05, 1.20, 1.31, 1.41],
    (16384, 4096): [0.57, 0.79, 1.02, 1.20, 1.26, 1.40],
    (16384, 8192): [0.61, 0.87, 1.08, 1.33, 1.39, 1.49],
    (16384, 16384): [0.59, 0.83, 1.07, 1.34, 1.42, 1.55],
    (16384, 32768): [0.60, 0.85, 1.16, 1.35, 1.48, 1.72],
    (32768, 8192): [0.63, 0.87, 1.11, 1.41, 1.50, 1.62],
    (32768, 16384): [0.60, 0.83, 1.16, 1.39, 1.49, 1.73],
    (32768, 32768): [0.63, 0.93, 1.16, 1.48, 1.70, 1.52],
}
TENSORWISE = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}


def points():
    for (m, k), row in ROWWISE.items():
        for n, s in zip(NS, row):
            yield "rowwise", (m, k, n), s
    for shape, s in TENSORWISE.items():
        yield "tensorwise", shape, s


def errors(profile):
    return [(abs(predict_speedup(*shape, recipe, profile) - s), recipe, shape, s) for recipe, shape, s in points()]


def fit():
    base = PROFILES["h100"]
    best = None
    grid = itertools.product(
        [0.7, 0.8, 0.9],
        [0.5, 0.55, 0.6, 0.65, 0.7, 0.75],
        [0.4, 0.5, 0.6, 0.7, 0.8],
        [5.0, 10.0, 20.0],
        [8e9, 3e10, 1e11, 3e11],
    )
    for ge, fe, me, oh, sg in grid:
        p = replace(base, gemm_eff=ge, fp8_gemm_eff=fe, mem_eff=me, cast_overhead_us=oh, small_gemm_flops=sg)
        err = statistics.mean(e for e, *_ in errors(p))
        if best is None or err < best[0]:
            best = (err, p)
    return best


if __name__ == "__main__":
    err, p = fit()
    current = statistics.mean(e for e, *_ in errors(PROFILES["h100"]))
    print(f"best fit: mean abs error {err:.3f}  {p}")
    print(f"shipped profile: mean abs error {current:.3f}")
    write_json(
        {
            "benchmark": "cost_model_fit",
            "device": "none (fit to published H100 numbers)",
            "best": p.__dict__,
            "best_mean_abs_error": err,
            "shipped_mean_abs_error": current,
        },
        None,
        "cost_model_fit.json",
    )
