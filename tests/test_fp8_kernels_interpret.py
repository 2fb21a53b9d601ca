"""The Triton kernels run by Triton's CPU interpreter (``TRITON_INTERPRET=1``) against the
torch path, bit for bit.

Skipped where triton is not installed (CI) and on machines with a GPU, where
test_fp8_kernels_gpu.py runs the compiled kernels instead. The interpreter executes the
kernels' logic (tiling, masks for ragged edges, strides, the transposed store, the NaN/inf
rules, the amax atomics, the rowwise two-pass loop) with numpy; it does not compile them,
and its own float32 -> FP8 convert is not round-to-nearest-even, so the kernels' software
convert (``SOFT_CAST``) runs here, and the GPU tests check it equals the hardware one.
"""

import pytest
import torch

from tests import triton_interpret

ops, gemm_ops = triton_interpret.load(__file__)

from lowprec.fp8 import E4M3, E5M2  # noqa: E402
from lowprec.fp8.kernels import reference, selfcheck  # noqa: E402

FP8 = [E4M3, E5M2]
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selfcheck, "PROBE_DIVISIBLE", triton_interpret.PROBE_DIVISIBLE)
    assert ops.interpreting()


def bits(q):
    return q.view(torch.uint8)


def assert_same_fp8(got, ref):
    """Bit-identical finite codes, NaN exactly where the reference has NaN."""
    nan = torch.isnan(ref.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(bits(got)[~nan], bits(ref)[~nan])


def awkward(shape, in_dtype, spread=3.0):
    """Random values over many binades (saturating, normal, subnormal in FP8), exact zeros
    of both signs, and ties: what makes rounding and saturation rules visible."""
    x = torch.randn(shape) * torch.exp2(torch.empty(shape).uniform_(-spread * 4, spread * 4))
    flat = x.view(-1)
    n = flat.numel()
    if n >= 4:
        idx = torch.randperm(n)[: max(4, n // 10)]
        flat[idx[0]], flat[idx[1]] = 0.0, -0.0
        # ties between two E4M3/E5M2 codes: 1 + 2**-4 (E4M3 half ulp), 1 + 2**-3 (E5M2)
        flat[idx[2:]] = torch.tensor([1.0625, -17.0, 1.125, 0.0048828125])[torch.arange(len(idx) - 2) % 4]
    return x.to(in_dtype)


SHAPES = [(1, 1), (3, 200), (64, 64), (65, 130), (129, 63)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dtype", FP8)
def test_cast_transpose_amax_matches_the_torch_path(dtype, in_dtype, shape, seed):
    x = awkward(shape, in_dtype)
    scale = torch.tensor(FP8_MAX[dtype] / 64.0)  # values above 64 saturate
    q, qt, a = ops.cast_transpose_amax(x, scale, dtype)
    rq, rqt, ra = reference.cast_transpose_amax(x, scale, dtype)
    assert q.dtype == qt.dtype == dtype and q.shape == shape and qt.shape == shape[::-1]
    assert qt.is_contiguous()
    assert_same_fp8(q, rq)
    assert torch.equal(bits(qt), bits(q).t())
    assert a.dtype == torch.float32 and a.dim() == 0 and torch.equal(a, ra)


@pytest.mark.parametrize("shape", [(3, 200), (65, 130)])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("dtype", FP8)
def test_cast_into_writes_the_cast_into_a_slice_of_a_buffer(dtype, transpose, shape, seed):
    """The grouped path's cast (``lowprec::cast_into``): the bits of cast_transpose_amax, written
    into rows of a larger buffer (the rows around them untouched), the transpose and the amax
    (what delayed scaling records) returned; the torch path (``reference.cast_into``) the same."""
    x = awkward(shape, torch.bfloat16)
    scale = torch.tensor(FP8_MAX[dtype] / 64.0)
    buf = torch.full((shape[0] + 7, shape[1]), 0x5A, dtype=torch.uint8)
    qt, a = ops.cast_into(x, scale, dtype, transpose, buf[3 : 3 + shape[0]])
    rq, rqt, ra = ops.cast_transpose_amax(x, scale, dtype)
    assert torch.equal(buf[3 : 3 + shape[0]], bits(rq))
    assert (buf[:3] == 0x5A).all() and (buf[3 + shape[0] :] == 0x5A).all()
    assert a.dtype == torch.float32 and a.dim() == 0 and torch.equal(a, ra)
    if transpose:
        assert qt.dtype == dtype and qt.is_contiguous() and torch.equal(bits(qt), bits(rqt))
    else:
        assert qt.numel() == 0
    ref_buf = torch.zeros(shape, dtype=dtype)
    ref_qt, ref_a = reference.cast_into(x, scale, dtype, ref_buf, transpose)
    assert_same_fp8(buf[3 : 3 + shape[0]].view(dtype), ref_buf)
    assert torch.equal(a, ref_a) and (ref_qt is None) == (not transpose)
    if transpose:
        assert_same_fp8(qt, ref_qt)
    torch.library.opcheck(torch.ops.lowprec.cast_into.default, (x, scale, dtype, transpose, buf[3 : 3 + shape[0]]))


@pytest.mark.parametrize("row, col", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", FP8)
def test_cast_rowwise_into_writes_the_axis_casts_into_slices_of_buffers(dtype, row, col, seed):
    """The rowwise grouped path's cast (``lowprec::cast_rowwise_into``): the bits and row scales
    of cast_rowwise / cast_cols_t, written into rows of larger buffers (the rows around them
    untouched); the torch path (``reference.cast_rowwise_into``) the same."""
    from lowprec.fp8.cast.scaling import amax_to_scale

    shape = (45, 300)  # ragged against the 32 x 128 and 4 x 512 tiles
    x = awkward(shape, torch.bfloat16)
    cols = amax_to_scale(reference.amax_cols(torch.nan_to_num(x.float(), 0.0, 0.0, 0.0)), dtype, power_of_2=True)
    outs = []
    for m in (ops, reference):
        buf = torch.full((shape[0] + 7, shape[1]), 0x5A, dtype=torch.uint8)
        buf_t = torch.full((shape[1] + 7, shape[0]), 0x5A, dtype=torch.uint8)
        q = buf[3 : 3 + shape[0]] if row else buf[:0]
        qt = buf_t[3 : 3 + shape[1]] if col else buf_t[:0]
        outs.append((m.cast_rowwise_into(x, cols, dtype, True, q, qt), buf, buf_t))
    (scale, buf, buf_t), (ref_scale, ref_buf, ref_buf_t) = outs
    rq, rs = ops.cast_rowwise(x, dtype, True)
    if row:
        assert torch.equal(scale, rs) and torch.equal(ref_scale, rs)
        assert_same_fp8(buf[3 : 3 + shape[0]].view(dtype), rq)
    if col:
        assert_same_fp8(buf_t[3 : 3 + shape[1]].view(dtype), ops.cast_cols_t(x, cols, dtype))
    for b in (buf, buf_t):  # the rows around the slices, and an unasked buffer, untouched
        assert (b[:3] == 0x5A).all() and (b[-4:] == 0x5A).all()
    assert (buf == 0x5A).all() != row and (buf_t == 0x5A).all() != col
    assert_same_fp8(buf.view(dtype), ref_buf.view(dtype))
    assert_same_fp8(buf_t.view(dtype), ref_buf_t.view(dtype))
    q = buf[3 : 3 + shape[0]] if row else buf[:0]
    qt = buf_t[3 : 3 + shape[1]] if col else buf_t[:0]
    torch.library.opcheck(torch.ops.lowprec.cast_rowwise_into.default, (x, cols, dtype, True, q, qt))


@pytest.mark.parametrize("dtype", FP8)
def test_every_bfloat16_value_rounds_like_torch(dtype):
    """All 65536 bf16 bit patterns (every binade, subnormals, +-0, inf, NaN) at scale 1.

    Passed as float32: the interpreter's own bf16 -> float32 upcast (numpy bit emulation)
    turns the negative power-of-two bf16 subnormals into +0. A GPU test sends them as bf16.
    """
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    x = x.float()
    q, a = ops.cast_amax(x, torch.tensor(1.0), dtype)
    assert_same_fp8(q, reference.cast_amax(x, torch.tensor(1.0), dtype)[0])
    assert torch.isnan(a)  # the sweep holds NaNs


@pytest.mark.parametrize("dtype", FP8)
def test_float32_near_every_fp8_rounding_boundary(dtype, seed):
    """Each FP8 value's midpoints with its neighbours, and one float32 ulp either side."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    v = codes[torch.isfinite(codes)].unique()
    mids = (v[1:] + v[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), v])
    x = torch.cat([near, -near])[torch.randperm(2 * near.numel())].reshape(2, -1)
    q, _ = ops.cast_amax(x, torch.tensor(1.0), dtype)
    assert_same_fp8(q, reference.cast_amax(x, torch.tensor(1.0), dtype)[0])


@pytest.mark.parametrize("dtype", FP8)
def test_nan_and_inf_never_become_finite(dtype, seed):
    x = torch.randn(70, 90, dtype=torch.bfloat16)
    x[1, 2], x[69, 89], x[40, 0] = float("inf"), -float("inf"), float("nan")
    q, qt, a = ops.cast_transpose_amax(x, torch.tensor(1.0), dtype)
    bad = ~torch.isfinite(x)
    assert torch.isnan(q.float()[bad]).all() and torch.isnan(qt.float().t()[bad]).all()
    assert torch.isfinite(q.float()[~bad]).all()
    assert torch.isnan(a), "a NaN anywhere makes the amax NaN"
    x[40, 0] = 0.0
    assert torch.isinf(ops.cast_transpose_amax(x, torch.tensor(1.0), dtype)[2])


def test_nan_in_one_tile_wins_over_inf_in_another():
    """amax is an atomic max over tiles' bits: NaN (0x7FC00000) must beat inf (0x7F800000)
    whichever tile lands last."""
    for nan_at, inf_at in [((0, 0), (100, 100)), ((100, 100), (0, 0))]:
        x = torch.zeros(128, 128)
        x[nan_at], x[inf_at] = float("nan"), float("inf")
        assert torch.isnan(ops.cast_amax(x, torch.tensor(1.0), E4M3)[1])


def test_finite_input_overflowing_the_product_becomes_nan():
    """x * scale = inf in float32: NaN, as the torch path gives, never +-fp8_max."""
    x = torch.tensor([[3e38, -3e38, 1.0]])
    q, _ = ops.cast_amax(x, torch.tensor(10.0), E4M3)
    assert torch.isnan(q.float()[0, :2]).all() and q.float()[0, 2] == 10.0
    assert_same_fp8(q, reference.cast_amax(x, torch.tensor(10.0), E4M3)[0])


def test_zero_and_negative_zero_inputs():
    x = torch.tensor([[0.0, -0.0, 1e-30, -1e-30]])
    q, a = ops.cast_amax(x, torch.tensor(1.0), E4M3)
    assert_same_fp8(q, reference.cast_amax(x, torch.tensor(1.0), E4M3)[0])
    assert a.item() == 1e-30 or a.item() == torch.tensor(1e-30).item()


def test_strided_input(seed):
    base = torch.randn(96, 80, dtype=torch.bfloat16) * 30
    x = base.t()[:, 5:70]  # non-contiguous: strides (1, 80)
    s = torch.tensor(2.0)
    q, qt, a = ops.cast_transpose_amax(x, s, E4M3)
    rq, rqt, ra = reference.cast_transpose_amax(x, s, E4M3)
    assert_same_fp8(q, rq)
    assert torch.equal(bits(qt), bits(rqt)) and torch.equal(a, ra)


def test_cast_amax_equals_cast_transpose_amax(seed):
    x = torch.randn(77, 100) * 50
    s = torch.tensor(1.5)
    q1, _, a1 = ops.cast_transpose_amax(x, s, E5M2)
    q2, a2 = ops.cast_amax(x, s, E5M2)
    assert torch.equal(bits(q1), bits(q2)) and torch.equal(a1, a2)


@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("dtype", FP8)
def test_rowwise_matches_the_torch_path(dtype, power_of_2, seed):
    rows, cols = 13, 1100  # > 2 column chunks, ragged rows and columns
    x = torch.randn(rows, cols) * torch.logspace(-6, 6, rows)[:, None]
    x[3] = 0.0  # all-zero row: scale from AMAX_EPS, zeros stay zeros
    x[5, 7] = float("nan")  # that row's scale and values NaN
    x[8, 1000] = float("inf")  # that row's scale 0: finite -> 0, inf -> NaN
    x = x.to(torch.bfloat16)
    q, s = ops.cast_rowwise(x, dtype, power_of_2)
    rq, rs = reference.cast_rowwise(x, dtype, power_of_2)
    assert s.shape == (rows, 1) and s.dtype == torch.float32
    nan = torch.isnan(rs)
    assert torch.equal(torch.isnan(s), nan) and torch.equal(s[~nan], rs[~nan])
    assert_same_fp8(q, rq)
    assert torch.isnan(q.float()[5]).all() and q.float()[3].eq(0).all()


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="2-D"):
        ops.cast_amax(torch.randn(2, 3, 4), torch.tensor(1.0), E4M3)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.cast_amax(torch.ones(2, 3, dtype=torch.int32), torch.tensor(1.0), E4M3)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        ops.cast_amax(torch.randn(2, 3), torch.tensor(1.0), torch.float16)


@pytest.mark.parametrize("shape", [(1, 1), (65, 130), (129, 63)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_amax_and_column_amax_match_the_torch_path(in_dtype, shape, seed):
    x = awkward(shape, in_dtype)
    assert torch.equal(ops.amax(x), reference.amax(x))
    got, want = ops.amax_cols(x), reference.amax_cols(x)
    assert got.shape == (1, shape[1]) and torch.equal(got, want)
    x[shape[0] // 2, shape[1] - 1] = float("nan")  # that column's amax (and the tensor's) NaN
    assert torch.isnan(ops.amax(x))
    got, want = ops.amax_cols(x), reference.amax_cols(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
        got[~torch.isnan(want)], want[~torch.isnan(want)]
    )


@pytest.mark.parametrize("dtype", FP8)
def test_both_axis_casts_in_one_pass_match_the_torch_path(dtype, seed):
    rows, cols = 45, 300  # ragged against the 32 x 128 tile
    x = torch.randn(rows, cols) * torch.logspace(-6, 6, rows)[:, None]
    x[3] = 0.0
    x[8, 100] = float("inf")
    x = x.to(torch.bfloat16)
    from lowprec.fp8.cast.scaling import amax_to_scale

    col_scale = amax_to_scale(reference.amax_cols(x), dtype, power_of_2=True)
    q, rs, qt = ops.cast_rowwise_dual(x, col_scale, dtype, True)
    rq, rrs, rqt = reference.cast_rowwise_dual(x, col_scale, dtype, True)
    assert qt.shape == (cols, rows) and qt.is_contiguous()
    assert torch.equal(rs, rrs)
    assert_same_fp8(q, rq)
    assert_same_fp8(qt, rqt)
    assert_same_fp8(ops.cast_cols_t(x, col_scale, dtype), rqt)


def test_amax_alone_writes_no_cast(seed):
    x = awkward((70, 90), torch.bfloat16)
    assert torch.equal(ops.amax(x), ops.cast_amax(x, torch.tensor(1.0), E4M3)[1])


@pytest.mark.parametrize("changed", [False, True, "nan"])
def test_recast_if_changed_matches_the_torch_path(changed, seed):
    x = awkward((70, 90), torch.bfloat16)
    cast = torch.tensor(2.0)
    used = {False: torch.tensor(2.0), True: torch.tensor(0.25), "nan": torch.tensor(float("nan"))}[changed]
    q, qt, _ = ops.cast_transpose_amax(x, cast, E4M3)
    rq, rqt = q.clone(), qt.clone()
    ops.recast_if_changed(x, used, cast, q, qt)
    reference.recast_if_changed(x, used, cast, rq, rqt)
    assert_same_fp8(q, rq)
    assert torch.equal(bits(qt), bits(rqt))
    if changed is True:
        assert_same_fp8(q, reference.cast_amax(x, used, E4M3)[0])


@pytest.mark.parametrize("changed", [False, True])
def test_recast_if_changed_without_a_transposed_copy(changed, seed):
    """An empty ``qt`` (a grouped expert weight whose transposed copy is not kept): only ``q``,
    a slice of a larger buffer, is re-cast; the rows around it stay."""
    x = awkward((70, 90), torch.bfloat16)
    cast = torch.tensor(2.0)
    used = torch.tensor(0.25) if changed else cast.clone()
    buf = torch.full((75, 90), 0x5A, dtype=torch.uint8)
    ops.cast_into(x, cast, E4M3, False, buf[2:72])
    ref = buf.clone()
    empty = torch.empty(0, 0, dtype=E4M3)
    ops.recast_if_changed(x, used, cast, buf[2:72].view(E4M3), empty)
    reference.recast_if_changed(x, used, cast, ref[2:72].view(E4M3), empty)
    assert torch.equal(buf, ref)
    want = reference.cast_amax(x, used, E4M3)[0]
    assert_same_fp8(buf[2:72].view(E4M3), want)
    assert (buf[:2] == 0x5A).all() and (buf[72:] == 0x5A).all()


@pytest.mark.parametrize(
    "case", ["empty", "filled", "nan_amax", "zero_history", "interval", "no_refresh", "most_recent", "pow2_margin"]
)
def test_delayed_scale_update_matches_the_torch_path(case):
    """One kernel for a step of delayed scaling (TE semantics) against linear.delayed_scale_step."""
    L = 16
    hist = torch.zeros(L) if case in ("empty", "zero_history") else torch.rand(L) * 100
    amax_now = torch.tensor(float("nan") if case == "nan_amax" else (0.0 if case == "zero_history" else 37.5))
    scale, step = torch.tensor(3.0), torch.tensor(4 if case == "interval" else 6)  # (4 + 1) % 5 == 0: refresh
    kw = dict(
        fp8_dtype=E5M2 if case == "pow2_margin" else E4M3,
        margin=2 if case == "pow2_margin" else 0,
        power_of_2=case == "pow2_margin",
        interval=5 if case in ("interval", "no_refresh") else 1,
        algo_max=case != "most_recent",
    )
    h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
    got = ops.delayed_scale_update(h1, s1, step, amax_now, **kw)
    want = reference.delayed_scale_update(h2, s2, step, amax_now, **kw)
    for a, b in [*zip(got, want), (h1, h2), (s1, s2)]:
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)]), case


def blocky(rows, cols, in_dtype, block):
    """Per-tile magnitudes over many binades, an all-zero tile row, a NaN, an inf, ties."""
    x = torch.randn(rows, cols) * torch.exp2(torch.empty(rows, cols).uniform_(-8, 8))
    x = x * torch.logspace(-6, 6, rows)[:, None]
    x[: min(rows, block), : min(cols, block)] *= 0.0  # a whole zero tile: scale from AMAX_EPS
    x[-1, 0], x[rows // 2, -1] = float("nan"), float("inf")  # one tile NaN, one with scale 0
    x[1, block - 1 if cols >= block else 0] = 1.0625  # an E4M3 tie
    return x.to(in_dtype)


def assert_same_scale(got, want):
    nan = torch.isnan(want)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize(
    "dtype,in_dtype,power_of_2,shape,block",
    [
        (E4M3, torch.bfloat16, True, (200, 300), 128),  # the recipe's default, ragged against 128 tiles
        (E4M3, torch.float32, False, (200, 300), 128),
        (E5M2, torch.bfloat16, False, (200, 300), 128),
        (E5M2, torch.float32, True, (70, 40), 32),  # block_size 32
    ],
)
def test_blockwise_1d_casts_match_the_torch_path(dtype, in_dtype, power_of_2, shape, block, seed):
    """1 x block tiles into q and block x 1 tiles into the transposed qt, scales included, from one read."""
    x = blocky(*shape, in_dtype, block)
    q, rs, qt, cs = ops.cast_block_1d(x, dtype, block, power_of_2, True, True)
    rq, rrs, rqt, rcs = reference.cast_block_1d(x, dtype, block, power_of_2, True, True)
    assert qt.shape == shape[::-1] and qt.is_contiguous() and rs.t().is_contiguous()
    assert_same_scale(rs, rrs)
    assert_same_scale(cs, rcs)
    assert_same_fp8(q, rq)
    assert_same_fp8(qt, rqt)
    # one layout alone: the other outputs are empty
    q1, rs1, qt1, cs1 = ops.cast_block_1d(x, dtype, block, power_of_2, False, True)
    assert q1.numel() == rs1.numel() == 0 and torch.equal(bits(qt1), bits(qt))
    assert_same_scale(cs1, cs)


@pytest.mark.parametrize(
    "dtype,power_of_2,shape,block",
    [(E4M3, True, (300, 200), 128), (E5M2, False, (300, 200), 128), (E4M3, False, (40, 70), 32)],
)
def test_blockwise_square_casts_match_the_torch_path(dtype, power_of_2, shape, block, seed):
    x = blocky(*shape, torch.float32, block)
    q, s, qt, st = ops.cast_block_2d(x, dtype, block, power_of_2, True, True)
    rq, rs, rqt, rst = reference.cast_block_2d(x, dtype, block, power_of_2, True, True)
    assert_same_scale(s, rs)
    assert_same_scale(st, rst)
    assert_same_fp8(q, rq)
    assert_same_fp8(qt, rqt)
    assert qt.is_contiguous() and st.t().is_contiguous()
    # the transpose alone (the weight re-cast for grad_input in backward)
    q1, s1, qt1, st1 = ops.cast_block_2d(x, dtype, block, power_of_2, False, True)
    assert q1.numel() == 0 and torch.equal(bits(qt1), bits(qt))
    assert_same_scale(st1, rst)


@pytest.mark.parametrize("power_of_2", [True, False])
def test_block_scales_at_exact_powers_of_two(power_of_2):
    """Tile amaxes that make fp8_max / amax an exact power of two, and amaxes just off them:
    where a reciprocal-then-multiply scale or floor(log2) would be one power of two off."""
    base = torch.tensor([448.0, 1.75, 3.5, 7.0, 0.4375, 1e-13, 2.0**-20])
    amaxes = torch.cat([base, torch.nextafter(base, base * 2), torch.nextafter(base, base / 2)])
    x = torch.rand(amaxes.numel(), 128) * amaxes[:, None]
    x[:, 5] = amaxes
    q, rs, _, _ = ops.cast_block_1d(x, E4M3, 128, power_of_2, True, False)
    rq, rrs, _, _ = reference.cast_block_1d(x, E4M3, 128, power_of_2, True, False)
    assert_same_scale(rs, rrs)
    assert_same_fp8(q, rq)


def test_fused_blockwise_layouts_feed_the_gemms_without_copies(monkeypatch, seed):
    """The blockwise casts Float8Linear makes, through the kernels (as on CUDA): same values as
    the torch path, every operand already in the layout block_gemm hands to torch's kernel
    (A row-major, B column-major)."""
    from lowprec import fp8
    from lowprec.fp8 import kernels
    from lowprec.fp8.cast import block_cast

    x = torch.randn(256, 384, dtype=torch.bfloat16) * 3

    def casts():
        return (
            *block_cast.cast_block_both(x, E4M3, 128, False),
            block_cast.quantize_blockwise_fused(x, E4M3, (128, 128), False),
            block_cast.quantize_square_transposed(x, E4M3, 128, False),
        )

    plain = casts()
    monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: True)
    fused = casts()
    for p, f in zip(plain, fused):
        assert (p.block, p.granularity) == (f.block, f.granularity)
        assert torch.equal(p.dequantize(), f.dequantize())
    rows, cols, w, w_col = fused
    assert rows.data.is_contiguous() and rows.scale.t().is_contiguous()  # A of the output/grad_input GEMMs
    assert cols.data.t().is_contiguous() and cols.scale.is_contiguous()  # x as B (and dY^T as A) of wgrad
    assert w.data.is_contiguous() and w_col.data.t().is_contiguous() and w_col.scale.t().is_contiguous()
    # and a whole Float8Linear fwd+bwd through the fused casts agrees with the torch path
    lin = torch.nn.Linear(384, 256, bias=False)
    outs = []
    for fused_on in (True, False):
        if not fused_on:
            monkeypatch.undo()
        m = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("blockwise", gemm="emulate"))
        xi = x.float().clone().requires_grad_()
        with fp8.autocast():
            y = m(xi)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xi.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


NVFP4_OPS = ("cast_nvfp4", "cast_nvfp4_rht", "cast_nvfp4_dual")


def _non_nvfp4_ops() -> tuple[str, ...]:

    assert set(NVFP4_OPS) <= set(selfcheck.OPS)  # the names this file leaves to the NVFP4 one
    return tuple(n for n in selfcheck.OPS if n not in NVFP4_OPS)


NON_NVFP4_OPS = _non_nvfp4_ops()


@pytest.mark.parametrize("two_pass", [False, True])
def test_the_self_check_passes_the_kernels_in_one_and_two_passes(two_pass):
    """The first-use check's probes (ragged and 16-divisible, bf16 and float32, rows decades
    apart) find every op equal to the torch path, as one pass and as the two-pass fallback
    (one store per launch) the check switches a differing op to on a GPU."""

    for cls in selfcheck.CLASSES:
        for name in selfcheck.TWO_PASS_OPS:
            ops.set_two_pass(cls, name, two_pass)
    try:
        x = torch.empty(64, 128, dtype=torch.float32)
        assert all(ops.two_pass(name, x) == two_pass for name in selfcheck.TWO_PASS_OPS)
        classes = (*selfcheck.CLASSES, selfcheck._DELAYED)
        # two passes change only the ops that have them: those are checked again, the rest once;
        # NVFP4's ops in test_fp8_nvfp4_kernels_interpret.py (their probes cost minutes here)
        names = tuple(sorted(selfcheck.TWO_PASS_OPS - set(NVFP4_OPS))) if two_pass else NON_NVFP4_OPS
        assert selfcheck.run_checks(ops, reference, torch.device("cpu"), classes, names) == {}
    finally:
        ops._TWO_PASS.clear()


def test_the_self_check_finds_a_wrong_transposed_store(monkeypatch):
    """A kernel whose transposed output is wrong (as ptxas made it on the H200) is named."""

    real = ops.cast_transpose_amax

    def broken(x, scale, dtype):
        q, qt, a = real(x, scale, dtype)
        if x.dtype == torch.float32 and x.shape[0] % 16 == 0:  # as on the GPU
            qt = qt.clone()
            qt.view(torch.uint8)[1] = 0
        return q, qt, a

    monkeypatch.setattr(ops, "cast_transpose_amax", broken)
    classes = ((torch.float32, True, True), (torch.bfloat16, True, True), (torch.float32, False, False))
    # The broken op among its neighbours (the ops that launch the same cast kernel, checked before
    # and after it): only it is named. The other ops' checks never call ops.cast_transpose_amax, so
    # running them here would repeat, bit for bit, what the one-pass self-check test above checks
    # on every class (every one of them agrees).
    names = ("cast_amax", "cast_transpose_amax", "recast_if_changed", "amax")
    assert set(names) <= set(NON_NVFP4_OPS)
    bad = selfcheck.run_checks(ops, reference, torch.device("cpu"), classes, names)
    assert set(bad) == {"cast_transpose_amax"}
    assert bad["cast_transpose_amax"] == ["float32 144x176 float8_e4m3fn", "float32 144x176 float8_e5m2"]


def _bits_or_self(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_operators_are_opaque_to_compile_and_their_fakes_match(seed):
    """Under torch.compile the operators stay calls into their own launches (the binaries the
    first-use self-check ran; Inductor does not re-compile the kernels), their fake
    implementations give the real outputs' shapes, dtypes and strides (opcheck), and a
    compiled function calling every operator gives the eager bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    assert not ops.TRACED
    x = awkward((48, 80), torch.float32)
    s = torch.tensor(448.0 / 8)
    cols = torch.rand(1, 80) + 0.5

    def f(x, s, cols):
        out = [*ops.cast_transpose_amax(x, s, E4M3), *ops.cast_amax(x, s, E5M2)]
        out += [*ops.cast_rowwise(x, E4M3, True), ops.amax(x), ops.amax_cols(x)]
        out += [*ops.cast_rowwise_dual(x, cols, E4M3, True), ops.cast_cols_t(x, cols, E5M2)]
        out += [*ops.cast_block_1d(x, E4M3, 16, True, True, True), *ops.cast_block_2d(x, E4M3, 16, False, True, True)]
        return out

    eager = f(x, s, cols)
    with FakeTensorMode() as mode:
        fakes = f(mode.from_tensor(x), mode.from_tensor(s), mode.from_tensor(cols))
    for e, k in zip(eager, fakes, strict=True):
        assert (k.shape, k.dtype, k.stride()) == (e.shape, e.dtype, e.stride())
    # what AOTAutograd and Inductor see: the operator, not the kernels inside it
    gm = make_fx(f, tracing_mode="fake")(x, s, cols)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "lowprec.cast_transpose_amax.default" in targets and not any("triton_kernel" in t for t in targets)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, s, cols)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(_bits_or_self(e), _bits_or_self(c))
    torch.library.opcheck(torch.ops.lowprec.cast_transpose_amax.default, (x, s, E4M3))
    torch.library.opcheck(torch.ops.lowprec.cast_block_1d.default, (x, E4M3, 16, True, True, True))
    torch.library.opcheck(torch.ops.lowprec.cast_rowwise_dual.default, (x, cols, E4M3, True))
