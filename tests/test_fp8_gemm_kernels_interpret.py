"""The Triton GEMM kernels (the blockwise-scaled GEMM, the grouped expert GEMM) run by Triton's CPU
interpreter (``TRITON_INTERPRET=1``) against the float32 emulation and the per-expert loop.

Skipped where triton is not installed (CI) and on machines with a GPU, where
test_fp8_kernels_gpu.py and test_gpu_fp8.py run the compiled kernels instead. The casts' kernels
are test_fp8_kernels_interpret.py's.
"""

import pytest
import torch

from tests import triton_interpret

ops, gemm_ops = triton_interpret.load(__file__)

from lowprec.fp8 import E4M3, E5M2  # noqa: E402

FP8 = [E4M3, E5M2]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.interpreting()


# --- the Triton blockwise GEMM (block_gemm_triton): against the float32 emulation ----------------
def _block_operands(m, k, n, bs, a_dtype, square):
    from functools import partial

    from lowprec.fp8.cast.quantize import quantize_blockwise

    qb = partial(quantize_blockwise, fused=False)

    a = qb(torch.randn(m, k) * 4, a_dtype, (1, bs))
    if square:  # output / grad_input: B = W^T in bs x bs blocks
        b = qb(torch.randn(n, k), E4M3, (bs, bs)).t()
    else:  # grad_weight: B = X in bs x 1 tiles (contracting over its rows)
        b = qb(torch.randn(k, n), E4M3, (bs, 1))
    return a, b


@pytest.mark.parametrize(
    "mkn,bs,a_dtype,square,out_dtype",
    [
        ((64, 256, 96), 128, E4M3, True, torch.bfloat16),  # the output / grad_input GEMMs
        ((64, 256, 96), 128, E4M3, False, torch.float32),  # grad_weight
        ((70, 200, 90), 128, E5M2, True, torch.float32),  # ragged M, K, N
        ((70, 200, 90), 128, E4M3, False, torch.bfloat16),
        ((40, 96, 72), 32, E4M3, True, torch.float32),  # block_size 32
    ],
)
def test_triton_block_gemm_is_within_the_documented_bound(mkn, bs, a_dtype, square, out_dtype, seed):
    """Whole and ragged tiles, both B tilings, E4M3/E5M2 A, float32 and bf16 output: the kernel
    differs from dequantize-then-matmul only by summation order (cpu_gemm.py's bound)."""
    from lowprec import fp8
    from lowprec.fp8.gemm import block_triton as block_gemm_triton
    from tests.conftest import assert_within_gemm_bound

    a, b = _block_operands(*mkn, bs, a_dtype, square)
    assert block_gemm_triton.supported(a, b)
    got = block_gemm_triton.mm(a, b, out_dtype)
    ref = fp8.scaled_mm(a, b, torch.float32, path="emulate")
    assert got.dtype == out_dtype and got.shape == (mkn[0], mkn[2])
    assert_within_gemm_bound(got, ref, a, b, output_roundings=int(out_dtype == torch.bfloat16))


@pytest.mark.parametrize("dtype", FP8)
def test_triton_block_gemm_decodes_every_fp8_code_exactly(dtype):
    """A holds every finite FP8 code once, B is the identity: C = A exactly (the interpreter's
    software decode, subnormals included); a NaN code makes its row NaN."""
    from lowprec.fp8.gemm import block_triton as block_gemm_triton
    from lowprec.fp8.cast.quantize import Float8Data

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    finite = codes[torch.isfinite(codes.float())]
    a_data = torch.zeros(4, 128, dtype=torch.uint8).view(dtype)
    a_data.view(-1)[: finite.numel()] = finite
    eye = torch.eye(128).to(E4M3)
    one = lambda r, c: torch.ones(r, c)  # noqa: E731 - unit scales
    a = Float8Data(a_data, one(4, 1), "block", (1, 128))
    b = Float8Data(eye, one(1, 1), "block", (128, 128))
    got = block_gemm_triton.mm(a, b, torch.float32)
    assert torch.equal(got, a_data.float())  # (-0.0 comes out +0.0: the dot adds +0.0 products)
    a_data.view(torch.uint8)[2, 5] = 0x7F  # NaN in both formats
    got = block_gemm_triton.mm(a, b, torch.float32)
    assert torch.isnan(got[2]).all() and not torch.isnan(got[[0, 1, 3]]).any()


