"""Grouped expert GEMMs (``fp8/modules/grouped.py``): a 3-D weight (E, N, K), tokens grouped by expert,
for every recipe, against a float64 reference (output, grad_input, grad_weight), and against
the dense Float8Linear: one expert holding every token is a Float8Linear bit for bit.

Floors (dB, N(0,1) data scaled as in test_fp8_linear_numerics.py, whose floors these are: a
grouped GEMM is per-expert Linear GEMMs): output >= 26, gradients >= 22 HYBRID / >= 26 E4M3,
nvfp4 >= 15 / 13; a wrong scale or a group reading another expert's weight shows as < 10 dB.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from lowprec.fp8.modules.grouped import Float8GroupedGemm
from lowprec.fp8.kinds.nvfp4 import SR_STATE
from tests.conftest import sqnr

RECIPES = list(fp8.RECIPE_NAMES)
E, K, N = 4, 128, 96


def _floors(recipe: fp8.Recipe) -> dict[str, float]:
    grad = 22 if recipe.fp8_format == fp8.Format.HYBRID else 26
    floors = {"out": 26, "grad_input": grad, "grad_weight": grad}
    if recipe.kind.name == "nvfp4":
        floors.update(out=15, grad_input=13, grad_weight=13)
    if recipe.override_linear_precision[2]:
        floors["grad_weight"] = 100
    return floors


def _grouped(recipe, counts, x, w, dy, gemm=None):
    gemm = gemm or Float8GroupedGemm(len(counts), recipe)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = gemm(xt, wt, tuple(counts), recipe, torch.float32)
    out.backward(dy)
    return out, xt.grad, wt.grad


def _reference(counts, x, w, dy):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x64[start : start + n] @ w64[e].t())
        start += n
    out = torch.cat(outs)
    out.backward(dy.double())
    return out, x64.grad, w64.grad


@pytest.mark.parametrize("name", RECIPES)
def test_sqnr_against_float64_with_an_empty_expert(seed, name):
    recipe = fp8.Recipe.from_name(name)
    counts = (37, 0, 64, 19)  # expert 1 holds no token: it runs nothing, its gradient is zero
    s = sum(counts)
    x, w, dy = torch.randn(s, K) * 2, torch.randn(E, N, K), torch.randn(s, N)
    got = _grouped(recipe, counts, x, w, dy)
    ref = _reference(counts, x, w, dy)
    for key, g, r in zip(("out", "grad_input", "grad_weight"), got, ref):
        assert g.shape == r.shape
        assert sqnr(r, g) >= _floors(recipe)[key], f"{name} {key}: {sqnr(r, g):.1f} dB"
    assert torch.count_nonzero(got[2][1]) == 0


@pytest.mark.parametrize("name", RECIPES)
def test_one_expert_with_every_token_is_the_dense_linear_bit_for_bit(seed, name):
    recipe = fp8.Recipe.from_name(name)
    counts = (0, 48, 0, 0)
    x, w, dy = torch.randn(48, K) * 2, torch.randn(E, N, K), torch.randn(48, N)
    gemm = Float8GroupedGemm(E, recipe)
    gemm.number_experts(0)  # nvfp4: expert e gets rounding stream e
    out, gx, gw = _grouped(recipe, counts, x, w, dy, gemm)

    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w[1])
    layer = fp8.Float8Linear.from_linear(lin, recipe)
    recipe.kind.number_layer(layer, 1)  # the same stream as expert 1
    xt = x.clone().requires_grad_()
    ref = layer(xt)
    ref.backward(dy)
    assert torch.equal(out, ref)
    assert torch.equal(gx, xt.grad)
    assert torch.equal(gw[1], lin.weight.grad)


@pytest.mark.parametrize("name", RECIPES)
def test_a_token_group_never_shares_a_scale_with_another_experts_tokens(seed, name):
    """Expert 0's tokens a thousand times larger leave every other expert's output, input
    gradient and weight gradient unchanged to the bit."""
    recipe = fp8.Recipe.from_name(name)
    counts = (16, 32, 24, 8)
    s = sum(counts)
    x, w, dy = torch.randn(s, K), torch.randn(E, N, K), torch.randn(s, N)
    loud = x.clone()
    loud[:16] *= 1024
    gemms = [Float8GroupedGemm(E, recipe) for _ in range(2)]
    for g in gemms:
        g.number_experts(0)
    base = _grouped(recipe, counts, x, w, dy, gemms[0])
    other = _grouped(recipe, counts, loud, w, dy, gemms[1])
    assert torch.equal(base[0][16:], other[0][16:])
    assert torch.equal(base[1][16:], other[1][16:])
    assert torch.equal(base[2][1:], other[2][1:])
    assert not torch.equal(base[2][0], other[2][0])


def test_delayed_scaling_keeps_a_history_per_expert(seed):
    recipe = fp8.Recipe.from_name("delayed", amax_history_len=8)
    gemm = Float8GroupedGemm(E, recipe)
    assert gemm.fp8_amax_history_input.shape == (E, 8) and gemm.fp8_step.shape == (E,)
    counts = (5, 0, 9, 3)
    x, w = torch.randn(17, K), torch.randn(E, N, K)
    x[:5] *= 100  # expert 0's input amax is its own
    _grouped(recipe, counts, x, w, torch.randn(17, N), gemm)
    hist = gemm.fp8_amax_history_input[:, 0]
    assert torch.equal(hist[1], torch.zeros(())) and int(gemm.fp8_step[1]) == 0  # empty: untouched
    assert hist[0] == x[:5].abs().amax() and hist[2] == x[5:14].abs().amax()
    assert gemm.fp8_step.tolist() == [1, 0, 1, 1] and gemm.fp8_step_grad.tolist() == [1, 0, 1, 1]
    state = gemm.state_dict()
    assert "fp8_amax_history_input" in state and "fp8_stats" not in state
    fresh = Float8GroupedGemm(E, recipe)
    fresh.load_state_dict({}, strict=True)  # a plain checkpoint: no scaling state, fresh state kept
    fresh.load_state_dict(state)
    assert torch.equal(fresh.fp8_amax_history_input, gemm.fp8_amax_history_input)
    gemm.reset_fp8_state()
    assert int(gemm.fp8_amax_history_input.abs().sum()) == 0 and gemm.fp8_step.tolist() == [0] * E


def test_nvfp4_draws_one_rounding_stream_per_expert():
    recipe = fp8.Recipe.from_name("nvfp4")
    gemm = Float8GroupedGemm(E, recipe)
    gemm.number_experts(10)
    state = getattr(gemm, SR_STATE)
    assert state[:, 0].tolist() == [10, 11, 12, 13]
    _grouped(recipe, (4, 0, 4, 4), torch.randn(12, K), torch.randn(E, N, K), torch.randn(12, N), gemm)
    assert state[:, 1].tolist() == [1, 0, 1, 1]  # the step advances where the expert ran


def test_no_token_at_all_and_mismatched_counts():
    recipe = fp8.Recipe.from_name("rowwise")
    gemm = Float8GroupedGemm(E, recipe)
    out = gemm(torch.randn(0, K), torch.randn(E, N, K), (0, 0, 0, 0), recipe, torch.float32)
    assert out.shape == (0, N)
    with pytest.raises(ValueError, match="grouped GEMM for 4 experts got 3 group counts"):
        gemm(torch.randn(3, K), torch.randn(E, N, K), (1, 1, 1), recipe, torch.float32)


# ------------------------------------------------------------------ the single-call path
# torch._scaled_grouped_mm runs on CUDA sm_90/sm_100 only; on CPU the same dispatch runs with the
# kernel replaced by its reference (same packed arguments, float32 math), and torch's own meta
# kernel checks the arguments' layout. Unverified on a GPU (no device was drawn for this session).
SINGLE = ["tensorwise", "delayed", "rowwise"]


@pytest.fixture
def single_call(monkeypatch):
    from lowprec.fp8.gemm import grouped as grouped_gemm

    calls = []

    def kernel(*args):
        calls.append(args)
        return grouped_gemm.reference_scaled_grouped_mm(*args)

    monkeypatch.setattr(grouped_gemm, "native_grouped_available", lambda device: True)
    monkeypatch.setitem(grouped_gemm.KERNEL, "scaled_grouped_mm", kernel)
    monkeypatch.setattr(grouped_gemm, "_CHECKED", {})
    return calls


def _single_case(name):
    """``(recipe, counts, x, w, dy)`` of the single-call tests (an empty expert among four)."""
    recipe = (
        fp8.Recipe.from_name("tensorwise", fp8_format="E4M3")
        if name == "tensorwise_e4m3"
        else fp8.Recipe.from_name(name)
    )
    counts = (37, 0, 64, 19)
    s = sum(counts)
    return recipe, counts, torch.randn(s, K) * 2, torch.randn(E, N, K), torch.randn(s, N)


@pytest.mark.parametrize("name", [*SINGLE, "tensorwise_e4m3"])
def test_single_call_path_through_the_kinds_dispatch(seed, single_call, name):
    recipe, counts, x, w, dy = _single_case(name)
    got = _grouped(recipe, counts, x, w, dy)
    # one call for the output GEMM (after the one-time check's call), one for grad_input where dY is E4M3
    e4m3_dy = recipe.fp8_format == fp8.Format.E4M3
    assert len(single_call) == 1 + 1 + int(e4m3_dy)
    ref = _reference(counts, x, w, dy)
    floors = _floors(recipe)
    for key, g, r in zip(("out", "grad_input", "grad_weight"), got, ref):
        assert sqnr(r, g) >= floors[key], f"{name} {key}: {sqnr(r, g):.1f} dB"
    # against the per-expert path: the same casts; the kernel rounds its output to bf16 once
    loop = _grouped(
        recipe,
        counts,
        x,
        w,
        dy,
        Float8GroupedGemm(E, fp8.Recipe.from_name(name, gemm="upcast"))
        if name != "tensorwise_e4m3"
        else Float8GroupedGemm(E, recipe.replace(gemm="upcast")),
    )
    for g, lp in zip(got, loop):
        assert sqnr(lp, g) >= 45
    assert torch.equal(got[2], loop[2])  # grad_weight: per expert in both paths


@pytest.mark.parametrize("counts", [(37, 0, 64, 19), (16, 0, 48, 32)], ids=["padded", "aligned"])
@pytest.mark.parametrize("name", ["tensorwise", "tensorwise_e4m3", "delayed", "rowwise"])
def test_casts_written_into_one_buffer_change_no_bit(seed, single_call, monkeypatch, name, counts):
    """Where the fused casts run (CUDA) the grouped path writes every group's and expert's cast
    into one buffer per operand (rowwise: its row-scaled and column-scaled casts, the weight's
    column-scaled one into grad_input's column-major (E, K, N) buffer), which the grouped GEMMs
    read in place (groups of 16-multiple rows: nothing copied), and each weight-gradient GEMM
    writes its expert's slice. Run here with the torch casts standing in: the output and both
    gradients are those of the per-group casts bit for bit."""
    from lowprec.fp8 import kernels
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.modules import grouped_fn

    recipe, _, x, w, dy = _single_case(name)
    x, dy = x[: sum(counts)], dy[: sum(counts)]
    plain = _grouped(recipe, counts, x, w, dy)
    into, packs = [], []
    op = "cast_rowwise_into" if name == "rowwise" else "cast_into"
    cast_into, pack = getattr(kernels, op), grouped_gemm.pack_2d3d
    monkeypatch.setattr(kernels, op, lambda *a, **k: into.append(1) or cast_into(*a, **k))
    monkeypatch.setattr(grouped_gemm, "pack_2d3d", lambda *a, **k: packs.append(k) or pack(*a, **k))
    monkeypatch.setattr(grouped_fn, "fused_casts_here", lambda device: True)
    packed = _grouped(recipe, counts, x, w, dy)
    assert len(into) == 3 + E + 3  # x's groups, the experts, dY's groups
    if name == "rowwise":  # both grouped GEMMs on torch's kernel, B read where written (no stack)
        assert len(packs) == 2 and all(k["packed_b"] is not None and k["packed_b"].stride(-2) == 1 for k in packs)
    for a, b in zip(plain, packed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [(37, 0, 64, 19), (16, 0, 48, 32)], ids=["padded", "aligned"])
def test_rowwise_with_gw_hp_runs_the_grouped_function_where_its_casts_pack(seed, single_call, monkeypatch, counts, hp):
    """rowwise_with_gw_hp on the one-call path where the fused casts run (the torch casts standing
    in here): its output and grad_input GEMMs grouped in FP8 (row scales; grad_input's weight
    tensor-scaled, written into the (E, K, N) buffer torch's kernel reads), grad_weight its
    high-precision GEMM per expert writing its float32 slice. Against the per-expert loop: the
    same casts (the one-call kernel rounds its output once), grad_weight the same bits; where the
    fused casts do not run it keeps the per-expert loop."""
    from lowprec.fp8 import kernels
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.modules import grouped_fn

    recipe = fp8.Recipe.from_name("rowwise_with_gw_hp")
    s = sum(counts)
    x, w, dy = torch.randn(s, K) * 2, torch.randn(E, N, K), torch.randn(s, N)
    x, w, dy = x.to(hp), w, dy.to(hp)

    def run():
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = Float8GroupedGemm(E, recipe)(xt, wt, counts, recipe, hp)
        out.backward(dy)
        return out, xt.grad, wt.grad

    loop = run()
    before = len(single_call)  # the kernel's one-time check at most: no fused casts, the per-expert loop
    assert before <= 1
    into, packs = [], []
    cast_into, pack = kernels.cast_rowwise_into, grouped_gemm.pack_2d3d
    monkeypatch.setattr(kernels, "cast_rowwise_into", lambda *a, **k: into.append(1) or cast_into(*a, **k))
    monkeypatch.setattr(grouped_gemm, "pack_2d3d", lambda *a, **k: packs.append(k) or pack(*a, **k))
    monkeypatch.setattr(grouped_fn, "fused_casts_here", lambda device: True)
    got = run()
    assert len(into) == 3 + E + 3  # x's groups, the experts, dY's groups
    assert len(single_call) == before + 2  # the output and grad_input GEMMs, one call each
    assert len(packs) == 2 and all(k["packed_b"].stride(-2) == 1 for k in packs)  # B read where written
    ref = _reference(counts, x.float(), w, dy.float())
    floors = _floors(recipe)
    for key, g, r, lp in zip(("out", "grad_input", "grad_weight"), got, ref, loop):
        assert g.dtype == lp.dtype and g.shape == lp.shape
        if hp == torch.float32:  # bf16: its rounding dominates; the loop is the reference
            assert sqnr(r, g) >= floors[key], f"{key}: {sqnr(r, g):.1f} dB"
        assert sqnr(lp, g) >= (40 if hp == torch.bfloat16 else 45), key
    assert torch.equal(got[2], loop[2])  # grad_weight: the same high-precision GEMMs
    assert (got[2][1] == 0).all()  # the expert without tokens


def test_single_call_arguments_pass_torchs_own_checks():
    """The packed operands of a real grouped cast, as meta tensors of the same shapes, strides
    and dtypes, go through torch's meta kernel for _scaled_grouped_mm (its CUDA checks)."""
    from lowprec.fp8.gemm.grouped import pack_2d3d

    recipe = fp8.Recipe.from_name("rowwise")
    spec_x, spec_w = recipe.plan.fprop.casts
    from lowprec.fp8.modules.linear_fn import cast

    counts = (5, 0, 33, 16)
    x, w = torch.randn(sum(counts), K), torch.randn(E, N, K)
    groups, start = [], 0
    for n in counts:
        groups.append(cast(x[start : start + n], spec_x, 1, recipe) if n else None)
        start += n
    args = pack_2d3d(groups, [cast(w[e], spec_w, 1, recipe).t() for e in range(E)])
    mat_a, mat_b, scale_a, scale_b, offs, rows = args
    assert mat_a.shape == (16 + 0 + 48 + 16, K) and offs.tolist() == [16, 16, 64, 80] and rows.numel() == 54

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    out = torch._scaled_grouped_mm(
        meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), offs=meta(offs), out_dtype=torch.bfloat16
    )
    assert out.shape == (80, N) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="column major"):  # the check is real: a row-major mat_b fails it
        torch._scaled_grouped_mm(
            meta(mat_a),
            meta(mat_b.contiguous()),
            meta(scale_a),
            meta(scale_b),
            offs=meta(offs),
            out_dtype=torch.bfloat16,
        )


