"""The block-scaled kinds' grouped expert GEMMs in one autograd function (``fp8/modules/grouped_mx.py``):
the same numbers as the per-expert loop (each expert a block-scaled Linear) bit for bit, output and
both gradients, with ragged and empty groups, for MXFP8 and NVFP4 (its stochastic-rounding streams
over several steps); which gradients are asked for; the weight cast again in backward where it is
sharded; where the loop runs instead; and, traced as a B200 (sm_100), every GEMM writing its rows
or slice in place."""

from __future__ import annotations

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.kinds import base
from lowprec.fp8.modules.grouped import Float8GroupedGemm
from lowprec.fp8.kernels.select import triton_importable
from lowprec.fp8.observe.traffic import trace_grouped

E, K, N = 4, 96, 64


def _run(recipe, counts, x, w, dy, loop, hp=torch.float32, x_grad=True, w_grad=True, telemetry=False):
    gemm = Float8GroupedGemm(len(counts), recipe, device=x.device)
    gemm.fp8_telemetry = telemetry
    xt, wt = x.clone().requires_grad_(x_grad), w.clone().requires_grad_(w_grad)
    if loop:  # the per-expert loop every kind has: each expert an MXFP8 Linear
        out = base.Kind.grouped_forward(recipe.kind, base.GroupedCall(gemm, xt, wt, tuple(counts), recipe, hp))
    else:
        out = gemm(xt, wt, tuple(counts), recipe, hp)
    out.backward(dy.to(out.dtype))
    return out, xt.grad, wt.grad


