"""Bytes outside the GEMMs of the grouped expert GEMMs (issue 25, benchmark item 5), traced on meta
tensors as CUDA (``lowprec.fp8.observe.traffic.trace_grouped``, ``benchmarks/grouped_traffic.py``).

Exact and deterministic (no kernel runs, nothing is timed), so each recipe's bytes are asserted
against a budget: a ratio to the ideal of ``benchmarks/grouped_traffic.py`` at the DeepSeek-V3
(E=256, K=7168, N=2048) and Qwen3-30B-A3B (E=128, K=2048, N=768) shapes, 8192 tokens x top-8
routed evenly. The issue's target is 1.15x; a budget above it is the level reached, and
docs/LOG.md says why the rest is not reached yet.
"""

import sys
from pathlib import Path

import pytest
import torch

from lowprec.fp8.kernels.select import triton_importable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import grouped_traffic as bench  # noqa: E402
from tests.test_traffic import run_tiny  # noqa: E402

ROWS = bench.TOKENS * bench.TOP_K
# ratio to the ideal, per recipe: (deepseek-v3, qwen3-30b-a3b). tensorwise, delayed and the rowwise
# kinds meet the target (tensorwise 0.91 / 0.94, delayed 0.85 / 0.90: below 1 because
# grad_input reads the weights' one FP8 layout where the Triton grouped GEMM runs it, and the ideal
# counts two); the others are the levels reached
BUDGET = {
    "tensorwise": (bench.TARGET_RATIO, bench.TARGET_RATIO),
    "delayed": (0.87, 0.92),
    # every axis cast written into one buffer per operand, the weight read once for both its casts
    # (1.016 / 1.033; the rest is the column scales' arithmetic per group and expert). Before: 1.77 /
    # 1.67 (stack, cat, the weight re-cast in backward); 2.32 / 2.06 before grad_weight's one launch
    "rowwise": (1.03, 1.05),
    # the one-call path, grad_weight a bf16 GEMM per expert writing its float32 slice (1.001 / 1.004;
    # 2.97 / 2.86 on the per-expert loop: the experts' gradients stacked, the groups concatenated)
    "rowwise_with_gw_hp": (1.02, 1.02),
    # blockwise traced as sm_90: output and grad_input on torch's blockwise GEMM per expert, as the
    # dense layer runs them, each writing its rows of one buffer; the experts' weights cast once, in
    # one pass (both layouts); grad_weight of all experts in one Triton launch, float32 in place (1.01 / 1.02; was
    # 3.81 / 3.26: a second weight cast in backward, bf16 gradients copied into float32, concatenations)
    "blockwise": (1.03, 1.04),
    # traced as sm_100: one autograd function, each operand's two casts from one cast_mx read (the
    # weight's in the forward, kept for grad_input), torch's block-scaled GEMM per expert writing its
    # rows / float32 gradient slice in place (1.022 / 1.024; 3.80 / 3.24 on the per-expert loop: the
    # weight cast again in backward, gradients stacked, bf16 grad_weight copied to float32, the groups
    # concatenated)
    "mxfp8": (1.03, 1.03),
}


def _floor(recipe: str, ideal: float, experts: int, n: int, k: int) -> float:
    """The least ratio the counts may show: 0.85; for delayed exactly the ideal less one FP8 layout
    of the weights (no amax pass anywhere, grad_input reading the forward's one layout)."""
    return 1 - experts * n * k / ideal if recipe == "delayed" else 0.85


needs_triton = pytest.mark.skipif(
    not triton_importable(), reason="the fused ops' fake implementations come from triton"
)


