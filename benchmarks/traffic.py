"""Bytes moved outside the GEMMs by one Linear fwd+bwd, per recipe, on the path CUDA takes.

    PYTHONPATH=src python3 benchmarks/traffic.py           # M=16384, K=4096, N=14336 (Llama-3-8B MLP up)
    PYTHONPATH=src python3 benchmarks/traffic.py --tiny    # a small shape (CI)

Nothing runs on a device: each variant is traced on meta tensors inside
``fp8.trace_as(sm=(9, 0), triton=...)`` and every non-view op's bytes read + written are
counted (``lowprec.fp8.observe.traffic``). Exact and deterministic on any machine. Variants:

* ``bf16``: ``nn.Linear`` as ``torch.autocast(bfloat16)`` runs it (fp32 master weight cast to
  bf16 per call, bf16 GEMMs, weight gradient cast back to fp32); spelled out with explicit
  casts because autocast does not exist on meta tensors; the ops are the same.
* each lowprec recipe on the CUDA default path (fused Triton casts where triton is
  installed), and on the torch path (``LOWPREC_DISABLE_TRITON=1``);
* torchao's ``Float8Linear`` (tensorwise, rowwise, rowwise_with_gw_hp), when torchao imports;
* blockwise traced as sm_89 and sm_100, where torch has no blockwise FP8 GEMM and lowprec's
  Triton one runs (the weight gradient written in float32 by the kernel);
* mxfp8 and nvfp4 traced as sm_100 (``SM``), where torch's block-scaled GEMMs run;
* ``ideal``: one read of each high-precision operand per pass that must finish before its cast
  (current scaling needs the amax first: one extra read; delayed scaling none), each FP8
  layout a GEMM needs written once, amax fused into a pass, the weight gradient written by its
  GEMM in fp32.

The time estimate is a roofline **estimate, not a measurement**: GEMM FLOPs at achieved H100
rates (FP8 ~1300, bf16 ~750, fp32 without TF32 ~50 TFLOP/s) plus bytes outside the GEMMs at
3.35 TB/s; every op outside the GEMMs is taken as bandwidth-bound and launch latency is
ignored. Compiled (Inductor) traffic is not counted: its byte metrics come from the kernels
Inductor generates for a real CUDA device, which this trace does not have (not attempted).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.kernels.select import DISABLE_ENV, triton_importable  # noqa: E402
from lowprec.fp8.observe.traffic import trace_linear  # noqa: E402

FULL = (16384, 4096, 14336)
TINY = (256, 128, 384)
RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4")
# recipes traced as another GPU than --sm: MXFP8 and NVFP4 as sm_100, where torch's block-scaled
# GEMMs run (elsewhere their GEMMs are emulated in float32)
SM = {"mxfp8": (10, 0), "nvfp4": (10, 0)}
# issue 9's targets for bytes outside the GEMMs at FULL, on the CUDA default path
TARGET_GB = {"tensorwise": 2.8, "delayed": 2.0, "rowwise": 3.5, "blockwise": 3.5}
# H100 SXM, achieved (not peak) rates: the roofline ESTIMATE's inputs
HBM_BYTES_PER_S = 3.35e12
FLOPS_PER_S = {
    "float8_e4m3fn": 1300e12,
    "float8_e5m2": 1300e12,
    "bfloat16": 750e12,
    "float16": 750e12,
    "float32": 50e12,
}

# Ideal bytes per element of each operand (x: bf16 (M, K), W: fp32 master (N, K), dY: bf16
# (M, N)): hp reads (passes) + FP8 layouts written. See the module docstring for the rules.
IDEAL_BYTES_PER_ELEMENT = {
    # x: amax read + cast read + fp8 + fp8^T; W: same at 4 bytes; dY: same as x
    "tensorwise": (2 + 2 + 1 + 1, 4 + 4 + 1 + 1, 2 + 2 + 1 + 1),
    # the scale is known before the pass: no amax read
    "delayed": (2 + 1 + 1, 4 + 1 + 1, 2 + 1 + 1),
    # row scales in the cast pass (a row fits on chip); column scales need a prior read
    "rowwise": (2 + 2 + 1 + 1, 4 + 4 + 1 + 1, 2 + 2 + 1 + 1),
    # x, dY: one row-scaled cast each (wgrad reads them in bf16); W: rowwise + tensorwise
    "rowwise_with_gw_hp": (2 + 1, 4 + 4 + 1 + 1, 2 + 1),
    # 1x128 and 128x1 block scales both come from one 128x128 tile on chip: one read
    "blockwise": (2 + 1 + 1, 4 + 1 + 1, 2 + 1 + 1),
    # no amax pass: both layouts (values + E8M0 scales, a byte per 32) from one read of a 32x32 tile
    "mxfp8": (2 + 2 * (1 + 1 / 32), 4 + 2 * (1 + 1 / 32), 2 + 2 * (1 + 1 / 32)),
    # per-tensor amax read, cast read, both layouts (4-bit values + E4M3 scales, a byte per 16)
    "nvfp4": (2 + 2 + 2 * (0.5 + 1 / 16), 4 + 4 + 2 * (0.5 + 1 / 16), 2 + 2 + 2 * (0.5 + 1 / 16)),
}


def ideal_bytes(recipe: str, m: int, k: int, n: int) -> int:
    bx, bw, bdy = IDEAL_BYTES_PER_ELEMENT[recipe]
    return round(bx * m * k + bw * n * k + bdy * m * n)


def _bf16(lin: nn.Linear):
    # torch.autocast(bf16) on F.linear: cast the fp32 weight to bf16 (autograd casts its
    # gradient back to fp32), one bf16 GEMM per direction
    return lambda x: x @ lin.weight.to(torch.bfloat16).t()


def _lowprec(name: str):
    return lambda lin: fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(name))


def _torchao(name: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def build(lin):
        holder = nn.Sequential(lin)
        convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(name))
        return holder[0]

    return build


def estimate_ms(counter) -> float:
    """Roofline ESTIMATE (H100 rates above): GEMM FLOPs at their dtype's rate + outside bytes at HBM bandwidth."""
    gemm_s = sum(g.flops / FLOPS_PER_S[g.operand_dtype] for g in counter.gemms())
    return 1e3 * (gemm_s + counter.outside_gemm_bytes() / HBM_BYTES_PER_S)