def test_float8_linear_blockwise_on_the_triton_gemm(monkeypatch, seed):
    """The whole blockwise Float8Linear fwd+bwd with all three GEMMs on the Triton kernel (as on
    an sm_89 GPU: the dispatch says "triton"), against the emulated run."""
    from lowprec import fp8
    from lowprec.fp8.gemm import block_triton as block_gemm_triton, dispatch as gemm

    lin = torch.nn.Linear(256, 128, bias=False)  # K spans two 128-tiles
    x = torch.randn(48, 256) * 2
    paths, runs = [], []
    real = gemm.gemm_path
    monkeypatch.setattr(gemm, "gemm_path", lambda *a: paths.append(real(*a)) or paths[-1])
    for on in (True, False):
        monkeypatch.setattr(block_gemm_triton, "runs", lambda device, a, b, on=on: on)
        m = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("blockwise", gemm="auto" if on else "emulate"))
        xi = x.clone().requires_grad_()
        with fp8.autocast():
            y = m(xi)
        y.backward(torch.ones_like(y))
        runs.append((y.detach(), xi.grad, m.weight.grad))
    assert paths == ["triton"] * 3 + ["emulate"] * 3
    for got, want in zip(*runs):
        assert got.dtype == want.dtype
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


# --- the Triton grouped GEMM (grouped_triton): against the per-expert loop ----------------------
# Interpreter tiles are 16 x 32 x 32 (gemm_ops.GROUPED_TILE): K = 96 is three K tiles, N = 40 a ragged
# N tile, and the layouts put group edges inside and on row tiles, empty experts first, between
# and last, and a single group.
LAYOUTS = [(37, 0, 64, 19), (0, 0, 21, 0), (16, 1, 0, 33, 15), (50,)]
# (A's scales, the GEMM): tensorwise's output (E4M3 x E4M3, B from (E, N, K)) and grad_input (E5M2
# dY x E4M3 W, B stored (E, K, N)), rowwise's (per-row A, per-column B scales)
GROUPED_GEMMS = [("tensor", "output"), ("tensor", "grad_input"), ("axis", "output"), ("axis", "grad_input")]


def _grouped_operands(counts, gran, gemm, k=96, n=40, exact=False):
    """Per-expert casts as ``grouped_fn`` makes them. ``exact``: integer FP8 values in [-8, 8]
    and power-of-two scales, so every partial sum of K = 96 products is exact in float32."""
    from lowprec.fp8.cast.quantize import Float8Data

    a_dtype = E5M2 if (gran == "tensor" and gemm == "grad_input") else E4M3

    def cast(x, dtype, dim):
        if not exact:
            return fp8.quantize(x, dtype, gran, dim=dim)
        rows, cols = x.shape
        data = torch.randint(-8, 9, x.shape).float().to(dtype)
        shape = () if gran == "tensor" else ((rows, 1) if dim == 1 else (1, cols))
        scale = torch.exp2(torch.randint(-3, 4, shape).float())
        return Float8Data(data, scale, gran, None, True)

    from lowprec import fp8

    groups = [cast(torch.randn(c, k) * 3, a_dtype, 1) if c else None for c in counts]
    if gemm == "output":  # B = W_e^T: (N, K) weights cast along K, handed over transposed
        experts = [cast(torch.randn(n, k), E4M3, 1).t() for _ in counts]
    else:  # B = W_e (K_w, N_w): contract its rows, cast along them
        experts = [cast(torch.randn(k, n), E4M3, 0) for _ in counts]
    return groups, experts


