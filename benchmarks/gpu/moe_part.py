"""MoE part of the GPU command: one grouped expert projection fwd+bwd per recipe, timed beside
bf16's grouped GEMM, with the kernels that ran.

    python3 benchmarks/gpu/moe_part.py --out moe.json            # CUDA: Qwen3-30B-A3B shapes
    python3 benchmarks/gpu/moe_part.py --out moe.json --dry-run  # CPU, tiny shapes

One projection of a mixture-of-experts layer: x (S, K) bf16 grouped by expert (even routing:
S / E rows each, what ``benchmarks/grouped_traffic.py`` traces), an fp32 master weight (E, N, K),
``Float8GroupedGemm`` as the converted experts run it (the routes of ``fp8/gemm/grouped.py``:
torch's ``_scaled_grouped_mm``, lowprec's Triton grouped GEMMs and grouped grad_weight, or one
GEMM per expert), against ``torch._grouped_mm`` on the bf16 cast of the weight (what
``torch.autocast`` runs). Per recipe this GPU runs natively (MXFP8 / NVFP4 on sm_100+): the
median fwd+bwd milliseconds (CUDA events, after warm-up), the ratio to bf16, the output's SQNR
against bf16's (a sanity check, not the numerics tests), and the lowprec log lines of the run
(which grouped kernel each GEMM took, any self-check that failed and its fallback). The JSON is
rewritten after each recipe, so a part stopped at its budget keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, replace_json, time_fn  # noqa: E402
from grouped_traffic import bf16_make, even_counts  # noqa: E402
from linear_part import _Collect, supported_recipes  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.modules.grouped import Float8GroupedGemm  # noqa: E402

# (E, K, N, tokens x top-k): Qwen3-30B-A3B's expert projection (hidden 2048 -> 768), 8192 tokens, top-8
SHAPE = (128, 2048, 768, 8192 * 8)
TINY = (4, 64, 32, 64)


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return round(float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300))), 2)


def measure(name: str, x, w, dy, counts, iters: int, warmup: int, device: torch.device) -> dict:
    """Median fwd+bwd ms of one variant (``bf16`` or a recipe name) and its output."""
    if name == "bf16":
        run = bf16_make(len(counts))
        forward = lambda xi: run(xi, w, counts)  # noqa: E731
    else:
        recipe = fp8.Recipe.from_name(name)
        gemm = Float8GroupedGemm(len(counts), recipe, device=device)
        forward = lambda xi: gemm(xi, w, counts, recipe, torch.bfloat16)  # noqa: E731
    xi = x.detach().requires_grad_()

    def step():
        xi.grad = None
        w.grad = None
        forward(xi).backward(dy)

    ms = time_fn(step, device, warmup=warmup, iters=iters)
    with torch.no_grad():
        out = forward(x)
    return {"ms": round(ms, 4), "out": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("moe_part.py measures a CUDA GPU; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    experts, k, n, rows = SHAPE if cuda else TINY
    recipes = supported_recipes(device) if cuda else supported_recipes(device, sm=(9, 0))
    iters, warmup = (10, 3) if cuda else (1, 0)
    lines = _Collect(logging.INFO)  # the routes taken too, not only fallbacks
    logging.getLogger("lowprec").addHandler(lines)
    logging.getLogger("lowprec").setLevel(logging.INFO)
    payload = {
        "benchmark": "gpu/moe",
        "device": device_name(device),
        "torch": torch.__version__,
        "dry_run": a.dry_run,
        "shape": {"E": experts, "K": k, "N": n, "rows": rows, "routing": "even", "x": "bf16", "weight": "fp32"},
        "timing": "median ms of one grouped projection fwd+bwd after warm-up (CUDA events on GPU)",
        "iters": iters,
        "warmup": warmup,
        "results": [],
        "complete": False,
    }
    out = Path(a.out)

    def save():
        payload["lowprec_log"] = lines.messages
        replace_json(out, payload)

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(experts, n, k, generator=g) * k**-0.5).to(device).requires_grad_()
    dy = torch.randn(rows, n, generator=g).to(device=device, dtype=torch.bfloat16)
    counts = even_counts(experts, rows)
    ref = None
    for name in ["bf16", *recipes]:
        t0 = time.monotonic()
        try:
            r = measure(name, x, w, dy, counts, iters, warmup, device)
        except Exception as e:  # noqa: BLE001 - a recipe that fails is reported, the others still run
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:400]}
        else:
            if ref is None:
                ref = r["out"]
            row = {"variant": name, "ms": r["ms"], "sqnr_vs_bf16_db": None if name == "bf16" else _sqnr(ref, r["out"])}
            bf16_ms = payload["results"][0].get("ms") if payload["results"] else None
            if bf16_ms:
                row["speedup_vs_bf16"] = round(bf16_ms / r["ms"], 3)
        row["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(row), flush=True)
        payload["results"].append(row)
        save()
        if cuda:
            torch.cuda.empty_cache()
    payload["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