def test_a_kernel_that_fails_its_check_is_not_used(monkeypatch, caplog):
    from lowprec.fp8.gemm import grouped as grouped_gemm

    monkeypatch.setattr(grouped_gemm, "native_grouped_available", lambda device: True)
    monkeypatch.setitem(
        grouped_gemm.KERNEL, "scaled_grouped_mm", lambda a, b, sa, sb, offs: torch.zeros(a.shape[0], b.shape[-1])
    )
    monkeypatch.setattr(grouped_gemm, "_CHECKED", {})
    recipe = fp8.Recipe.from_name("rowwise")
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        out = _grouped(recipe, (8, 8, 0, 8), torch.randn(24, K), torch.randn(E, N, K), torch.randn(24, N))
    assert "torch._scaled_grouped_mm failed its check on cpu" in caplog.text
    assert out[0].abs().sum() > 0  # the per-expert path ran


# ------------------------------------------------------------------ the Triton grouped GEMM
# Its numerics run under the Triton interpreter (test_fp8_kernels_interpret.py) and its cubins
# are compiled in test_fp8_kernels_compile.py; here: the dispatch, traced and on CPU.
@pytest.mark.parametrize("name", SINGLE)
def test_a_traced_ada_gpu_runs_the_grouped_gemms_on_the_triton_kernel(name):
    """Tensorwise / delayed / rowwise grouped fwd+bwd traced as sm_89 (no torch grouped kernel there) with
    triton: the output and grad_input GEMMs of all experts are one lowprec.grouped_scaled_mm each,
    on FP8 operands; grad_weight one lowprec.grouped_wgrad_scaled_mm for all experts; the report
    says so."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:  # find_spec: importing triton here would stop the interpreter tests
        pytest.skip("triton is not installed")
    from lowprec.fp8.gemm import grouped_triton, grouped_wgrad
    from lowprec.fp8.observe.traffic import ByteCounter

    counts = (40, 0, 24, 8)
    recipe = fp8.Recipe.from_name(name)
    with fp8.trace_as(sm=(8, 9), triton=True):
        gemm = Float8GroupedGemm(E, recipe).to("meta")
        x = torch.empty(sum(counts), K, device="meta", requires_grad=True)
        w = torch.empty(E, N, K, device="meta", requires_grad=True)
        counter = ByteCounter()
        with counter:
            out = gemm(x, w, counts, recipe, torch.bfloat16)
            out.backward(torch.empty(sum(counts), N, device="meta", dtype=torch.bfloat16))
        note = recipe.kind.grouped_note(recipe, torch.device("meta"))
    gemms = [(g.name, g.operand_dtype) for g in counter.gemms()]
    dy = "float8_e4m3fn" if name == "rowwise" else "float8_e5m2"  # the per-tensor recipes: HYBRID
    grouped = [("lowprec.grouped_scaled_mm", "float8_e4m3fn"), ("lowprec.grouped_scaled_mm", dy)]
    assert gemms == [*grouped, ("lowprec.grouped_wgrad_scaled_mm", dy)], gemms
    assert note.startswith(grouped_triton.KERNEL) and grouped_wgrad.KERNEL in note, note


def test_a_triton_grouped_gemm_that_fails_its_check_is_not_used(monkeypatch, caplog):
    """A failed first-use check is logged once and the per-expert loop runs."""
    from lowprec.fp8.gemm import grouped_triton

    monkeypatch.setattr(grouped_triton, "may_run", lambda device: True)
    monkeypatch.setattr(grouped_triton, "mm", lambda a, b, out: torch.cat([g.dequantize() for g in a if g is not None]))
    monkeypatch.setattr(grouped_triton, "_CHECKED", {})
    recipe = fp8.Recipe.from_name("rowwise")
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        got = _grouped(recipe, (8, 8, 0, 8), torch.randn(24, K), torch.randn(E, N, K), torch.randn(24, N))
        assert not grouped_triton.ready(torch.device("cpu"))
    assert caplog.text.count("lowprec Triton grouped FP8 GEMM failed its self-check") == 1
    assert got[0].shape == (24, N) and got[0].abs().sum() > 0  # the per-expert path ran


# ------------------------------------------------------------------ delayed scaling, one call per GEMM
# Delayed scaling runs GroupedScaledFn where tensorwise does, each expert's scales from its own row
# of the state buffers. Here the single-call dispatch is switched on (``single_call_ready``) and
# routed to its per-expert GEMMs (no grouped kernel on CPU: the Linear's GEMM path), so everything
# but the GEMM kernel is the grouped function's, bit for bit against the per-expert loop.
DELAYED_STEPS = [(37, 0, 64, 19), (5, 40, 0, 77), (0, 0, 96, 3), (16, 16, 16, 16), (1, 0, 0, 120)]


@pytest.fixture
def grouped_switch(monkeypatch):
    """``switch["on"]``: the single-call path runs (else the per-expert loop); ``switch["fn"]``
    counts the GroupedScaledFn calls."""
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.modules import grouped_fn

    switch = {"on": False, "fn": 0}
    monkeypatch.setattr(grouped_gemm, "single_call_ready", lambda device: switch["on"])
    apply = grouped_fn.GroupedScaledFn.apply

    def counted(*args):
        switch["fn"] += 1
        return apply(*args)

    monkeypatch.setattr(grouped_fn.GroupedScaledFn, "apply", counted)
    return switch


def _delayed_run(gemm, recipe, counts, x, w, dy, checkpointed):
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    run = lambda a, b: gemm(a, b, counts, recipe, torch.float32)  # noqa: E731
    out = fp8.checkpoint(run, xt, wt) if checkpointed else run(xt, wt)
    out.backward(dy)
    return out, xt.grad, wt.grad


@pytest.mark.parametrize("packed", [False, True], ids=["per_group_casts", "casts_into_one_buffer"])
@pytest.mark.parametrize(
    "fields",
    [dict(amax_history_len=4), dict(amax_history_len=3, interval=2, amax_compute_algo="most_recent")],
    ids=["max", "most_recent_interval_2"],
)
def test_delayed_single_call_path_is_the_per_expert_loop_bit_for_bit(seed, grouped_switch, monkeypatch, fields, packed):
    """Five steps with skewed counts, experts empty on some steps (an empty expert records nothing,
    not even its weight's amax), a history refresh every ``interval`` steps, and an activation-
    checkpoint recompute (the first forward's scales replayed, no second update): the output,
    both gradients and every state buffer are the per-expert loop's, bit for bit."""
    from lowprec.fp8 import kernels
    from lowprec.fp8.modules import grouped_fn

    updates = []  # the delayed updates inside the casts (kernels.delayed_scale_update)
    if packed:  # the fused casts' path, with the torch casts standing in (kernels.cast_into, ...)
        monkeypatch.setattr(grouped_fn, "fused_casts_here", lambda device: True)
        update = kernels.delayed_scale_update
        monkeypatch.setattr(kernels, "delayed_scale_update", lambda *a: updates.append(1) or update(*a))
    recipe = fp8.Recipe.from_name("delayed", **fields)
    loop, grouped = Float8GroupedGemm(E, recipe), Float8GroupedGemm(E, recipe)
    w = torch.randn(E, N, K)
    for step, counts in enumerate(DELAYED_STEPS):
        s = sum(counts)
        x, dy = torch.randn(s, K) * (1 + step), torch.randn(s, N) * 2.0**-step
        x[: counts[0]] *= 50  # expert 0's tokens louder: each expert's history is its own
        checkpointed = step == 3
        grouped_switch["on"] = False
        want = _delayed_run(loop, recipe, counts, x, w, dy, checkpointed)
        grouped_switch["on"], calls = True, grouped_switch["fn"]
        got = _delayed_run(grouped, recipe, counts, x, w, dy, checkpointed)
        assert grouped_switch["fn"] == calls + 1 + checkpointed  # the grouped function ran (twice: recompute)
        # packed: x, W and dY of each expert holding tokens updated in their casts (none in the recompute)
        assert len(updates) == (3 * sum(map(bool, counts)) if packed else 0)
        updates.clear()
        for key, g, r in zip(("out", "grad_input", "grad_weight"), got, want):
            assert torch.equal(g, r), f"step {step} {key}"
        for name, buf in loop.named_buffers():
            assert torch.equal(getattr(grouped, name), buf), f"step {step} {name}"
    # one step per forward where the expert held tokens (the recompute counted none)
    assert grouped.fp8_step.tolist() == [4, 2, 3, 5] and grouped.fp8_step_grad.tolist() == [4, 2, 3, 5]
    assert (grouped.fp8_amax_history_weight.amax(1) > 0).all()


def test_delayed_runs_the_grouped_function_where_tensorwise_does(grouped_switch):
    """Eligible where tensorwise is (every GEMM in FP8, FP8 activations kept, telemetry off, the
    scaled GEMM path); the report says how its experts' GEMMs run."""
    grouped_switch["on"] = True
    kind = fp8.Recipe.from_name("delayed").kind
    cpu = torch.device("cpu")
    assert kind.grouped_single_call(fp8.Recipe.from_name("delayed"), cpu, telemetry=False)
    assert not kind.grouped_single_call(fp8.Recipe.from_name("delayed"), cpu, telemetry=True)
    assert not kind.grouped_single_call(fp8.Recipe.from_name("delayed", gemm="upcast"), cpu, telemetry=False)
    assert not kind.grouped_single_call(fp8.Recipe.from_name("delayed", save_fp8_activations=False), cpu, False)


def test_per_expert_gemms_write_their_rows_of_one_output(seed):
    """The blockwise experts' per-expert path where torch's blockwise GEMM takes every expert (sm_90):
    each GEMM writes its group's rows of one (S, N) buffer; the same values as the products
    concatenated (here the CPU's GEMM, copied into the rows), every row written."""
    from lowprec.fp8.cast.quantize import quantize
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.gemm.dispatch import scaled_mm

    live = [
        (
            quantize(torch.randn(c, 256), fp8.E4M3, "block", block=(1, 128), power_of_2=True),
            quantize(torch.randn(64, 256), fp8.E4M3, "block", block=(128, 128), power_of_2=True).t(),
        )
        for c in (32, 16, 48)
    ]
    for dtype in (torch.bfloat16, torch.float32):
        got = grouped_gemm.per_expert_into(live, dtype, "auto")
        want = torch.cat([scaled_mm(g, w, dtype) for g, w in live])
        assert got.dtype == dtype and torch.equal(got, want)
