"""A roofline cost model of Float8Linear fwd+bwd against bf16, and the ``auto`` layer filter.

Why: FP8 loses on small GEMMs. The casts are memory passes (read bf16, find the amax, write FP8
and, for Hopper's TN-only GEMM, a transposed copy), and their cost only amortises when K and N
are large (torchao's rowwise speedups run from 0.43x at 4096x4096x2048 to 1.73x at 32768^2x16384,
reference fp8-engines.md section 1.7). The ``auto`` filter converts a Linear only where this
model predicts FP8 to be faster on the target device, so that no converted layer is slower than
its bf16 twin.

Model (per fwd+bwd of one Linear, M tokens, K in, N out), all GEMMs ``max(compute, memory)``:

    bf16:  3 GEMMs of 2MKN flops at the bf16 rate; operands 2 B, outputs 2 B
    fp8:   the FP8 GEMMs at the FP8 rate (operands 1 B), high-precision GEMMs at the bf16 rate,
           plus the casts: per cast, ``amax pass + read + FP8 write (+ transposed write)``
           bytes at memory bandwidth, plus a fixed overhead per cast kernel.

The efficiency constants were fitted to torchao's published H100 rowwise table (72 shapes)
and its two tensorwise points by ``benchmarks/fit_cost_model.py``; ``tests/test_fp8_cost_model.py``
checks the fit. Per-device profiles hold datasheet peaks. These are published numbers, not
ours: on a lent GPU, ``benchmarks/linear.py`` measures the real table, and a profile can be
re-fitted from its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

from torch import nn

from lowprec.catalog import Granularity
from lowprec.fp8.modules.experts import experts_layout
from lowprec.fp8.recipes import Recipe

__all__ = ["DeviceProfile", "PROFILES", "predict_speedup", "predict_seconds", "auto_module_filter"]


@dataclass(frozen=True)
class DeviceProfile:
    """Peak rates of one device and the fitted efficiencies of the model."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    mem_gbs: float
    gemm_eff: float = 0.70  # achieved / peak on large bf16 GEMMs
    fp8_gemm_eff: float = 0.70  # the same share of the (2x) FP8 peak
    mem_eff: float = 0.40  # casts reach well under peak bandwidth (amax reductions, transposes)
    cast_overhead_us: float = 10.0  # per cast kernel (launch + tail)
    small_gemm_flops: float = 3e10  # below this, GEMMs lose efficiency (wave quantisation)
    block_scaled: bool = False  # an MXFP8/NVFP4 datapath (sm_100+); H100/H200 have none


# Datasheet peaks (dense): H100 SXM 989 bf16 / 1979 fp8 TFLOPS, 3.35 TB/s; H200 the same
# compute, 4.8 TB/s (reference section 5.1). Efficiencies: see benchmarks/fit_cost_model.py.
PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("H100 SXM", 989.0, 1979.0, 3350.0),
    "h200": DeviceProfile("H200", 989.0, 1979.0, 4800.0),
}


def _gemm_s(m: int, k: int, n: int, tflops: float, eff: float, in_bytes: float, p: DeviceProfile) -> float:
    flops = 2.0 * m * k * n
    # small GEMMs cannot fill the chip: efficiency falls off below ``small_gemm_flops``
    eff = eff * min(1.0, (flops / p.small_gemm_flops) ** 0.25)
    compute = flops / (tflops * 1e12 * eff)
    memory = (in_bytes * (m * k + k * n) + 2.0 * m * n) / (p.mem_gbs * 1e9 * p.mem_eff)
    return max(compute, memory)


def _cast_s(elements: int, passes: int, transposed: bool, p: DeviceProfile) -> float:
    """Seconds of ``passes`` casts of a bf16 tensor to FP8: an amax pass, then read + FP8 write
    (+ the transposed write). Delayed scaling pays the amax pass too in lowprec today: its
    history needs the current amax, which the fused kernel computes but does not yet feed
    back (TransformerEngine saves this pass; see docs/LOG.md)."""
    per = 2 + 2 + 1 + (1 if transposed else 0)
    return passes * (elements * per / (p.mem_gbs * 1e9 * p.mem_eff) + p.cast_overhead_us * 1e-6)