@needs_triton
@pytest.mark.parametrize("shape", list(bench.SHAPES))
@pytest.mark.parametrize("recipe", list(BUDGET))
def test_grouped_bytes_outside_the_gemms_within_budget(recipe, shape):
    experts, k, n = bench.SHAPES[shape]
    c = bench.trace_recipe(recipe, experts, k, n, ROWS)
    ideal = bench.ideal_bytes(recipe, experts, ROWS, k, n)
    ratio = c.outside_gemm_bytes() / ideal
    assert _floor(recipe, ideal, experts, n, k) <= ratio <= BUDGET[recipe][list(bench.SHAPES).index(shape)], (
        round(ratio, 3),
        c.by_op(),
    )
    # every GEMM in FP8 (mxfp8 traced as sm_100, where torch's block-scaled GEMM runs)
    if recipe in ("tensorwise", "rowwise"):  # the weight gradient written by its one GEMM, never copied
        assert "aten.copy_" not in c.by_op(), c.by_op()
        assert "lowprec.grouped_wgrad_scaled_mm" in {g.name for g in c.gemms()}
    if recipe in ("rowwise", "rowwise_with_gw_hp"):  # casts read where written: scales stacked only
        ops = c.by_op()
        assert all(ops.get(op, {"bytes": 0})["bytes"] < 1e8 for op in ("aten.stack", "aten.cat", "aten.copy_")), ops
    if recipe == "blockwise":  # sm_90: cuBLAS per expert for output / grad_input, grad_weight one launch
        ops = c.by_op()
        assert "aten.copy_" not in ops and "aten._to_copy" not in ops, ops  # fp32 gradient written in place
        assert "lowprec.grouped_block_wgrad_scaled_mm" in {g.name for g in c.gemms()}
        # the experts' weights cast once, all in one pass (both layouts, forward), never in backward
        weight_casts = [(r.phase, r.read) for r in c.records if r.name == "lowprec.cast_block_2d"]
        assert weight_casts == [("fwd", 4 * experts * n * k)], weight_casts
        # outputs and grad_input written by the GEMMs into one buffer each: only scales concatenated
        assert ops.get("aten.cat", {"bytes": 0})["bytes"] < 0.01 * ideal, ops
    if recipe == "mxfp8":  # nothing gathered or converted: the GEMMs write where results belong
        ops = c.by_op()
        assert not {"aten.stack", "aten.cat", "aten.copy_", "aten._to_copy"} & set(ops), ops
    dtypes = {g.operand_dtype for g in c.gemms()}
    if recipe == "rowwise_with_gw_hp":  # its weight-gradient GEMMs are bf16 by definition
        dtypes -= {"bfloat16"}
    assert dtypes and all(d.startswith("float8") for d in dtypes), dtypes


@needs_triton
@pytest.mark.parametrize("shape, budget", [("deepseek-v3", 0.98), ("qwen3-30b-a3b", 1.16)])
def test_tensorwise_with_uneven_groups(shape, budget):
    """Groups that are not multiples of 16 rows (``skewed_counts``): torch's grouped kernel gets
    padded groups (a copy of A, the output's real rows gathered); grad_weight's one Triton launch
    masks each group's last row step (nothing padded: 0.96 / 1.13, from 1.01 / 1.34 when each
    expert's GEMM padded its token dim) and writes the weight gradient in place."""
    experts, k, n = bench.SHAPES[shape]
    c = bench.trace_recipe("tensorwise", experts, k, n, ROWS, routing="skewed")
    ratio = c.outside_gemm_bytes() / bench.ideal_bytes("tensorwise", experts, ROWS, k, n)
    assert ratio <= budget, (round(ratio, 3), c.by_op())
    assert "aten.stack" not in c.by_op() or c.by_op()["aten.stack"]["bytes"] < 1e8, c.by_op()  # scales only


@needs_triton
@pytest.mark.parametrize("shape, budget", [("deepseek-v3", 1.08), ("qwen3-30b-a3b", 1.24)])
def test_blockwise_with_uneven_groups(shape, budget):
    """Groups that are not multiples of 16 rows: cuBLAS's blockwise GEMM refuses them, so output and
    grad_input run the Triton blockwise grouped GEMM (as on sm_89 / sm_100). It reads the experts'
    weights where their one-pass cast wrote them (no stack: 1.66 / 1.64 before); the groups' FP8
    rows of x and dY are still concatenated for it (1.06 / 1.22)."""
    experts, k, n = bench.SHAPES[shape]
    c = bench.trace_recipe("blockwise", experts, k, n, ROWS, routing="skewed")
    ratio = c.outside_gemm_bytes() / bench.ideal_bytes("blockwise", experts, ROWS, k, n)
    assert 0.85 <= ratio <= budget, (round(ratio, 3), c.by_op())
    assert "lowprec.grouped_block_scaled_mm" in {g.name for g in c.gemms()}
    ideal = bench.ideal_bytes("blockwise", experts, ROWS, k, n)
    assert c.by_op().get("aten.stack", {"bytes": 0})["bytes"] < 1e-3 * ideal, c.by_op()  # scales only


