"""The host time of one small converted Linear's forward against ``nn.Linear``'s: the per-call
Python work (recipe switch, feature checks, casts, dispatch) that a launch-bound GPU run pays per
layer, measured on CPU where the tensors are tiny (16x16 weight, 8 rows), so the ops cost little.

Per recipe: the median microseconds of a forward (each sample the mean of ``--calls`` calls,
interleaved with the bf16 ``nn.Linear`` reference, ``--repeats`` rounds), with and without grad,
and the number of Python function calls one forward makes (``sys.setprofile``). A timing of this
machine only; not asserted anywhere. ``python benchmarks/forward_overhead.py`` writes
``benchmarks/results/forward_overhead_cpu.json``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, write_json  # noqa: E402

from lowprec import fp8  # noqa: E402

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4")


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _python_calls(fn) -> int:
    count = [0]

    def prof(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def measure(recipe: str, calls: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(8)))
    fp8.convert(model, recipe=recipe, skip_first_last=False)
    layer, plain = model[0], torch.nn.Linear(16, 16, bias=False).bfloat16()
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    out = {"recipe": recipe}
    with fp8.autocast():
        for _ in range(20):  # one-time decisions, caches
            layer(x)
        for grad in (False, True):
            ours, ref = [], []
            with torch.set_grad_enabled(grad):
                for _ in range(repeats):  # interleaved: drift hits both alike
                    ours.append(_per_call_us(lambda: layer(x), calls))
                    ref.append(_per_call_us(lambda: plain(x), calls))
            key = "grad" if grad else "no_grad"
            out[f"fp8_us_{key}"] = round(statistics.median(ours), 1)
            out[f"nn_linear_us_{key}"] = round(statistics.median(ref), 1)
        out["python_calls_per_forward"] = _python_calls(lambda: layer(x))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    args = ap.parse_args()
    rows = []
    for recipe in args.recipes:
        rows.append(measure(recipe, args.calls, args.repeats))
        r = rows[-1]
        print(
            f"{recipe:>12}: {r['fp8_us_grad']:.1f} us (nn.Linear {r['nn_linear_us_grad']:.1f} us) with grad, "
            f"{r['python_calls_per_forward']} Python calls"
        )
    payload = {
        "device": device_name(torch.device("cpu")),
        "torch": torch.__version__,
        "layer": "fp8.convert(nn.Linear(16, 16)), x (8, 16) bf16, under fp8.autocast(), forward only",
        "command": "python benchmarks/forward_overhead.py",
        "results": rows,
    }
    write_json(payload, args.out, "forward_overhead_cpu.json")


if __name__ == "__main__":
    main()