def _times(m: int, k: int, n: int, recipe: Recipe, p: DeviceProfile) -> tuple[float, float]:
    bf16 = 3 * _gemm_s(m, k, n, p.bf16_tflops, p.gemm_eff, 2, p)
    olp = recipe.override_linear_precision
    shapes = [(m, k, n), (m, n, k), (n, m, k)]  # fprop, dgrad, wgrad
    fp8 = 0.0
    for (a, b, c), hp in zip(shapes, olp):
        fp8 += (
            _gemm_s(a, b, c, p.bf16_tflops, p.gemm_eff, 2, p)
            if hp
            else _gemm_s(a, b, c, p.fp8_tflops, p.fp8_gemm_eff, 1, p)
        )
    if recipe.per_tensor:
        # one cast per operand, each also writing the transposed copy the other GEMM needs
        fp8 += _cast_s(m * k, 1, True, p) + _cast_s(n * k, 1, True, p) + _cast_s(m * n, 1, True, p)
    else:
        # rowwise / blockwise: each operand is cast once per GEMM that uses it in FP8
        x_casts = (not olp[0]) + (not olp[2])
        w_casts = (not olp[0]) + (not olp[1])
        g_casts = (not olp[1]) + (not olp[2])
        fp8 += _cast_s(m * k, x_casts, False, p) + _cast_s(n * k, w_casts, False, p) + _cast_s(m * n, g_casts, False, p)
    return bf16, fp8


def predict_seconds(
    m: int, k: int, n: int, recipe: Recipe | str, device: str | DeviceProfile = "h100"
) -> tuple[float, float]:
    """The model's (bf16, FP8) seconds for one Linear's fwd+bwd: an ESTIMATE, which the GPU
    command (benchmarks/gpu) prints beside the measured times so that it can be checked."""
    recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
    p = PROFILES[device.lower()] if isinstance(device, str) else device
    if recipe.kind.info.granularity is Granularity.MICRO and not p.block_scaled:
        raise ValueError(
            f"no speed model for the {recipe.scaling} recipe on {p.name}: it has no MXFP8/NVFP4 "
            "GEMMs (sm_100+) and lowprec runs them emulated there; pick another recipe or device"
        )
    return _times(m, k, n, recipe, p)


def predict_speedup(m: int, k: int, n: int, recipe: Recipe | str, device: str | DeviceProfile = "h100") -> float:
    """Predicted bf16 time / FP8 time of one Linear's fwd+bwd (compiled, fused casts)."""
    bf16, fp8 = predict_seconds(m, k, n, recipe, device)
    return bf16 / fp8


def auto_module_filter(
    tokens_per_step: int,
    recipe: Recipe | str,
    device: str | DeviceProfile = "h100",
    *,
    min_speedup: float = 1.0,
    base_filter: Callable[[nn.Module, str], bool] | None = None,
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter`` for ``fp8.convert``: convert a Linear only where FP8 is predicted at
    least ``min_speedup`` times faster than bf16 for ``tokens_per_step`` rows (micro-batch x
    sequence length). ``base_filter`` (e.g. skipping ``lm_head``) is applied first.

    A mixture-of-experts module is judged per expert GEMM at the rows an expert gets when the
    router spreads the ``tokens_per_step x top_k`` routed rows evenly (``top_k``: the module's or
    its config's ``num_experts_per_tok``, else 1): both projections must be predicted faster."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1 (micro_batch_size x sequence_len), got {tokens_per_step}")

    def keep(module: nn.Module, fqn: str) -> bool:
        if base_filter is not None and not base_filter(module, fqn):
            return False
        layout = experts_layout(module)
        if layout is not None:
            top_k = getattr(module, "num_experts_per_tok", None) or getattr(
                getattr(module, "config", None), "num_experts_per_tok", None
            )
            rows = max(1, tokens_per_step * int(top_k or 1) // layout.num_experts)
            return all(
                predict_speedup(rows, *layout.dims(module, p), recipe, device) >= min_speedup
                for p in layout.projections
            )
        linear = cast(nn.Linear, module)  # otherwise convert asks about Linear layers
        k, n = linear.in_features, linear.out_features
        if k % 16 or n % 16:
            return False
        return predict_speedup(tokens_per_step, k, n, recipe, device) >= min_speedup

    return keep
