"""Bytes moved outside the GEMMs by one grouped expert GEMM fwd+bwd, per recipe, on the path CUDA takes.

    PYTHONPATH=src python3 benchmarks/grouped_traffic.py          # DeepSeek-V3 and Qwen3-30B-A3B shapes
    PYTHONPATH=src python3 benchmarks/grouped_traffic.py --tiny   # a small shape (CI)

Issue 25, benchmark item 5 (first part). One grouped GEMM of a 3-D expert weight ``W`` (E, N, K)
(fp32 master, as mixed-precision training keeps it) on ``x`` (S, K) bf16 grouped by expert,
``S = tokens x top_k`` routed rows (8192 tokens x top-8 = 65536 by default). Routing ``even``
(the rows the target is judged on): ``S / E`` rows per expert (256 at DeepSeek-V3, 512 at
Qwen3-30B-A3B; multiples of 16, so no group needs padding for the grouped kernels); ``skewed``:
a deterministic uneven split (:func:`skewed_counts`), groups not multiples of 16. Counted: the output GEMM, grad_input (grouped) and
grad_weight (grouped where its Triton kernel takes the recipe's casts, else per expert), and every op around them (casts, amaxes, packing, the weight
gradient's assembly). Shapes (the experts' up projection, hidden K -> expert N):

* ``deepseek-v3``: E=256, K=7168, N=2048;
* ``qwen3-30b-a3b``: E=128, K=2048, N=768.

Traced on meta tensors inside ``fp8.trace_as`` exactly as ``benchmarks/traffic.py`` traces the
dense Linear (``lowprec.fp8.observe.traffic.trace_grouped``): nothing runs, the counts are exact and
machine-independent. E4M3 recipes are traced as sm_90 (H100/H200: torch's grouped FP8 kernel, the
fused Triton casts); ``mxfp8`` and ``nvfp4`` as sm_100 (B200: torch's block-scaled GEMMs; on
sm_90 they are emulated in float32).

The ideal (the rules of ``benchmarks/traffic.py``'s docstring, per element of x, W, dY): one read
of each high-precision operand per pass that must finish before its cast (current scaling needs
the amax first: one extra read; delayed scaling and per-block scales none), each FP8 layout a
GEMM needs written once, amax fused into a pass, the weight gradient written by its GEMM in
fp32: ``traffic.py``'s table (``mxfp8``: one 32x32 tile gives both layouts' scales, one read;
``nvfp4``: a per-tensor amax first, then 4-bit values, with the block scales' bytes, 1 byte per
16 elements and layout, which are not small beside 4-bit data). Nothing for padding, routing or the combine: those are outside this GEMM.

``bf16`` is the same GEMMs in bf16 (``torch._grouped_mm``; the fp32 weight cast to bf16 per
call, its gradient cast back), as ``torch.autocast`` runs transformers' grouped experts.
torchao's grouped FP8 path (``torchao.prototype.moe_training``) is traced where it imports and
runs on meta tensors; where it cannot, its row says exactly why (no number is made up).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import traffic as dense  # noqa: E402
from _common import write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.modules.grouped import Float8GroupedGemm  # noqa: E402
from lowprec.fp8.kernels.select import DISABLE_ENV, triton_importable  # noqa: E402
from lowprec.fp8.observe.traffic import trace_grouped  # noqa: E402

TOKENS, TOP_K = 8192, 8
# name: (E, K, N)
SHAPES = {"deepseek-v3": (256, 7168, 2048), "qwen3-30b-a3b": (128, 2048, 768)}
TINY = {"tiny": (8, 256, 128)}
TINY_TOKENS = 64
RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4")
# the compute capability each recipe is traced as (see the module docstring)
SM = {"mxfp8": (10, 0), "nvfp4": (10, 0)}
TARGET_RATIO = 1.15  # issue 25: traced non-GEMM bytes of the grouped path <= 1.15x its ideal


# what was found tracing torchao 0.18's grouped path (docs/LOG.md, 2026-11-28, session 13)
TORCHAO_NOTE = (
    "torchao.prototype.moe_training's FP8 rowwise grouped path casts with Triton kernels that its "
    "kernels module defines only where torch.utils._triton.has_triton() is true (a CUDA device with "
    "triton); elsewhere the names are stubs raising NotImplementedError, which is what a trace on meta "
    "tensors meets. Forcing has_triton() true does not help with triton 3.9: the module fails to import "
    "(triton.autotune key 'num_elements' is not an argument of its 3-D column-wise kernel). Its MXFP8 "
    "grouped path asserts its SM100 C++ kernels are loaded (its EMULATED mode is another path, not "
    "traced). No torchao number is given: none could be counted."
)


def ideal_bytes(recipe: str, experts: int, rows: int, k: int, n: int) -> int:
    """The ideal bytes outside the GEMMs of one grouped fwd+bwd (``rows`` routed tokens)."""
    bx, bw, bdy = dense.IDEAL_BYTES_PER_ELEMENT[recipe]
    return round(bx * rows * k + bw * experts * n * k + bdy * rows * n)


def even_counts(experts: int, rows: int) -> tuple[int, ...]:
    base, extra = divmod(rows, experts)
    return tuple(base + (e < extra) for e in range(experts))


def skewed_counts(experts: int, rows: int) -> tuple[int, ...]:
    """A deterministic uneven routing: expert ``e`` takes a share ``1 / (e % 16 + 1)`` (16 to 1
    between the busiest and the quietest), rounded by largest remainder; groups are then not
    multiples of 16 rows, so the grouped kernels' padding and the weight gradients' padded
    contraction show."""
    weights = [1.0 / (e % 16 + 1) for e in range(experts)]
    exact = [rows * w / sum(weights) for w in weights]
    counts = [int(v) for v in exact]
    for e in sorted(range(experts), key=lambda e: counts[e] - exact[e])[: rows - sum(counts)]:
        counts[e] += 1
    return tuple(counts)


ROUTINGS = {"even": even_counts, "skewed": skewed_counts}


def lowprec_make(name: str):
    recipe = fp8.Recipe.from_name(name)

    def make(experts: int):
        gemm = Float8GroupedGemm(experts, recipe).to("meta")
        return lambda x, w, counts: gemm(x, w, counts, recipe, torch.bfloat16)

    return make


def _offs(counts, device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def bf16_make(experts: int):
    # torch.autocast(bf16) around a grouped GEMM: the fp32 weight cast to bf16 per call (autograd
    # casts its gradient back), one bf16 grouped GEMM per direction
    return lambda x, w, counts: torch._grouped_mm(
        x, w.to(torch.bfloat16).transpose(-2, -1), offs=_offs(counts, x.device)
    )


def torchao_make(experts: int):
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    def run(x, w, counts):
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            x,
            w.transpose(-2, -1),  # (E, K, N) column-major, as it asks
            _offs(counts, x.device),
            out_dtype=torch.bfloat16,
            pad_token_groups_for_grouped_mm=False,  # groups are multiples of 16 here
        )

    return run


def torchao_mxfp8_make(experts: int):
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    return lambda x, w, counts: _to_mxfp8_then_scaled_grouped_mm(
        x, w.transpose(-2, -1), _offs(counts, x.device), out_dtype=torch.bfloat16
    )


def _row(variant: str, counter, **extra) -> dict:
    outside = counter.outside_gemm_bytes()
    row = {
        "variant": variant,
        "outside_gemm_bytes": outside,
        "outside_gemm_gb": round(outside / 1e9, 3),
        "ops_outside_gemm": sum(1 for r in counter.records if not r.gemm),
        "gemm_calls": len(counter.gemms()),
        "gemm_ops": sorted({f"{g.name} {g.operand_dtype}" for g in counter.gemms()}),
        "top_ops": {name: d for name, d in list(counter.by_op().items())[:6]},
        **extra,
    }
    if "ideal_outside_gemm_bytes" in row:
        row["ratio_to_ideal"] = round(outside / row["ideal_outside_gemm_bytes"], 3)
        row["meets_target"] = row["ratio_to_ideal"] <= TARGET_RATIO
    return row


def trace_recipe(name: str, experts: int, k: int, n: int, rows: int, triton: bool | None = None, routing: str = "even"):
    sm = SM.get(name, (9, 0))
    triton = triton_importable() if triton is None else triton
    return trace_grouped(lowprec_make(name), ROUTINGS[routing](experts, rows), k, n, sm=sm, triton=triton)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:400]


def trace_shape(
    label: str, experts: int, k: int, n: int, rows: int, recipes, torchao: bool, routing: str = "even"
) -> list[dict]:
    counts = ROUTINGS[routing](experts, rows)
    shape = {"shape": label, "E": experts, "K": k, "N": n, "rows": rows, "routing": routing}
    out = [_row("bf16", trace_grouped(bf16_make, counts, k, n, triton=False), **shape)]
    for name in recipes:
        sm = SM.get(name, (9, 0))
        try:
            counter = trace_recipe(name, experts, k, n, rows, routing=routing)
        except Exception as e:  # noqa: BLE001 - report, do not hide
            out.append({"variant": name, **shape, "error": _error(e)})
            continue
        out.append(
            _row(
                name,
                counter,
                **shape,
                recipe=name,
                traced_as=f"sm_{sm[0]}{sm[1]}",
                path="fused Triton casts" if triton_importable() else "torch ops",
                ideal_outside_gemm_bytes=ideal_bytes(name, experts, rows, k, n),
            )
        )
    if torchao:
        for variant, make, sm in (
            ("torchao_fp8_rowwise_grouped", torchao_make, (9, 0)),
            ("torchao_mxfp8_grouped", torchao_mxfp8_make, (10, 0)),
        ):
            try:
                counter = trace_grouped(make, counts, k, n, sm=sm, triton=triton_importable())
            except Exception as e:  # noqa: BLE001 - say exactly why it could not be traced
                out.append({"variant": variant, **shape, "error": _error(e)})
                continue
            out.append(_row(variant, counter, **shape))
    return out


def _line(r: dict) -> str:
    head = f"{r['routing']:7s} {r['shape']:14s} {r['variant']:30s}"
    if "error" in r:
        return f"{head} error: {r['error'][:160]}"
    ideal = r.get("ideal_outside_gemm_bytes")
    cols = [
        f"{r['outside_gemm_gb']:13.3f}G",
        f"{ideal / 1e9:8.3f}G" if ideal else " " * 9,
        f"{r['ratio_to_ideal']:6.2f}" if ideal else " " * 6,
        f"{r['ops_outside_gemm']:6d}",
    ]
    return " ".join([head, *cols])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help=f"shape {TINY} with {TINY_TOKENS} tokens instead")
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--routing", default="even,skewed", help="even (the target's rows), skewed (uneven groups), or both")
    p.add_argument("--out", help="JSON path (default benchmarks/results/grouped_traffic[_tiny].json)")
    args = p.parse_args(argv)
    shapes = TINY if args.tiny else SHAPES
    rows = (TINY_TOKENS if args.tiny else args.tokens) * args.top_k
    recipes = [r for r in args.recipes.split(",") if r]
    os.environ.pop(DISABLE_ENV, None)  # trace_as decides the path
    results = []
    for routing in [r for r in args.routing.split(",") if r]:
        for label, (experts, k, n) in shapes.items():
            torchao = not args.no_torchao and routing == "even"
            results += trace_shape(label, experts, k, n, rows, recipes, torchao, routing)
    print(f"one grouped expert GEMM fwd+bwd, {rows} routed rows, x bf16, W fp32 master")
    print(
        f"{'routing':7s} {'shape':14s} {'variant':30s} {'outside GEMMs':>14s} {'ideal':>9s} {'ratio':>6s} {'ops':>6s}"
    )
    for r in results:
        print(_line(r))
    payload = {
        "device": "none: traced on meta tensors as CUDA (lowprec.fp8.trace_as); no kernel ran",
        "routing": f"{rows} routed rows ({'tiny' if args.tiny else args.tokens} tokens x top-{args.top_k}); "
        "even: S / E rows per expert (the target's rows); skewed: expert e takes a share 1 / (e % 16 + 1) "
        "(benchmarks/grouped_traffic.py skewed_counts), groups not multiples of 16",
        "operands": {"x": "bfloat16 (rows, K)", "weight": "float32 master (E, N, K)", "dY": "bfloat16 (rows, N)"},
        "shapes": {label: {"E": e, "K": k, "N": n} for label, (e, k, n) in shapes.items()},
        "traced_as": {name: "sm_{}{}".format(*SM.get(name, (9, 0))) for name in recipes},
        "target_ratio_to_ideal": TARGET_RATIO,
        "torchao_note": TORCHAO_NOTE,
        "triton_installed": triton_importable(),
        "results": results,
    }
    write_json(payload, args.out, "grouped_traffic_tiny.json" if args.tiny else "grouped_traffic.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