@needs_triton
@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8"])
def test_the_per_expert_path_gathers_the_gradients_once(recipe):
    """The per-expert path hands every expert's gradient back through one stack / concatenation,
    and a one-call kind (delayed, blockwise, mxfp8) writes it in place: never a zero tensor of the
    whole weight per expert added up (select / slice backward: E full-size passes, 550 GB at the
    Qwen3 shape before)."""
    experts, k, n = 16, 256, 128
    c = bench.trace_recipe(recipe, experts, k, n, 16 * 64)
    ops = c.by_op()
    assert "aten.select_backward" not in ops and "aten.slice_backward" not in ops, ops
    grad_bytes = experts * n * k * 4  # the fp32 weight gradient
    assert ops.get("aten.add", {"bytes": 0})["bytes"] < grad_bytes, ops
    # stacked once (the per-expert Linear path) or written in place (a one-call kind's loop): never more
    assert ops.get("aten.stack", {"bytes": 0})["bytes"] <= 2 * grad_bytes + 1024, ops


def test_ideal_bytes_follow_the_dense_rules():
    # tensorwise at the Qwen3 shape: x 6, W 10, dY 6 bytes per element (traffic.py's table)
    e, k, n = bench.SHAPES["qwen3-30b-a3b"]
    assert bench.ideal_bytes("tensorwise", e, ROWS, k, n) == 6 * ROWS * k + 10 * e * n * k + 6 * ROWS * n
    assert bench.even_counts(256, ROWS) == (256,) * 256
    assert bench.even_counts(3, 10) == (4, 3, 3)
    skewed = bench.skewed_counts(256, ROWS)
    assert sum(skewed) == ROWS and max(skewed) == 1212 and min(skewed) == 76
    # the MX recipes count their block scales (1 byte per 32 / 16 elements and layout)
    assert bench.ideal_bytes("mxfp8", 1, 32, 32, 32) == round((2 * (4 + 2 / 32) + (6 + 2 / 32)) * 32 * 32)


@needs_triton
def test_benchmark_tiny_writes_its_json(tmp_path):
    data = run_tiny("grouped_traffic.py", tmp_path / "g.json", "--recipes", "tensorwise,delayed")
    assert {"command", "date", "torch", "device", "routing", "results"} <= set(data)
    rows = {r["variant"]: r for r in data["results"]}
    assert {"bf16", "tensorwise", "delayed", "torchao_fp8_rowwise_grouped"} <= set(rows)
    for name in ("tensorwise", "delayed"):
        assert rows[name]["outside_gemm_bytes"] > 0 and rows[name]["ratio_to_ideal"] > 0.9
    torchao = rows["torchao_fp8_rowwise_grouped"]  # a number, or exactly why there is none
    assert "outside_gemm_bytes" in torchao or torchao["error"]
    assert torch.__version__ == data["torch"]


@needs_triton
def test_a_custom_op_writing_an_argument_and_returning_a_tensor_counts_both():
    """``lowprec.cast_into`` writes its ``out`` argument (a slice of a buffer) and returns the
    transposed copy and the amax: all written bytes, the input and the scale read ones."""
    import lowprec.fp8 as fp8
    from lowprec.fp8 import kernels
    from lowprec.fp8.observe.traffic import ByteCounter

    with fp8.trace_as(sm=(9, 0), triton=True):
        x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
        buf = torch.empty(100, 32, device="meta", dtype=torch.float8_e4m3fn)
        scale = torch.empty((), device="meta")
        with ByteCounter() as c:
            qt, amax = kernels.cast_into(x, scale, torch.float8_e4m3fn, buf[10:74], True)
    assert qt is not None and qt.shape == (32, 64) and amax.shape == ()
    (rec,) = c.records
    assert rec.name == "lowprec.cast_into" and (rec.read, rec.written) == (64 * 32 * 2 + 4, 2 * 64 * 32 + 4)