@pytest.mark.parametrize("name, fmt", [("mxfp8", "E4M3"), ("mxfp8", "HYBRID"), ("nvfp4", "E4M3")])
@pytest.mark.parametrize("counts", [(37, 0, 64, 19), (0, 0, 120, 0), (32, 32, 32, 32)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_grouped_function_is_the_per_expert_loop_bit_for_bit(seed, name, fmt, counts, wdtype):
    recipe = fp8.Recipe.from_name(name, fp8_format=getattr(fp8.Format, fmt))
    s = sum(counts)
    x = torch.randn(s, K) * 3
    w = (torch.randn(E, N, K) * 0.1).to(wdtype)
    dy = torch.randn(s, N)
    got = _run(recipe, counts, x, w, dy, loop=False)
    want = _run(recipe, counts, x, w, dy, loop=True)
    assert got[0].grad_fn.name() == "_GroupedMXFnBackward"  # the grouped function ran
    assert want[0].grad_fn.name() != "_GroupedMXFnBackward"
    for name, g, ref in zip(("out", "grad_input", "grad_weight"), got, want):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        assert torch.equal(g, ref), name
    for e, n in enumerate(counts):
        if not n:  # an expert without tokens: zero gradient, written
            assert torch.count_nonzero(got[2][e]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [(37, 0, 64, 19), (128, 256, 0, 64)])
def test_on_cuda_the_grouped_function_is_the_per_expert_loop_bit_for_bit(counts):
    """On a GPU: the casts through ``lowprec::cast_mx`` (both layouts from one read of a group's
    rows or an expert's weight), the GEMMs on the device's block-scaled path (sm_100: torch's,
    writing in place; else the float32 emulation)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    recipe = fp8.Recipe.from_name("mxfp8")
    s = sum(counts)
    x, w, dy = torch.randn(s, K, device=dev) * 3, torch.randn(E, N, K, device=dev) * 0.1, torch.randn(s, N, device=dev)
    got = _run(recipe, counts, x, w, dy, loop=False, hp=torch.bfloat16)
    want = _run(recipe, counts, x, w, dy, loop=True, hp=torch.bfloat16)
    assert got[0].grad_fn.name() == "_GroupedMXFnBackward"
    for name, g, ref in zip(("out", "grad_input", "grad_weight"), got, want):
        assert torch.equal(g, ref), name


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("which", ["grad_input", "grad_weight"])
def test_one_gradient_asked_for(seed, name, which):
    recipe = fp8.Recipe.from_name(name)
    counts = (40, 0, 56, 24)
    x, w, dy = torch.randn(120, K), torch.randn(E, N, K), torch.randn(120, N)
    flags = dict(x_grad=which == "grad_input", w_grad=which == "grad_weight")
    got = _run(recipe, counts, x, w, dy, loop=False, **flags)
    want = _run(recipe, counts, x, w, dy, loop=True, **flags)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (which != "grad_input") and (got[2] is None) == (which != "grad_weight")
    g, ref = (got[1], want[1]) if which == "grad_input" else (got[2], want[2])
    assert torch.equal(g, ref)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_weight_cast_again_in_backward_where_asked(seed, name):
    """``force_recompute_fp8_weight_in_bwd`` (auto: where FSDP / ZeRO-3 shard the weight): backward
    keeps a reference to the weight and casts W^T again, with the same numbers."""
    recipe = fp8.Recipe.from_name(name, force_recompute_fp8_weight_in_bwd=True)
    counts = (24, 40, 0, 16)
    x, w, dy = torch.randn(80, K), torch.randn(E, N, K), torch.randn(80, N)
    got = _run(recipe, counts, x, w, dy, loop=False)
    want = _run(fp8.Recipe.from_name(name), counts, x, w, dy, loop=True)
    assert got[0].grad_fn.name() == "_GroupedMXFnBackward"
    for g, ref in zip(got, want):
        assert torch.equal(g, ref)


def test_nvfp4_rounding_streams_advance_per_expert_as_the_loop_does(seed):
    """Three steps on one module each: every expert holding tokens draws its own stream, advanced
    once per forward (an expert without tokens does not advance), the same as the loop's."""
    recipe = fp8.Recipe.from_name("nvfp4")
    steps = [(30, 0, 50, 16), (0, 40, 40, 16), (24, 24, 0, 48)]
    runs = []
    for loop in (False, True):
        gemm = Float8GroupedGemm(E, recipe)
        gemm.number_experts(3)
        w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(1)).requires_grad_()
        grads = []
        for i, counts in enumerate(steps):
            g = torch.Generator().manual_seed(10 + i)
            x, dy = torch.randn(96, K, generator=g).requires_grad_(), torch.randn(96, N, generator=g)
            if loop:
                out = base.Kind.grouped_forward(
                    recipe.kind, base.GroupedCall(gemm, x, w, counts, recipe, torch.float32)
                )
            else:
                out = gemm(x, w, counts, recipe, torch.float32)
            out.backward(dy)
            grads.append((out.detach(), x.grad, w.grad.clone()))
            w.grad = None
        runs.append((grads, gemm.fp8_sr_state.clone()))
    (got, state_got), (want, state_want) = runs
    assert torch.equal(state_got, state_want) and state_got[:, 1].tolist() == [2, 2, 2, 3]
    for a, b in zip(got, want):
        for t, u in zip(a, b):
            assert torch.equal(t, u)


def test_bf16_activations_in_and_out(seed):
    recipe = fp8.Recipe.from_name("mxfp8")
    counts = (16, 48, 0, 8)
    x, w, dy = torch.randn(72, K).bfloat16(), torch.randn(E, N, K), torch.randn(72, N)
    got = _run(recipe, counts, x, w, dy, loop=False, hp=torch.bfloat16)
    want = _run(recipe, counts, x, w, dy, loop=True, hp=torch.bfloat16)
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for g, ref in zip(got, want):
        assert torch.equal(g, ref)


@pytest.mark.parametrize(
    "change",
    [dict(telemetry=True), dict(override_linear_precision=(False, False, True)), dict(save_fp8_activations=False)],
)
def test_the_loop_runs_where_the_grouped_function_cannot(seed, change):
    """Telemetry rows (filled per expert by the Linear's function), a GEMM moved to high
    precision, bf16 activations kept: the per-expert loop, whose results these are."""
    telemetry = change.pop("telemetry", False)
    recipe = fp8.Recipe.from_name("mxfp8", **change)
    counts = (20, 0, 30, 14)
    x, w, dy = torch.randn(64, K), torch.randn(E, N, K), torch.randn(64, N)
    got = _run(recipe, counts, x, w, dy, loop=False, telemetry=telemetry)
    assert got[0].grad_fn.name() != "_GroupedMXFnBackward"
    want = _run(recipe, counts, x, w, dy, loop=True, telemetry=telemetry)
    for g, ref in zip(got, want):
        assert torch.equal(g, ref)


def test_mismatched_counts_are_refused():
    recipe = fp8.Recipe.from_name("mxfp8")
    gemm = Float8GroupedGemm(E, recipe)
    with pytest.raises(ValueError, match="add up to 50, x has 64 rows"):
        gemm(torch.randn(64, K), torch.randn(E, N, K), (10, 10, 10, 20), recipe, torch.float32)


@pytest.mark.parametrize("counts", [(64, 128, 0, 320), (40, 0, 88, 72)])
def test_traced_on_sm100_every_gemm_writes_in_place(counts):
    """Traced as a B200: the GEMMs are torch's block-scaled ones, one per expert holding tokens
    and direction; nothing concatenates outputs or stacks gradients, each operand is cast in one
    read per group (x, W and dY: ``lowprec::cast_mx`` where Triton is installed), and only a
    ragged group (rows not a multiple of 16) pads FP8 rows."""
    recipe = fp8.Recipe.from_name("mxfp8")
    k, n = 256, 128

    def make(experts):
        gemm = Float8GroupedGemm(experts, recipe).to("meta")
        return lambda x, w, c: gemm(x, w, c, recipe, torch.bfloat16)

    c = trace_grouped(make, counts, k, n, sm=(10, 0), triton=triton_importable())
    ops = c.by_op()
    busy = sum(1 for n_ in counts if n_)
    assert len(c.gemms()) == 3 * busy and {g.name for g in c.gemms()} == {"aten._scaled_mm_v2"}
    assert "aten.cat" not in ops and "aten.stack" not in ops, ops
    assert "aten._to_copy" not in ops, ops  # the float32 gradient from the GEMM, no bf16 round trip
    # copied in: only a ragged group's output and grad_input rows (bf16, read + written), never a gradient
    ragged = sum(n_ for n_ in counts if n_ % 16)
    assert ops.get("aten.copy_", {"bytes": 0})["bytes"] == ragged * (n + k) * 2 * 2, ops
    pad = ops.get("aten.constant_pad_nd", {"bytes": 0})["bytes"]
    casts = sum(v["bytes"] for op, v in ops.items() if "cast" in op or op == "aten.zero_")
    if not any(n_ % 16 for n_ in counts):  # whole groups: only the scales are padded (to 128 x 4 tiles)
        assert pad < 0.02 * casts, ops
    else:  # a ragged group pads its own FP8 rows (to 16), nothing else
        assert 0.02 * casts < pad < 0.3 * casts, ops
    if triton_importable():  # x and dY: one cast_mx per group; W: one per expert holding tokens
        assert ops["lowprec.cast_mx"]["calls"] == 3 * busy, ops
