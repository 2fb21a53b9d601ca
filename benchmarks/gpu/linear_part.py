"""Linear part of the GPU command: Float8Linear fwd+bwd at the Llama-3-8B shapes, measured
beside its two estimates.

    python3 benchmarks/gpu/linear_part.py --out linear.json            # CUDA: M=16384, the 8B shapes
    python3 benchmarks/gpu/linear_part.py --out linear.json --dry-run  # CPU, tiny shapes

Per shape and variant (bf16 AMP, every lowprec recipe this GPU runs natively, torchao
tensorwise/rowwise): the median fwd+bwd milliseconds (CUDA events, after warm-up; timing by
``benchmarks/linear.py``), eager and ``torch.compile``d, and beside it

* ``traced_outside_gemm_bytes`` and ``roofline_ms``: the bytes the CUDA path moves outside the
  GEMMs, traced on meta tensors as an sm_90 GPU (``benchmarks/traffic.py``), and the roofline
  ESTIMATE from them (H100 achieved rates). torchao is traced eager (its casts unfused);
* ``cost_model_ms``: ``lowprec.fp8.observe.cost_model.predict_seconds`` (the ``auto`` filter's model,
  which assumes fused casts), an ESTIMATE;
* ``measured_over_roofline``: how far the measured time is from the roofline (1.0 = on it).

Order: eager at every shape, then compiled at the target shape (16384x4096x14336), then
compiled at the others (the rehearsal compiles the first shape's bf16, tensorwise and torchao only); the JSON is rewritten after each step, so a part stopped at its time
budget keeps what it measured (``complete: false``). Warnings logged by lowprec (a fused kernel
falling back, say) are collected into ``lowprec_warnings``.
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
from _common import device_name, replace_json  # noqa: E402
from linear import bench_shape  # noqa: E402

from lowprec.catalog import RECIPES, Granularity  # noqa: E402
import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.observe.cost_model import predict_seconds  # noqa: E402
from lowprec.fp8.kernels.select import triton_importable  # noqa: E402
from lowprec.fp8.gemm.mx import native_block_scaled_available  # noqa: E402

# (M, K, N, name): Llama-3-8B's projections at 16384 tokens (qkv and gate+up fused), and the
# issue's target shape (one of gate/up)
SHAPES = [
    (16384, 4096, 14336, "gate (target)"),
    (16384, 4096, 6144, "qkv"),
    (16384, 4096, 4096, "o"),
    (16384, 4096, 28672, "gate+up"),
    (16384, 14336, 4096, "down"),
]
TINY = [(128, 128, 256, "tiny-a"), (128, 256, 128, "tiny-b")]
BLOCK_SCALED = tuple(n for n, r in RECIPES.items() if r.granularity is Granularity.MICRO)  # sm_100+ GEMMs


def supported_recipes(device: torch.device, sm: tuple[int, int] | None = None) -> list[str]:
    """Every recipe name whose GEMMs run natively here (MXFP8/NVFP4 only with block-scaled GEMMs,
    sm_100+); with ``sm``, decided as on a GPU of that capability (the rehearsal: sm_90)."""
    if sm is not None:
        with fp8.trace_as(sm=sm, triton=False):
            native = native_block_scaled_available(torch.device("meta"))
    else:
        native = native_block_scaled_available(device)
    return [r for r in fp8.RECIPE_NAMES if native or r not in BLOCK_SCALED]


def estimates(m: int, k: int, n: int, recipes: list[str], torchao: bool) -> dict[str, dict]:
    """variant -> traced bytes outside the GEMMs, roofline and cost-model ESTIMATES (ms)."""
    import traffic  # benchmarks/traffic.py: imported here, its module import traces nothing

    from lowprec.fp8.observe.traffic import trace_linear

    out: dict[str, dict] = {}
    builds = {"bf16": traffic._bf16, **{r: traffic._lowprec(r) for r in recipes if r not in BLOCK_SCALED}}
    if torchao:
        builds.update({f"torchao_{r}": traffic._torchao(r) for r in ("tensorwise", "rowwise")})
    bf16_s = None
    for name, build in builds.items():
        try:
            counter = trace_linear(build, m, k, n, sm=(9, 0), triton=name in recipes and triton_importable())
            row = {
                "traced_outside_gemm_bytes": counter.outside_gemm_bytes(),
                "roofline_ms": round(traffic.estimate_ms(counter), 4),
            }
        except Exception as e:  # noqa: BLE001 - an estimate that cannot be made is reported
            row = {"estimate_error": f"{type(e).__name__}: {e}"[:200]}
        if name in recipes:
            bf16_s, fp8_s = predict_seconds(m, k, n, name)
            row["cost_model_ms"] = round(fp8_s * 1e3, 4)
        out[name] = row
    if bf16_s is not None:
        out["bf16"]["cost_model_ms"] = round(bf16_s * 1e3, 4)
    return out


def _torchao_importable() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return False
    return True


class _Collect(logging.Handler):
    """Every distinct log line at ``level`` and up (a kernel's fallback and its reason, say)."""

    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()[:300]
        if msg not in self.messages:
            self.messages.append(msg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, compiled with the 'eager' backend")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("linear_part.py measures a CUDA GPU; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SHAPES if cuda else TINY
    recipes = supported_recipes(device) if cuda else supported_recipes(device, sm=(9, 0))
    iters, warmup = a.iters or (20 if cuda else 1), a.warmup if a.warmup is not None else (5 if cuda else 0)
    # the rehearsal traces with Dynamo but skips Inductor's code generation (minutes on 2 CPU cores)
    backend = "inductor" if cuda else "eager"
    # one Float8Linear.forward code object is compiled per variant and shape: lift Dynamo's
    # per-code cache limit, and keep shapes static (each is timed as its own kernel set)
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    torch._dynamo.config.automatic_dynamic_shapes = False
    warnings = _Collect()
    logging.getLogger("lowprec").addHandler(warnings)
    torchao = _torchao_importable()
    payload = {
        "benchmark": "gpu/linear",
        "device": device_name(device),
        "torch": torch.__version__,
        "dry_run": a.dry_run,
        "recipes": recipes,
        "torchao": torchao,
        "compile_backend": backend,
        "iters": iters,
        "warmup": warmup,
        "timing": "median ms of fwd+bwd after warm-up (CUDA events on GPU)",
        "estimate_label": "ESTIMATES, not measurements: roofline at H100 SXM achieved rates (traced as sm_90) "
        "and lowprec's cost model (datasheet peaks x fitted efficiencies)",
        "shapes": [{"M": m, "K": k, "N": n, "name": nm} for m, k, n, nm in shapes],
        "estimates": {},
        "results": [],
        "steps_done": [],
        "complete": False,
    }
    out = Path(a.out)

    def save():
        payload["lowprec_warnings"] = warnings.messages
        replace_json(out, payload)

    t0 = time.monotonic()
    for m, k, n, _ in shapes:
        payload["estimates"][f"{m}x{k}x{n}"] = estimates(m, k, n, recipes, torchao)
    payload["estimate_seconds"] = round(time.monotonic() - t0, 1)
    save()
    plan = [("eager", s, recipes) for s in shapes] + [("compiled", s, recipes) for s in shapes]
    if not cuda:  # the rehearsal compiles one shape and one recipe (Dynamo: seconds per variant on 2 cores)
        plan = plan[: len(shapes)] + [("compiled", shapes[0], ["tensorwise"])]
    torch.manual_seed(0)
    for mode, (m, k, n, name), step_recipes in plan:
        t0 = time.monotonic()
        torch._dynamo.reset()
        rows = bench_shape(m, k, n, device, step_recipes, [mode], iters, warmup, compile_backend=backend)
        est = payload["estimates"][f"{m}x{k}x{n}"]
        for r in rows:
            r["shape_name"] = name
            r.update(est.get(r["variant"], {}))
            if "ms" in r and "roofline_ms" in r and cuda:
                r["measured_over_roofline"] = round(r["ms"] / r["roofline_ms"], 3)
            print(json.dumps(r), flush=True)
        payload["results"] += rows
        payload["steps_done"].append(
            {"mode": mode, "shape": f"{m}x{k}x{n}", "seconds": round(time.monotonic() - t0, 1)}
        )
        save()
        if cuda:
            torch.cuda.empty_cache()
    payload["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
