"""The grouped expert weight gradient's Triton kernel (``fp8/gemm/grouped_wgrad.py``) run by Triton's CPU
interpreter (``TRITON_INTERPRET=1``) against the per-expert float32 emulation and the per-expert loop.

Skipped where triton is not installed (CI) and on machines with a GPU, where test_gpu_fp8.py runs
the compiled kernel instead. Interpreter tiles (``gemm_ops.WGRAD_TILE``): 32 x 32 output tiles, 16
token rows per step, so N = 40 and K = 48 are ragged tiles and the groups below end inside a step.
"""

import dataclasses

import pytest
import torch

from tests import triton_interpret

ops, gemm_ops = triton_interpret.load(__file__)

from lowprec.fp8 import E4M3, E5M2  # noqa: E402
from lowprec.fp8.cast.quantize import Float8Data  # noqa: E402

N, K = 40, 48
# empty experts first, between and last; groups inside one step, across steps, none a multiple of 16
LAYOUTS = [(37, 0, 5, 19), (0, 21, 0), (1, 33, 16)]
# (the scales, dY's format): tensorwise (E5M2 dY), rowwise (column scales, E4M3), E4M3 tensor scales
OPERANDS = [("tensor", E5M2), ("axis", E4M3), ("tensor", E4M3)]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.interpreting()


def _transposed(g: Float8Data) -> Float8Data:
    """The same cast stored as the fused CUDA casts store it: (cols, c) contiguous, viewed transposed."""
    return dataclasses.replace(g, data=g.data.t().contiguous().t())


def _operands(counts, gran, dy_dtype, layout="rows", exact=False):
    """The casts grad_weight reads, per expert (None without tokens): dY (c, N) and x (c, K) cast
    along the tokens (one scale per column, or per group). ``layout``: "rows" (the torch casts'
    row-major data), "cols" (the fused casts' transposed copies) or "mixed". ``exact``: integer
    FP8 values in [-8, 8] and power-of-two scales, every partial sum exact in float32."""
    from lowprec import fp8

    def cast(c, cols, dtype, i):
        if exact:
            data = torch.randint(-8, 9, (c, cols)).float().to(dtype)
            scale = torch.exp2(torch.randint(-3, 4, () if gran == "tensor" else (1, cols)).float())
            q = Float8Data(data, scale, gran, None, True)
        else:
            q = fp8.quantize(torch.randn(c, cols) * 3, dtype, gran, dim=0)
        return _transposed(q) if layout == "cols" or (layout == "mixed" and i % 2) else q

    dy = [cast(c, N, dy_dtype, i) if c else None for i, c in enumerate(counts)]
    x = [cast(c, K, E4M3, i + 1) if c else None for i, c in enumerate(counts)]
    return dy, x


def _run(dy, x):
    from lowprec.fp8.gemm import grouped_wgrad

    assert grouped_wgrad.supported(dy, x)
    out = torch.full((len(dy), N, K), float("nan"))  # every element must be written
    grouped_wgrad.mm_into(dy, x, out)
    return out


@pytest.mark.parametrize("gran,dy_dtype", OPERANDS)
@pytest.mark.parametrize("counts,layout", [(LAYOUTS[0], "rows"), (LAYOUTS[1], "cols"), (LAYOUTS[2], "mixed")])
def test_grouped_wgrad_is_the_per_expert_gemm_within_the_documented_bound(counts, layout, gran, dy_dtype, seed):
    """One launch for all experts against each expert's ``dequant(dY_e)^T @ dequant(x_e)`` in
    float32: the same exact products summed in another order (``c_e * eps32 * (|A| @ |B|)``), no
    output rounding (float32 both), and the scales (not powers of two here) applied as the
    kernel's epilogue against the reference's dequantized operands (three float32 roundings: the
    two reciprocals and their product against the operands' two); an empty expert's slice is
    zeros written by the kernel."""
    from lowprec.fp8.gemm import grouped_wgrad
    from tests.conftest import assert_within_gemm_bound

    dy, x = _operands(counts, gran, dy_dtype, layout)
    got = _run(dy, x)
    ref = grouped_wgrad.loop_reference(dy, x, N, K)
    for e, (d, g) in enumerate(zip(dy, x)):
        if d is None:
            assert torch.equal(got[e], torch.zeros(N, K)), e
        else:
            assert_within_gemm_bound(got[e], ref[e], d.t(), g, output_roundings=0, scale_roundings=3)