@pytest.mark.parametrize("gran,gemm", GROUPED_GEMMS)
@pytest.mark.parametrize("counts", LAYOUTS)
def test_triton_grouped_gemm_is_the_loop_within_the_documented_bound(counts, gran, gemm, seed):
    """One launch for all groups against one scaled GEMM per expert (the CPU loop: exact bf16
    upcast, float32 accumulation, bf16 output): the same exact products summed in another order
    (``K * eps32 * (|A| @ |B|)``) plus the loop's bf16 rounding of its accumulator."""
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton
    from tests.conftest import assert_within_gemm_bound

    groups, experts = _grouped_operands(counts, gran, gemm)
    assert grouped_triton.supported(groups, experts)
    out_dtype = torch.float32 if (sum(counts) + len(gran)) % 2 else torch.bfloat16
    got = grouped_triton.mm(groups, experts, out_dtype)
    ref = grouped_gemm.grouped_mm(groups, experts, out_dtype, single_call=False, path="upcast")
    assert got.dtype == out_dtype and got.shape == ref.shape == (sum(counts), 40)
    start = 0
    for g, w in zip(groups, experts):
        if g is not None:
            rows = slice(start, start + g.data.shape[0])
            assert_within_gemm_bound(got[rows], ref[rows], g, w, output_roundings=1)
            start = rows.stop


@pytest.mark.parametrize("gran,gemm", GROUPED_GEMMS)
def test_triton_grouped_gemm_is_the_loop_bit_for_bit_where_sums_are_exact(gran, gemm, seed):
    """Where every partial sum is exact in float32 (integer FP8 values, power-of-two scales) the
    summation order cannot show, and the kernel equals the per-expert loop bit for bit: the same
    products, the same scale epilogue, the same one rounding to bf16. The kernel writes float32
    here and torch rounds it: the interpreter's own float32 -> bf16 store truncates (315.0 ->
    314.0; a GPU's rounds to nearest even), as its FP8 converts are not round-to-nearest either."""
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton

    for counts in LAYOUTS[:3]:
        groups, experts = _grouped_operands(counts, gran, gemm, exact=True)
        got = grouped_triton.mm(groups, experts, torch.float32)
        ref = grouped_gemm.grouped_mm(groups, experts, torch.bfloat16, single_call=False, path="upcast")
        assert torch.equal(got.to(torch.bfloat16), ref), counts