def _row(variant: str, counter, m: int, k: int, n: int) -> dict:
    outside = counter.outside_gemm_bytes()
    row = {
        "variant": variant,
        "outside_gemm_bytes": outside,
        "outside_gemm_gb": round(outside / 1e9, 3),
        "gemm_bytes": counter.gemm_bytes(),
        "ops_outside_gemm": sum(1 for r in counter.records if not r.gemm),
        "gemms": [
            {"op": g.name, "dtype": g.operand_dtype, "flops": g.flops, "bytes": g.bytes} for g in counter.gemms()
        ],
        "top_ops": {name: d for name, d in list(counter.by_op().items())[:8]},
    }
    no_rate = sorted({g.operand_dtype for g in counter.gemms()} - set(FLOPS_PER_S))
    if no_rate:  # FP4 GEMMs do not exist on an H100: no estimate rather than an invented rate
        row["estimate_note"] = f"no H100 estimate: {', '.join(no_rate)} GEMMs have no H100 rate"
    else:
        row["estimate_ms_h100"] = round(estimate_ms(counter), 6)
    return row


def trace_variants(m, k, n, recipes, torchao: bool, sm=(9, 0)) -> list[dict]:
    rows = [_row("bf16", trace_linear(_bf16, m, k, n, sm=sm, triton=False), m, k, n)]
    paths = [("default", triton_importable())]
    if triton_importable():
        paths.append(("torch_path", False))
    for name in recipes:
        for path, triton in paths:
            row = _row(
                name if path == "default" else f"{name} [{DISABLE_ENV}=1]",
                trace_linear(_lowprec(name), m, k, n, sm=SM.get(name, sm), triton=triton),
                m,
                k,
                n,
            )
            row.update(
                recipe=name,
                path="fused Triton casts" if triton else "torch ops",
                ideal_outside_gemm_bytes=ideal_bytes(name, m, k, n),
            )
            if name in SM:
                row.update(traced_as=f"sm_{SM[name][0]}{SM[name][1]}", estimate_note="GEMM FLOPs at the H100 rates")
            if path == "default" and (m, k, n) == FULL and name in TARGET_GB:
                row["target_gb"] = TARGET_GB[name]
                row["meets_target"] = row["outside_gemm_gb"] <= TARGET_GB[name]
            rows.append(row)
    if "blockwise" in recipes and triton_importable():  # where torch has no blockwise kernel: lowprec's Triton GEMM
        for other in ((8, 9), (10, 0)):
            tag = f"sm_{other[0]}{other[1]}"
            row = _row(
                f"blockwise [{tag}, Triton GEMM]",
                trace_linear(_lowprec("blockwise"), m, k, n, sm=other, triton=True),
                m,
                k,
                n,
            )
            row.update(
                recipe="blockwise",
                path=f"fused Triton casts + Triton blockwise GEMM, traced as {tag}",
                ideal_outside_gemm_bytes=ideal_bytes("blockwise", m, k, n),
                estimate_note="GEMM FLOPs at the H100 rates above, not the traced GPU's",
            )
            rows.append(row)
    if torchao:
        for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            try:
                counter = trace_linear(_torchao(name), m, k, n, sm=sm, triton=False)
            except Exception as e:  # noqa: BLE001 - report, do not hide, a torchao failure
                rows.append({"variant": f"torchao_{name}", "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            rows.append(_row(f"torchao_{name}", counter, m, k, n))
    bf16_ms = rows[0]["estimate_ms_h100"]
    for r in rows:
        if "estimate_ms_h100" in r:
            r["estimate_speedup_vs_bf16"] = round(bf16_ms / r["estimate_ms_h100"], 3)
        if "ideal_outside_gemm_bytes" in r and "estimate_ms_h100" in r:
            ideal = dict(r, outside_gemm_bytes=r["ideal_outside_gemm_bytes"])
            gemm_s = sum(g["flops"] / FLOPS_PER_S[g["dtype"]] for g in r["gemms"])
            ideal_ms = 1e3 * (gemm_s + ideal["outside_gemm_bytes"] / HBM_BYTES_PER_S)
            r["ideal_estimate_speedup_vs_bf16"] = round(bf16_ms / ideal_ms, 3)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help=f"shape {TINY} instead of {FULL}")
    p.add_argument("--shape", type=int, nargs=3, metavar=("M", "K", "N"), help="override the shape")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--sm", default="9.0", help="compute capability the trace decides for (default 9.0)")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--out", help="JSON path (default benchmarks/results/traffic[_tiny].json)")
    args = p.parse_args(argv)
    m, k, n = args.shape or (TINY if args.tiny else FULL)
    sm = tuple(int(v) for v in args.sm.split("."))
    recipes = [r for r in args.recipes.split(",") if r]
    os.environ.pop(DISABLE_ENV, None)  # trace_as decides the path; say it in the rows instead
    rows = trace_variants(m, k, n, recipes, torchao=not args.no_torchao, sm=sm)
    print(f"one Linear fwd+bwd, M={m} K={k} N={n}, x bf16, W fp32 master; traced as sm_{sm[0]}{sm[1]} (no kernel ran)")
    print(f"{'variant':44s} {'outside GEMMs':>14s} {'ideal':>8s} {'ops':>5s} {'est. x bf16':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:44s} error: {r['error']}")
            continue
        ideal = f"{r['ideal_outside_gemm_bytes'] / 1e9:7.2f}G" if "ideal_outside_gemm_bytes" in r else ""
        est = f"{r['estimate_speedup_vs_bf16']:11.2f}x" if "estimate_speedup_vs_bf16" in r else f"{'-':>12s}"
        print(f"{r['variant']:44s} {r['outside_gemm_gb']:13.3f}G {ideal:>8s} {r['ops_outside_gemm']:5d} {est}")
    print(
        "est. x bf16 is a roofline ESTIMATE at H100 rates (3.35 TB/s; FP8 1300, bf16 750, fp32 50 TFLOP/s), not a measurement"
    )
    payload = {
        "device": f"none: traced on meta tensors as CUDA sm_{sm[0]}{sm[1]} (lowprec.fp8.trace_as); no kernel ran",
        "shape": {"M": m, "K": k, "N": n, "x_dtype": "bfloat16", "weight_dtype": "float32"},
        "triton_installed": triton_importable(),
        "estimate": {
            "label": "ESTIMATE, not measured: roofline at H100 SXM achieved rates",
            "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "gemm_flops_per_s": FLOPS_PER_S,
        },
        "compiled": "not counted (not attempted): Inductor's byte metrics come from kernels generated for a real CUDA device",
        "results": rows,
    }
    write_json(payload, args.out, "traffic_tiny.json" if args.tiny else "traffic.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