@pytest.mark.parametrize("gran,dy_dtype", OPERANDS[:2])
def test_grouped_wgrad_is_exact_where_sums_are_exact(gran, dy_dtype, seed):
    """Where every partial sum is exact in float32 (integer FP8 values, power-of-two scales) the
    summation order cannot show: the kernel gives the exact gradient (float64) bit for bit, and
    rounded to bf16 it is the per-expert loop ``grouped_fn`` runs without it (``scaled_mm`` per
    expert, the CPU's exact upcast, which rounds its accumulator to bf16 before the scales)."""
    from lowprec.fp8.gemm.dispatch import scaled_mm

    for counts in LAYOUTS:
        dy, x = _operands(counts, gran, dy_dtype, "mixed", exact=True)
        got = _run(dy, x)
        for e, (d, g) in enumerate(zip(dy, x)):
            if d is None:
                assert torch.equal(got[e], torch.zeros(N, K))
                continue
            exact = d.t().dequantize().double() @ g.dequantize().double()
            assert torch.equal(got[e].double(), exact), (counts, e)
            loop = scaled_mm(d.t(), g, torch.float32, path="upcast")
            assert torch.equal(got[e].to(torch.bfloat16), loop.to(torch.bfloat16)), (counts, e)


def test_grouped_wgrad_takes_tensor_and_column_scales_only():
    from lowprec.fp8.cast.quantize import quantize
    from lowprec.fp8.gemm import grouped_wgrad

    dy, x = _operands((3, 0, 4), "axis", E4M3)
    assert grouped_wgrad.supported(dy, x)
    rows = [quantize(torch.randn(3, N), E4M3, "axis", dim=1), None, dy[2]]  # per-row scales: no
    assert not grouped_wgrad.supported(rows, x)
    assert not grouped_wgrad.supported([None, None, None], x)  # no tokens at all
    mixed = [dy[0], None, dataclasses.replace(dy[2], data=dy[2].data.to(E5M2))]
    assert not grouped_wgrad.supported(mixed, x)


