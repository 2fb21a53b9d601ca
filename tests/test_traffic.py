"""Traffic accounting (lowprec.fp8.observe.traffic, fp8.trace_as, benchmarks/traffic.py).

Byte counts are exact and deterministic (meta tensors, no kernel runs), so they are asserted
as numbers: the counter against hand-computed formulas, and every recipe's bytes outside the
GEMMs against a budget. Nothing here is timed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.gemm.dispatch import native_scaled_mm_available
from lowprec.fp8.kernels import available
from lowprec.fp8.kernels.select import triton_importable
from lowprec.fp8.observe.traffic import ByteCounter, tensor_bytes, trace_linear

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import traffic as bench  # noqa: E402

M, K, N = 16384, 4096, 14336


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_a_bf16_matmul_counts_its_operands_and_output():
    a, b = meta(300, 200), meta(200, 100)
    with ByteCounter() as c:
        a @ b
    (rec,) = c.records
    assert rec.gemm and rec.name == "aten.mm" and rec.operand_dtype == "bfloat16"
    assert rec.read == 2 * (300 * 200 + 200 * 100) and rec.written == 2 * 300 * 100
    assert rec.flops == 2 * 300 * 200 * 100
    assert c.outside_gemm_bytes() == 0


def test_views_are_free_and_elementwise_ops_count_every_pass():
    x = meta(64, 32, dtype=torch.float32)
    s = meta((), dtype=torch.float32)
    with ByteCounter() as c:
        y = x.t().t().view(-1).view(32, 64)  # views: nothing moves
        z = x * s.expand(64, 32)  # a broadcast scalar is read once: 4 bytes, not 64*32*4
        z.clamp_(-1, 1)  # in place: read and write
        z.copy_(x)  # copy_ writes its destination without reading it
        y.to(torch.bfloat16)
    assert [r.name for r in c.records] == ["aten.mul", "aten.clamp_", "aten.copy_", "aten._to_copy"]
    mul, clamp, copy, cast = c.records
    assert (mul.read, mul.written) == (64 * 32 * 4 + 4, 64 * 32 * 4)
    assert (clamp.read, clamp.written) == (64 * 32 * 4, 64 * 32 * 4)
    assert (copy.read, copy.written) == (64 * 32 * 4, 64 * 32 * 4)
    assert (cast.read, cast.written) == (64 * 32 * 4, 64 * 32 * 2)
    assert tensor_bytes(s.expand(5, 7)) == 4


def test_trace_as_sets_the_dispatch_decisions_and_restores_them():
    dev = torch.device("meta")
    assert not native_scaled_mm_available(dev) and not available(dev)
    with fp8.trace_as(sm=(8, 9), triton=False):
        assert native_scaled_mm_available(dev, "tensor") and not native_scaled_mm_available(dev, "axis")
        assert not available(dev)
        with fp8.trace_as(sm=(9, 0), triton=False):
            assert native_scaled_mm_available(dev, "axis")
        assert not native_scaled_mm_available(dev, "axis")
    assert not native_scaled_mm_available(dev)
    assert not available("cpu")
    with pytest.raises(ValueError, match="major, minor"):
        with fp8.trace_as(sm=(9,)):
            pass


def test_bf16_baseline_is_the_weight_cast_and_its_gradient_cast():
    c = trace_linear(bench._bf16, M, K, N, triton=False)
    # fp32 -> bf16 weight copy (4 + 2 bytes/element) and the bf16 -> fp32 weight gradient (2 + 4)
    assert c.outside_gemm_bytes() == 2 * 6 * N * K
    assert [g.operand_dtype for g in c.gemms()] == ["bfloat16"] * 3


@pytest.mark.parametrize("recipe", bench.RECIPES)
def test_counts_are_deterministic_and_the_gemms_are_fp8(recipe):
    sm = bench.SM.get(recipe, (9, 0))  # mxfp8 as sm_100, where its block-scaled GEMMs run
    if recipe == "nvfp4":  # its E2M1 rounding tables are built once per device, at the first call
        trace_linear(bench._lowprec(recipe), 512, 256, 384, triton=False, sm=sm)
    a = trace_linear(bench._lowprec(recipe), 512, 256, 384, triton=False, sm=sm)
    b = trace_linear(bench._lowprec(recipe), 512, 256, 384, triton=False, sm=sm)
    assert [(r.name, r.read, r.written) for r in a.records] == [(r.name, r.read, r.written) for r in b.records]
    dtypes = [g.operand_dtype for g in a.gemms()]
    assert len(dtypes) == 3
    if recipe == "rowwise_with_gw_hp":  # its weight-gradient GEMM is bf16 by definition
        assert dtypes[:2] == ["float8_e4m3fn"] * 2 and dtypes[2] == "bfloat16"
    elif recipe == "nvfp4":  # 4-bit GEMMs (the random Hadamard rotation is a butterfly, no GEMM)
        assert dtypes == ["float4_e2m1fn_x2"] * 3, dtypes
    else:  # blockwise too: torch's blockwise kernel on sm_90
        assert all(d.startswith("float8") for d in dtypes), dtypes


def run_tiny(script: str, out: Path, *args: str) -> dict:
    """``benchmarks/<script> --tiny <args> --out <out>`` in a fresh interpreter; its JSON."""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", *args, "--out", str(out)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return json.loads(out.read_text())


def test_benchmark_tiny_writes_its_json(tmp_path):
    data = run_tiny("traffic.py", tmp_path / "t.json")
    assert {"command", "date", "torch", "device", "results", "estimate"} <= set(data)
    assert "ESTIMATE" in data["estimate"]["label"]
    rows = {r["variant"]: r for r in data["results"]}
    assert {"bf16", *bench.RECIPES} <= set(rows)
    for name in bench.RECIPES:
        assert rows[name]["outside_gemm_bytes"] >= rows[name]["ideal_outside_gemm_bytes"] > 0


# Bytes outside the GEMMs on the CUDA default path (fused casts) at the issue's shape, in GB:
# issue 9's targets (tensorwise 2.8, delayed 2.0, rowwise 3.5, blockwise 3.5 on torch's blockwise
# FP8 GEMM, traced as sm_90: 1.97 reached), and for rowwise_with_gw_hp,
# which has none, the level this branch reached (2.20).
# mxfp8 (traced as sm_100): the level its one-kernel casts reached (2.22; 27.0 with torch ops).
BUDGET_GB = {
    "tensorwise": 2.8,
    "delayed": 2.0,
    "rowwise": 3.5,
    "rowwise_with_gw_hp": 2.25,
    "blockwise": 3.5,
    "mxfp8": 2.25,
}


@pytest.mark.skipif(not triton_importable(), reason="the fused ops' fake implementations come from triton")
@pytest.mark.parametrize("recipe", sorted(BUDGET_GB))
def test_bytes_outside_the_gemms_within_budget_on_the_cuda_default_path(recipe):
    sm = bench.SM.get(recipe, (9, 0))
    c = trace_linear(bench._lowprec(recipe), M, K, N, triton=True, sm=sm)
    assert c.outside_gemm_bytes() <= BUDGET_GB[recipe] * 1e9, c.by_op()
    assert c.outside_gemm_bytes() >= bench.ideal_bytes(recipe, M, K, N)
    # no transpose copies on the GEMM path: every FP8 layout comes from a fused cast
    clones = c.by_op().get("aten.clone", {"bytes": 0})["bytes"]
    if recipe == "mxfp8":  # the six GEMM operands' E8M0 scales (a byte per 32 elements) swizzled: read + written
        assert clones <= 2 * 2 * (M * K + N * K + M * N) / 32, c.by_op()
    else:
        assert clones == 0 or recipe == "rowwise_with_gw_hp", c.by_op()
    torch_path = trace_linear(bench._lowprec(recipe), M, K, N, triton=False, sm=sm)
    assert torch_path.outside_gemm_bytes() > 2 * c.outside_gemm_bytes()


# nvfp4 (traced as sm_100): the level its casts reach (2.17 GB against an ideal 2.08: x and dY each
# read twice, once for both their tensor amaxes and once for both their casts; the weight an amax
# read and a cast read; 3.38 GB with the four reads of x and dY, 80.8 GB with torch ops alone)
NVFP4_LEVEL_GB = 2.2


@pytest.mark.skipif(not triton_importable(), reason="the fused ops' fake implementations come from triton")
def test_nvfp4_bytes_outside_the_gemms_within_its_level():
    """NVFP4 on the CUDA default path: the weight through ``lowprec::cast_nvfp4`` (both layouts from one
    read) after a ``lowprec::amax``; x and dY each through ``lowprec::nvfp4_dual_amax`` (amax(t) and
    amax(RHT(t)) from one read) and ``lowprec::cast_nvfp4_dual`` (the 1x16 operand and the Hadamard-
    rotated weight-gradient operand from one read, dY's two stochastic-rounding streams in the kernel)."""
    c = trace_linear(bench._lowprec("nvfp4"), M, K, N, triton=True, sm=bench.SM["nvfp4"])
    assert bench.ideal_bytes("nvfp4", M, K, N) <= c.outside_gemm_bytes() <= NVFP4_LEVEL_GB * 1e9, c.by_op()
    ops = c.by_op()
    assert ops["lowprec.cast_nvfp4"]["calls"] == ops["lowprec.amax"]["calls"] == 1, ops
    assert ops["lowprec.cast_nvfp4_dual"]["calls"] == ops["lowprec.nvfp4_dual_amax"]["calls"] == 2, ops
    assert "lowprec.cast_nvfp4_rht" not in ops and "lowprec.rht_amax" not in ops, ops
    assert "aten.bucketize" not in ops and "aten.rand" not in ops, ops


def test_ideal_bytes_are_the_issues_figures():
    assert round(bench.ideal_bytes("tensorwise", M, K, N) / 1e9, 1) == 2.4
    assert round(bench.ideal_bytes("delayed", M, K, N) / 1e9, 1) == 1.6 <= 2.0


@pytest.mark.skipif(not triton_importable(), reason="the fused ops' fake implementations come from triton")
def test_delayed_bookkeeping_is_a_few_ops_on_the_cuda_default_path():
    """Per operand: cast (both layouts + amax), one state-update kernel, the conditional re-cast."""
    fused = trace_linear(bench._lowprec("delayed"), 512, 256, 384, triton=True)
    plain = trace_linear(bench._lowprec("delayed"), 512, 256, 384, triton=False)
    names = [r.name for r in fused.records if not r.gemm]
    assert names.count("lowprec.delayed_scale_update") == 3 and names.count("lowprec.recast_if_changed") == 3
    assert len(names) <= 20 < len([r for r in plain.records if not r.gemm])