def test_triton_grouped_gemm_operator_under_fake_tensors_and_opcheck():
    """The operator's fake form gives the eager output's shape, dtype and strides (what
    torch.compile traces), and torch's operator checks pass (not test_schema: it compares the
    FP8 inputs with ops torch has no FP8 kernel for; inputs unchanged is checked by hand)."""
    from lowprec.fp8.gemm import grouped_triton

    groups, experts = _grouped_operands((5, 0, 20), "axis", "output")
    mat_a, mat_b, sa, sb, offs, rows, sizes = grouped_triton.pack(groups, experts)
    tiles = sum(-(-s // gemm_ops.grouped_tile(mat_a.device)[0]) for s in sizes)
    _opcheck_grouped(
        torch.ops.lowprec.grouped_scaled_mm.default, (mat_a, mat_b, sa, sb, offs, rows, tiles, torch.bfloat16)
    )


def _opcheck_grouped(op, args):
    """opcheck on a grouped operator (``torch.ops.lowprec.<name>.default``), its tensor inputs unchanged, and an upper bound on the row
    tiles (``args[6]``) as good as the count: the extra programs find no group."""
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in args[:5]]
    torch.library.opcheck(
        op,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    after = [t.view(torch.uint8) if t.element_size() == 1 else t for t in args[:5]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    more = op(*args[:6], args[6] + 3, torch.bfloat16)
    assert torch.equal(more, op(*args))


@pytest.fixture
def grouped_dispatch(monkeypatch):
    """The grouped kinds' dispatch as on a GPU where the Triton grouped GEMM passed its check:
    every call to it recorded."""
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton

    calls = []
    real = grouped_triton.mm
    monkeypatch.setattr(grouped_triton, "ready", lambda device: True)
    monkeypatch.setattr(grouped_triton, "mm", lambda a, b, out, *packed: calls.append(out) or real(a, b, out, *packed))
    monkeypatch.setattr(grouped_gemm, "_ROUTES_LOGGED", set())
    return calls


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_grouped_kinds_run_the_triton_gemm_where_torch_has_none(name, grouped_dispatch, caplog, seed):
    """No torch grouped kernel (Ada, or a torch without it): the output and grad_input GEMMs of
    all experts take the Triton kernel, logged once; the results are the per-expert loop's
    within 45 dB (the same casts), grad_weight (per expert in both) bit for bit."""
    from lowprec import fp8
    from lowprec.fp8.modules.grouped import Float8GroupedGemm
    from tests.conftest import sqnr

    counts, k, n = (21, 0, 40, 3), 64, 48
    x, w, dy = torch.randn(sum(counts), k) * 2, torch.randn(len(counts), n, k), torch.randn(sum(counts), n)
    runs = []
    for gemm in ("auto", "upcast"):
        recipe = fp8.Recipe.from_name(name, gemm=gemm)
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        with caplog.at_level("INFO", logger="lowprec.fp8"):
            out = Float8GroupedGemm(len(counts), recipe)(xt, wt, counts, recipe, torch.float32)
            out.backward(dy)
        runs.append((out.detach(), xt.grad, wt.grad))
    assert grouped_dispatch == [torch.float32, torch.float32]  # output, grad_input; "upcast": the loop
    # once per device and operand formats: tensorwise's E5M2 dY is a second line
    logged = caplog.text.count("lowprec Triton grouped FP8 GEMM, one launch for all experts")
    assert logged == (2 if name == "tensorwise" else 1)
    for got, want in zip(*runs):
        assert sqnr(want, got) >= 45
    assert torch.equal(runs[0][2], runs[1][2])


def test_torchs_kernel_keeps_what_it_takes_and_the_triton_gemm_the_e5m2_grad_input(grouped_dispatch, monkeypatch):
    """With torch's grouped kernel present (here its reference on CPU), tensorwise's output GEMM
    takes it and grad_input, whose E5M2 dY torch's kernel refuses, the Triton one."""
    from lowprec import fp8
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    native = []
    monkeypatch.setattr(grouped_gemm, "native_grouped_available", lambda device: True)
    monkeypatch.setitem(
        grouped_gemm.KERNEL,
        "scaled_grouped_mm",
        lambda *args: native.append(1) or grouped_gemm.reference_scaled_grouped_mm(*args),
    )
    monkeypatch.setattr(grouped_gemm, "_CHECKED", {})
    counts = (9, 17, 0)
    recipe = fp8.Recipe.from_name("tensorwise")
    x = torch.randn(sum(counts), 64, requires_grad=True)
    out = Float8GroupedGemm(3, recipe)(x, torch.randn(3, 32, 64), counts, recipe, torch.float32)
    out.backward(torch.randn_like(out))
    assert len(native) == 2 and len(grouped_dispatch) == 1  # torch's check + output; Triton: grad_input


# --- the Triton blockwise grouped GEMM (grouped_block_triton): against the dense block GEMM -------
# Interpreter tiles: 16 rows x 32 columns (gemm_ops.GROUPED_TILE), BLOCK_K the block size. K = 96 is
# three K tiles of 32 and one ragged 128-tile, N = 40 a ragged N tile and a ragged 32-block.
BLOCK_GEMMS = [("output", E4M3, 32), ("grad_input", E5M2, 32), ("output", E4M3, 128)]


def _block_grouped_operands(counts, gemm, a_dtype, bs, k=96, n=40, exact=False):
    """Per-expert casts as the blockwise kind makes them: token groups in 1 x bs tiles, the
    output GEMM's B an (N, K) weight in bs x bs blocks handed over transposed, grad_input's the
    (K, N) weight as it is. ``exact``: integer FP8 values in [-8, 8] and power-of-two block
    scales, so every partial sum (and each K tile's scaled sum) is exact in float32."""
    from lowprec.fp8.cast.quantize import Float8Data, quantize_blockwise

    def cast(x, dtype, block):
        if not exact:
            return quantize_blockwise(x, dtype, block, fused=False)
        rows, cols = x.shape
        shape = (-(-rows // block[0]), -(-cols // block[1]))
        scale = torch.exp2(torch.randint(-3, 4, shape).float())
        return Float8Data(torch.randint(-8, 9, x.shape).float().to(dtype), scale, "block", block, True)

    groups = [cast(torch.randn(c, k) * 3, a_dtype, (1, bs)) if c else None for c in counts]
    if gemm == "output":
        experts = [cast(torch.randn(n, k), E4M3, (bs, bs)).t() for _ in counts]
    else:
        experts = [cast(torch.randn(k, n), E4M3, (bs, bs)) for _ in counts]
    return groups, experts


@pytest.mark.parametrize("gemm,a_dtype,bs", BLOCK_GEMMS)
@pytest.mark.parametrize("counts", LAYOUTS)
def test_triton_block_grouped_gemm_is_the_dense_block_gemm_within_the_bound(counts, gemm, a_dtype, bs, seed):
    """One launch for all groups against the dense Triton blockwise GEMM per expert: the same
    K loop and per-K-tile scale epilogue, so the two differ only in the summation order inside a
    K tile's dot (the tiles' shapes differ), within ``K * eps32 * (|A| @ |B|)``, plus one bf16
    rounding where the output is bf16."""
    from lowprec.fp8.gemm import block_triton, grouped_block_triton
    from tests.conftest import assert_within_gemm_bound

    groups, experts = _block_grouped_operands(counts, gemm, a_dtype, bs)
    assert grouped_block_triton.supported(groups, experts)
    out_dtype = torch.float32 if (sum(counts) + bs) % 2 else torch.bfloat16
    got = grouped_block_triton.mm(groups, experts, out_dtype)
    assert got.dtype == out_dtype and got.shape == (sum(counts), 40)
    start = 0
    for g, w in zip(groups, experts):
        if g is not None:
            rows = slice(start, start + g.data.shape[0])
            ref = block_triton.mm(g, w, out_dtype)
            assert_within_gemm_bound(got[rows], ref, g, w, output_roundings=int(out_dtype == torch.bfloat16))
            start = rows.stop


@pytest.mark.parametrize("gemm,a_dtype,bs", BLOCK_GEMMS)
def test_triton_block_grouped_gemm_is_the_dense_block_gemm_bit_for_bit_where_sums_are_exact(gemm, a_dtype, bs, seed):
    """Where every partial sum is exact the summation order cannot show: each group's rows equal
    the dense Triton blockwise GEMM's for its expert bit for bit (float32 out; the interpreter's
    own float32 -> bf16 store truncates), and the float32 emulation's."""
    from lowprec.fp8.cast.quantize import dequantize
    from lowprec.fp8.gemm import block_triton, grouped_block_triton

    for counts in LAYOUTS[:3]:
        groups, experts = _block_grouped_operands(counts, gemm, a_dtype, bs, exact=True)
        got = grouped_block_triton.mm(groups, experts, torch.float32)
        live = [(g, w) for g, w in zip(groups, experts) if g is not None]
        dense = torch.cat([block_triton.mm(g, w, torch.float32) for g, w in live])
        assert torch.equal(got, dense), counts
        assert torch.equal(got, torch.cat([dequantize(g) @ dequantize(w) for g, w in live])), counts


def test_triton_block_grouped_gemm_operator_under_fake_tensors_and_opcheck():
    """The blockwise grouped operator's fake form and torch's operator checks, inputs unchanged;
    an upper bound on the row tiles gives the same result."""
    from lowprec.fp8.gemm import grouped_block_triton

    groups, experts = _block_grouped_operands((5, 0, 20), "output", E4M3, 32)
    mat_a, mat_b, sa, sb, offs, sizes = grouped_block_triton.pack(groups, experts)
    tiles = sum(-(-s // gemm_ops.grouped_tile(mat_a.device)[0]) for s in sizes)
    _opcheck_grouped(
        torch.ops.lowprec.grouped_block_scaled_mm.default, (mat_a, mat_b, sa, sb, offs, 32, tiles, torch.bfloat16)
    )


@pytest.mark.parametrize("block_size", [128, 32])
def test_blockwise_grouped_gemms_run_the_triton_block_gemm_in_one_launch_each(block_size, monkeypatch, caplog, seed):
    """As on a GPU where the blockwise grouped kernel passed its check: the blockwise kind's
    grouped output and grad_input GEMMs are one launch each for all experts (one operator call
    each), logged once; grad_weight per expert. Results within 45 dB of the
    per-expert loop (the same casts), grad_weight bit for bit; without the kernel the per-expert
    path runs as before (no call)."""
    from lowprec import fp8
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_block_triton
    from lowprec.fp8.modules.grouped import Float8GroupedGemm
    from tests.conftest import sqnr

    launches = []
    real = gemm_ops.grouped_block_scaled_mm
    monkeypatch.setattr(gemm_ops, "grouped_block_scaled_mm", lambda *a: launches.append(a[5]) or real(*a))
    monkeypatch.setattr(grouped_gemm, "_ROUTES_LOGGED", set())
    counts, k, n = (21, 0, 40, 3), 160, 72
    x, w, dy = torch.randn(sum(counts), k) * 2, torch.randn(len(counts), n, k), torch.randn(sum(counts), n)
    runs = []
    for ready in (True, False):
        monkeypatch.setattr(grouped_block_triton, "ready", lambda device, ready=ready: ready)
        recipe = fp8.Recipe.from_name("blockwise", block_size=block_size)
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        with caplog.at_level("INFO", logger="lowprec.fp8"):
            out = Float8GroupedGemm(len(counts), recipe)(xt, wt, counts, recipe, torch.float32)
            out.backward(dy)
        runs.append((out.detach(), xt.grad, wt.grad))
    assert launches == [block_size, block_size]  # output, grad_input; not ready: the per-expert path
    # once per device and operand formats: blockwise is E4M3 throughout
    assert caplog.text.count("lowprec Triton blockwise grouped FP8 GEMM, one launch for all experts") == 1
    for got, want in zip(*runs):
        assert sqnr(want, got) >= 45
    assert torch.equal(runs[0][2], runs[1][2])


def test_experts_cast_in_one_pass_feed_the_block_grouped_gemm_without_a_stack(monkeypatch, seed):
    """The experts' weights (E, N, K) cast as one (E*N, K) tensor (the fused kernel, as on CUDA;
    N a multiple of the block, so no block spans two experts): each expert's casts (both layouts)
    equal its own cast, they are views of one buffer per layout, and the blockwise grouped GEMM
    reads them there as one strided (E, K, N) operand (no stack) with the stacked run's result
    bit for bit, for the output GEMM (transposed views) and grad_input (the transposed copies)."""
    from lowprec.fp8 import kernels
    from lowprec.fp8.cast import block_cast
    from lowprec.fp8.cast.quantize import quantize
    from lowprec.fp8.gemm import grouped_block_triton, grouped_triton

    w = torch.randn(3, 64, 96)
    plain = [block_cast.cast_block_both(w[e], E4M3, 32, True, square=True) for e in range(3)]
    monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: True)
    rows, cols = block_cast.cast_experts_square(w, E4M3, 32, True)
    for (p, p_col), r, c in zip(plain, rows, cols):
        assert torch.equal(p.dequantize(), r.dequantize()) and torch.equal(p_col.dequantize(), c.dequantize())
        assert r.block == c.block == (32, 32)
    groups = [quantize(torch.randn(c, 96), E4M3, "block", block=(1, 32), power_of_2=True) for c in (5, 40, 17)]
    dgroups = [quantize(torch.randn(c, 64), E5M2, "block", block=(1, 32), power_of_2=True) for c in (5, 40, 17)]
    for a, b in ((groups, [r.t() for r in rows]), (dgroups, cols)):
        view = grouped_block_triton.experts_view(b)
        assert view is not None and torch.equal(
            view.view(torch.uint8), grouped_triton.stack_experts(b).view(torch.uint8)
        )
        got = grouped_block_triton.mm(a, b, torch.float32)
        monkeypatch.setattr(grouped_block_triton, "experts_view", lambda b: None)  # stacked instead
        assert torch.equal(got, grouped_block_triton.mm(a, b, torch.float32))
        monkeypatch.undo()
        monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: True)
    assert grouped_block_triton.experts_view([p for p, _ in plain]) is None  # separate casts: stacked