def test_grouped_wgrad_operator_opcheck():
    """torch's operator checks on the operator (not test_schema: it compares the FP8 inputs with
    ops torch has no FP8 kernel for): the fake writes nothing and returns nothing, as the real
    one; its inputs are unchanged, and ``out`` is written whole."""
    from lowprec.fp8.gemm import grouped_wgrad

    dy, x = _operands((5, 0, 20), "axis", E4M3, "mixed")
    d0, x0 = dy[0], x[0]
    dy_data = [d0.data.new_empty(0, N) if d is None else d.data for d in dy]
    x_data = [x0.data.new_empty(0, K) if g is None else g.data for g in x]
    sa, sb = grouped_wgrad._stack_inv(dy, d0), grouped_wgrad._stack_inv(x, x0)
    out = torch.full((3, N, K), float("nan"))
    before = [t.view(torch.uint8).clone() for t in dy_data + x_data]
    args = (dy_data, x_data, sa, sb, out)
    torch.library.opcheck(
        torch.ops.lowprec.grouped_wgrad_scaled_mm.default,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    torch.ops.lowprec.grouped_wgrad_scaled_mm(*args)  # (opcheck ran on copies)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, dy_data + x_data))
    assert not out.isnan().any() and torch.equal(out[1], torch.zeros(N, K))


def test_grouped_wgrad_self_check_passes_under_the_interpreter(monkeypatch):
    """The first-use check's problems (an empty group, groups across and inside a row step, both
    recipes' operands; N and K smaller than on a device, for time) pass against the emulation, and
    the verdict is kept per device."""
    from lowprec.fp8.gemm import grouped_wgrad

    assert grouped_wgrad._check(torch.device("cpu"), n=40, k=48)
    monkeypatch.setattr(grouped_wgrad, "_CHECKED", {})
    monkeypatch.setattr(grouped_wgrad, "_check", lambda device: True)
    assert grouped_wgrad.self_check(torch.device("cpu")) and grouped_wgrad._CHECKED == {None: True}


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_grouped_experts_write_grad_weight_in_one_launch(name, monkeypatch, caplog, seed):
    """The grouped kinds' backward as on a GPU where the Triton grouped GEMMs passed their checks:
    grad_weight of all experts in one launch (logged once; blockwise: the block mode), against the
    per-expert loop's gradient (the same casts) within the GEMM's summation order; an empty
    expert's gradient 0."""
    from lowprec import fp8
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_block_triton, grouped_triton, grouped_wgrad
    from lowprec.fp8.modules.grouped import Float8GroupedGemm
    from tests.conftest import sqnr

    launches = []
    into = "block_mm_into" if name == "blockwise" else "mm_into"
    real = getattr(grouped_wgrad, into)
    monkeypatch.setattr(grouped_triton, "ready", lambda device: True)
    monkeypatch.setattr(grouped_block_triton, "ready", lambda device: True)
    monkeypatch.setattr(grouped_gemm, "_ROUTES_LOGGED", set())
    monkeypatch.setattr(grouped_wgrad, "may_run", lambda device: True)
    monkeypatch.setattr(grouped_wgrad, "self_check", lambda device: True)
    monkeypatch.setattr(grouped_wgrad, "_LOGGED", set())
    monkeypatch.setattr(grouped_wgrad, into, lambda *a: launches.append(1) or real(*a))
    counts, k, n = (21, 0, 17), 48, 40
    x, w, dy = torch.randn(sum(counts), k) * 2, torch.randn(len(counts), n, k), torch.randn(sum(counts), n)
    grads = []
    for gemm in ("auto", "upcast"):  # "upcast": no one-call kernel, the per-expert loop
        recipe = fp8.Recipe.from_name(name, gemm=gemm)
        wt = w.clone().requires_grad_()
        with caplog.at_level("INFO", logger="lowprec.fp8"):
            out = Float8GroupedGemm(len(counts), recipe)(x.clone().requires_grad_(), wt, counts, recipe, torch.float32)
            out.backward(dy)
        grads.append(wt.grad)
    assert launches == [1]
    assert caplog.text.count(f"{grouped_wgrad.KERNEL}, one launch for all experts") == 1
    assert torch.equal(grads[0][1], torch.zeros(n, k))
    # the same casts; the loop (CPU upcast) rounds each accumulator to bf16 (2**-9 relative, ~54 dB), the kernel not
    assert sqnr(grads[1], grads[0]) >= 50


# --- block scales along the tokens (the blockwise recipe) -------------------------------------------------

BLOCK_LAYOUTS = [(37, 0, 5, 70), (0, 33, 0)]  # groups inside one 32-row tile, across tiles, empty ones


def _block_operands(counts, block=32, layout="cols", exact=False):
    """The blockwise recipe's grad_weight casts per expert: dY (c, N) and x (c, K) in ``block x 1``
    tiles along the group's tokens, power-of-two scales; ``layout`` as :func:`_operands`.
    ``exact``: integer FP8 values in [-8, 8] and power-of-two tile scales (every sum exact)."""
    from lowprec.fp8.cast.quantize import quantize

    def cast(c, cols, i):
        if exact:
            data = torch.randint(-8, 9, (c, cols)).float().to(E4M3)
            scale = torch.exp2(torch.randint(-3, 4, (-(-c // block), cols)).float())
            q = Float8Data(data, scale, "block", (block, 1), True)
        else:
            q = quantize(torch.randn(c, cols) * 3, E4M3, "block", block=(block, 1), power_of_2=True)
        return _transposed(q) if layout == "cols" or (layout == "mixed" and i % 2) else q

    dy = [cast(c, N, i) if c else None for i, c in enumerate(counts)]
    x = [cast(c, K, i + 1) if c else None for i, c in enumerate(counts)]
    return dy, x


def _run_block(dy, x):
    from lowprec.fp8.gemm import grouped_wgrad

    assert grouped_wgrad.block_supported(dy, x) and not grouped_wgrad.supported(dy, x)
    out = torch.full((len(dy), N, K), float("nan"))  # every element must be written
    grouped_wgrad.block_mm_into(dy, x, out)
    return out


@pytest.mark.parametrize("counts,layout", [(BLOCK_LAYOUTS[0], "mixed"), (BLOCK_LAYOUTS[1], "rows")])
def test_grouped_block_wgrad_is_the_per_expert_gemm_within_the_documented_bound(counts, layout, seed):
    """Block scales along each group's tokens (tiles from its first row): one launch against each
    expert's ``dequant(dY_e)^T @ dequant(x_e)`` in float32 within the summation-order bound (the
    power-of-two scales are exact in either place); an empty expert's slice zeros."""
    from lowprec.fp8.gemm import grouped_wgrad
    from tests.conftest import assert_within_gemm_bound

    dy, x = _block_operands(counts, layout=layout)
    got = _run_block(dy, x)
    ref = grouped_wgrad.loop_reference(dy, x, N, K)
    for e, (d, g) in enumerate(zip(dy, x)):
        if d is None:
            assert torch.equal(got[e], torch.zeros(N, K)), e
        else:
            assert_within_gemm_bound(got[e], ref[e], d.t(), g, output_roundings=0)


def test_grouped_block_wgrad_is_exact_where_sums_are_exact(seed):
    """Integer FP8 values and power-of-two tile scales: every partial sum is exact, so the kernel
    gives the exact gradient (float64) bit for bit, and the per-expert blockwise GEMM the loop runs
    (CPU's exact upcast, 1x b x 1x b) rounded to bf16 is the kernel's rounded to bf16."""
    from lowprec.fp8.gemm.dispatch import scaled_mm

    dy, x = _block_operands(BLOCK_LAYOUTS[0], exact=True, layout="mixed")
    got = _run_block(dy, x)
    for e, (d, g) in enumerate(zip(dy, x)):
        if d is None:
            assert torch.equal(got[e], torch.zeros(N, K))
            continue
        exact = d.t().dequantize().double() @ g.dequantize().double()
        assert torch.equal(got[e].double(), exact), e
        loop = scaled_mm(d.t(), g, torch.float32, path="auto")
        assert torch.equal(got[e].to(torch.bfloat16), loop.to(torch.bfloat16)), e


def test_grouped_block_wgrad_takes_token_tiles_only():
    from lowprec.fp8.cast.quantize import quantize
    from lowprec.fp8.gemm import grouped_wgrad

    dy, x = _block_operands((40, 0, 9))
    assert grouped_wgrad.block_supported(dy, x)
    tiles_k = [
        None if g is None else quantize(torch.randn(g.data.shape[0], K), E4M3, "block", block=(1, 32)) for g in x
    ]
    assert not grouped_wgrad.block_supported(dy, tiles_k)  # 1 x b tiles contract over K, not the tokens
    other = _block_operands((40, 0, 9), block=64)[1]
    assert not grouped_wgrad.block_supported(dy, other)  # one tile size for both operands


def test_grouped_block_wgrad_operator_opcheck():
    """torch's operator checks on the block-scale operator: the fake writes nothing, inputs unchanged,
    ``out`` written whole; scales of the wrong tile count are refused."""
    from lowprec.fp8.gemm import grouped_wgrad

    dy, x = _block_operands((5, 0, 40), layout="mixed")
    d0, x0 = dy[0], x[0]
    dy_data, x_data = grouped_wgrad._data(dy, d0), grouped_wgrad._data(x, x0)
    sa = torch.cat([d.scale for d in dy if d is not None]).reciprocal()
    sb = torch.cat([g.scale for g in x if g is not None]).reciprocal()
    out = torch.full((3, N, K), float("nan"))
    before = [t.view(torch.uint8).clone() for t in dy_data + x_data]
    args = (dy_data, x_data, sa, sb, 32, out)
    torch.library.opcheck(
        torch.ops.lowprec.grouped_block_wgrad_scaled_mm.default,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    torch.ops.lowprec.grouped_block_wgrad_scaled_mm(*args)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, dy_data + x_data))
    assert not out.isnan().any() and torch.equal(out[1], torch.zeros(N, K))
    with pytest.raises(ValueError, match="tiles"):
        torch.ops.lowprec.grouped_block_wgrad_scaled_mm(dy_data, x_data, sa[1:], sb[1:], 32, out)


def test_grouped_wgrad_self_check_covers_block_scales(monkeypatch):
    """The first-use check runs the block mode too (b = 128 on its problem: a group across a tile
    edge, an empty one) and fails where the block mode's results are wrong."""
    from lowprec.fp8.gemm import grouped_wgrad

    dy, x = grouped_wgrad.block_probe(torch.device("cpu"), n=N, k=K)
    assert grouped_wgrad.block_supported(dy, x) and dy[0].block == (128, 1)
    real = grouped_wgrad.block_mm_into
    monkeypatch.setattr(grouped_wgrad, "block_mm_into", lambda d, g, out: real(d, g, out) or out.mul_(1.1))
    monkeypatch.setattr(grouped_wgrad, "_CHECKED", {})
    assert not grouped_wgrad._check(torch.device("cpu"), n=N, k=K)