@needs_triton
@pytest.mark.parametrize("shape, level", [("deepseek-v3", 1.05), ("qwen3-30b-a3b", 1.05)])
def test_nvfp4_grouped_path_traces_within_its_level(shape, level):
    """NVFP4's grouped GEMMs trace on meta tensors (its rounding streams read no device value):
    the level its casts reach through ``lowprec::cast_nvfp4`` (the weights' two layouts from one
    read) and, for x_e and dY_e, ``lowprec::nvfp4_dual_amax`` and ``lowprec::cast_nvfp4_dual`` (both
    operands, the weight-gradient one with the random Hadamard transform, dY's stochastic rounding, in
    the kernels: two reads each), in the block-scaled kinds' one autograd function (``grouped_mx.py``:
    no stack, no concatenation): 1.03x the ideal at DeepSeek-V3 and at Qwen3-30B-A3B shapes (1.09 /
    1.30 with four reads of x and dY, 1.96 / 2.14 on the per-expert loop, 9.24 / 14.85 with torch-op
    casts), every GEMM on 4-bit operands."""
    experts, k, n = bench.SHAPES[shape]
    c = bench.trace_recipe("nvfp4", experts, k, n, ROWS)
    ratio = c.outside_gemm_bytes() / bench.ideal_bytes("nvfp4", experts, ROWS, k, n)
    assert 1 <= ratio <= level, round(ratio, 3)
    ops = c.by_op()  # copies: only the rounding streams' step counters (bytes)
    assert all(ops.get(op, {"bytes": 0})["bytes"] < 1e6 for op in ("aten.stack", "aten.cat", "aten.copy_")), ops
    dtypes = {g.operand_dtype for g in c.gemms()}
    assert dtypes == {"float4_e2m1fn_x2"}, dtypes


@needs_triton
def test_the_buffers_a_custom_op_writes_are_not_read():
    """``lowprec.cast_rowwise_into`` writes its ``out`` / ``out_t`` arguments (slices of buffers)
    without reading them: the input and the column scales read, both casts and the row scales
    written."""
    import lowprec.fp8 as fp8
    from lowprec.fp8 import kernels
    from lowprec.fp8.observe.traffic import ByteCounter

    with fp8.trace_as(sm=(9, 0), triton=True):
        x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
        buf = torch.empty(100, 32, device="meta", dtype=torch.float8_e4m3fn)
        buf_t = torch.empty(32, 64, device="meta", dtype=torch.float8_e4m3fn)
        cols = torch.empty(1, 32, device="meta")
        with ByteCounter() as c:
            rows = kernels.cast_rowwise_into(x, cols, torch.float8_e4m3fn, True, buf[10:74], buf_t)
    assert rows.shape == (64, 1)
    (rec,) = c.records
    assert rec.name == "lowprec.cast_rowwise_into" and (rec.read, rec.written) == (
        64 * 32 * 2 + 32 * 4,
        2 * 64 * 32 + 64 * 4,
    )


@needs_triton
@pytest.mark.parametrize("sm", [(8, 9), (9, 0), (10, 0)])
@pytest.mark.parametrize("recipe", bench.RECIPES)
def test_odd_widths_and_ragged_groups_meet_the_kernels_contracts(recipe, sm):
    """Every recipe's grouped fwd+bwd traced as each GPU through torch's meta kernels, which check
    their contracts (torch's grouped FP8 GEMM takes a contraction of whole 16-byte runs; its FP4
    GEMM 32 elements): expert widths 200 and 40 and token groups of 0, 17, 33, 1 and 100 rows take
    a path that accepts them (before: tensor- and row-scaled recipes failed at K = 200 / N = 40,
    NVFP4 at groups of 17 and 33 tokens)."""
    from lowprec.fp8.observe.traffic import trace_grouped

    for k, n in ((200, 40), (40, 200)):
        c = trace_grouped(bench.lowprec_make(recipe), (0, 17, 33, 1, 100), k, n, sm=sm, triton=True)
        assert c.gemms() and c.outside_gemm_bytes() > 0
