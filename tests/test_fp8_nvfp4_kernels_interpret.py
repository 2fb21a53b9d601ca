"""The NVFP4 cast kernel (``lowprec::cast_nvfp4``, ``fp8/kernels/triton_nvfp4.py``) run by Triton's
CPU interpreter against ``quantize_nvfp4`` / ``quantize_nvfp4_2d`` / ``transpose_2d``, bit for bit:
packed E2M1 data and E4M3 scale bytes. Skipped where triton is not installed and on machines with a
GPU (test_fp8_kernels_gpu.py runs the compiled kernels there)."""

import pytest
import torch

from tests import triton_interpret

ops, _ = triton_interpret.load(__file__)

from lowprec.fp8.cast.hadamard import rht, rht_sign_bits  # noqa: E402
from lowprec.fp8.cast.nvfp4 import (  # noqa: E402
    quantize_nvfp4,
    quantize_nvfp4_2d,
    sr_key,
    tensor_scales,
    transpose_2d,
)
from lowprec.fp8.kernels import ops_nvfp4, reference, selfcheck, triton_nvfp4  # noqa: E402
from tests.test_fp8_kernels_interpret import awkward  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selfcheck, "PROBE_DIVISIBLE", triton_interpret.PROBE_DIVISIBLE)
    assert ops.interpreting()


def scales_of(x):
    return tensor_scales(reference.amax(x).float())


def same(got, want) -> bool:
    return all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def as_bytes(q):
    return q.data.view(torch.uint8), q.scale.view(torch.uint8)


def check(x, tile2d):
    """The kernel against the reference op, and the reference op against the cast functions
    themselves (which compute their own tensor scale)."""
    s, _ = scales_of(x)
    got = ops.cast_nvfp4(x, s, tile2d, True, tile2d)
    assert same(got, reference.cast_nvfp4(x, s, tile2d, True, tile2d))
    q = quantize_nvfp4_2d(x) if tile2d else quantize_nvfp4(x)
    assert same(got[:2], as_bytes(q))
    if tile2d:
        assert same(got[2:], as_bytes(transpose_2d(q)))
    return got


@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (17, 40), (33, 130), (64, 128), (48, 272)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tile2d", [False, True])
def test_cast_nvfp4_matches_the_torch_casts(tile2d, in_dtype, shape, seed):
    x = awkward(shape, in_dtype, spread=1.5 if in_dtype == torch.float16 else 3.0)
    check(x, tile2d)


def e2m1_ties() -> torch.Tensor:
    """A (16, 48) tensor whose amax is 2688 (S = 1): a block of amax 6 (scale 1) holding every
    E2M1 midpoint and its float32 neighbours, both signs; a block of amax 6 * 2**-10 (an E4M3
    subnormal scale); a flushed block (scale rounds to 0)."""
    x = torch.zeros(16, 48)
    x[0, 0] = 2688.0
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up = torch.nextafter(mids, torch.tensor(10.0))
    down = torch.nextafter(mids, torch.tensor(-10.0))
    vals = torch.cat([mids, up, down, torch.tensor([6.0, 5.9, 0.0])])  # 24
    x[1:5, 16:32] = torch.cat([vals, -vals, vals[:8] * 0.5, -vals[:8] * 2]).reshape(4, 16)
    x[1:5, 16] = 6.0
    x[5, 32:48] = torch.linspace(-1, 1, 16) * 6 * 2.0**-10
    x[6, 32:48] = 1e-30
    return x


@pytest.mark.parametrize("tile2d", [False, True])
def test_ties_subnormal_scales_and_flushed_blocks(tile2d):
    got = check(e2m1_ties(), tile2d)
    if not tile2d:
        assert got[1][6, 2].item() == 0  # flushed: the E4M3 scale rounded to 0


@pytest.mark.parametrize("tile2d", [False, True])
def test_zero_nan_and_inf_tensors(tile2d):
    """A zero tensor (S = 1, scale bytes 0), a NaN or an inf anywhere (S is NaN: every scale NaN,
    every code 0)."""
    for fill in (None, float("nan"), float("inf"), float("-inf")):
        x = torch.zeros(20, 40) if fill is None else torch.randn(20, 40)
        if fill is not None:
            x[7, 3] = fill
        got = check(x, tile2d)
        if fill is not None:
            assert (got[1] == 0x7F).all() and (got[0] == 0).all()


def test_a_wrong_kernel_fails_the_comparison(monkeypatch, seed):
    """The comparison sees a one-ulp mistake: the 0.75 boundary moved onto the tie (ties away
    from zero there) makes the kernel differ from the torch path."""
    x = e2m1_ties()
    s, _ = scales_of(x)
    monkeypatch.setattr(triton_nvfp4, "_B1", 0.75)
    got = ops.cast_nvfp4(x, s, False, True, False)
    assert not same(got, reference.cast_nvfp4(x, s, False, True, False))


@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (33, 130), (64, 128)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stream", [0, 12345, 2**63 - 25])
def test_stochastic_rounding_matches_the_torch_path(stream, in_dtype, shape, seed):
    """The kernel's counter-based noise (uint32 hashing) is the torch path's (int64 masked to 32
    bits): ``quantize_nvfp4(x, seed)`` bit for bit, for 64-bit seeds too."""
    x = awkward(shape, in_dtype)
    s, _ = scales_of(x)
    got = ops.cast_nvfp4(x, s, False, True, False, sr_key(stream))
    assert same(got, reference.cast_nvfp4(x, s, False, True, False, sr_key(stream)))
    assert same(got[:2], as_bytes(quantize_nvfp4(x, stream)))


@pytest.mark.parametrize("stream", [None, 99])
def test_a_transposed_view_is_read_in_place(stream, seed):
    """The weight-gradient operands (``apply_rht(t).t()``) are read through their strides: the
    casts of the view, as ``quantize_nvfp4`` of the view gives them."""
    base = awkward((96, 40), torch.float32)
    view = base.t()
    s, _ = scales_of(view)
    key = -1 if stream is None else sr_key(stream)
    got = ops.cast_nvfp4(view, s, False, True, False, key)
    assert same(got[:2], as_bytes(quantize_nvfp4(view, stream)))


@pytest.mark.parametrize("shape", [(1, 1), (17, 40), (37, 130), (64, 128), (100, 64)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stream", [None, 2**63 - 25])
def test_the_hadamard_transform_in_the_kernel(stream, in_dtype, shape, seed):
    """The weight-gradient operand's amax and cast with the random Hadamard transform applied in
    registers: ``quantize_nvfp4(rht(t, seed).t())`` bit for bit (rows zero-padded to 16)."""
    t = awkward(shape, in_dtype)
    bits = rht_sign_bits(5)
    rotated = rht(t, 5)
    amax = ops.rht_amax(t, bits)
    assert torch.equal(amax, reference.amax(rotated))
    s, _ = tensor_scales(amax)
    key = -1 if stream is None else sr_key(stream)
    got = ops.cast_nvfp4_rht(t, s, bits, key)
    assert same(got, reference.cast_nvfp4_rht(t, s, bits, key))
    assert same(got, as_bytes(quantize_nvfp4(rotated.t(), stream)))


def test_the_hadamard_kernels_on_nan_inf_and_a_wrong_sign():
    t = torch.randn(40, 24)
    t[3, 5] = float("inf")
    t[20, 7] = float("nan")
    bits = rht_sign_bits(1)
    assert ops.rht_amax(t, bits).isnan() and ops.rht_amax(t[:16], bits).isinf()
    for x in (t, t[:16]):
        s, _ = tensor_scales(reference.rht_amax(x, bits))
        assert same(ops.cast_nvfp4_rht(x, s, bits), reference.cast_nvfp4_rht(x, s, bits))
    x = torch.randn(32, 64)
    s, _ = tensor_scales(reference.rht_amax(x, bits))
    assert not same(ops.cast_nvfp4_rht(x, s, bits ^ 1), reference.cast_nvfp4_rht(x, s, bits))
    torch.library.opcheck(torch.ops.lowprec.cast_nvfp4_rht.default, (x, s, bits, sr_key(2)))
    torch.library.opcheck(torch.ops.lowprec.rht_amax.default, (x, bits))


def test_stochastic_rounding_in_the_kernel_is_unbiased():
    """Each value repeated 4096 times (one row each, in 16-blocks whose amax is 6: scale 1) rounds
    to the value on average, within 6 standard errors (step <= 2: 1 / sqrt(n) each)."""
    values = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.9, 2.2, 2.75, 3.3, 4.5, 5.9, -0.7, -4.1])
    n = 4096
    x = values[:, None].repeat(1, n)
    x[:, ::16] = 6.0  # every block's amax 6: S = 448, each block scale 448, the elements x itself
    s, _ = scales_of(x)
    q, sc, _, _ = ops.cast_nvfp4(x, s, False, True, False, sr_key(7))
    from lowprec.fp8.cast.nvfp4 import BlockScaledData

    dq = BlockScaledData(q.view(torch.float4_e2m1fn_x2), sc.view(torch.float8_e4m3fn), n, 16, s.reciprocal())
    d = dq.dequantize()
    keep = torch.ones(n, dtype=torch.bool)
    keep[::16] = False
    means = d[:, keep].mean(1)
    assert (means - values).abs().max() <= 6 / (n * 15 / 16) ** 0.5


def test_one_layout_alone_and_the_operator_fake(seed):
    x = awkward((40, 96), torch.bfloat16)
    s, _ = scales_of(x)
    full = ops.cast_nvfp4(x, s, True, True, True)
    rows, cols = ops.cast_nvfp4(x, s, True, True, False), ops.cast_nvfp4(x, s, True, False, True)
    assert same(rows[:2], full[:2]) and same(cols[2:], full[2:])
    assert rows[2].numel() == 0 and cols[0].numel() == 0
    with pytest.raises(ValueError, match="tile2d"):
        ops.cast_nvfp4(x, s, False, True, True)
    torch.library.opcheck(torch.ops.lowprec.cast_nvfp4.default, (x, s, False, True, False))
    torch.library.opcheck(torch.ops.lowprec.cast_nvfp4.default, (x, s, True, True, True))
    torch.library.opcheck(torch.ops.lowprec.cast_nvfp4.default, (x, s, False, True, False, sr_key(3)))
    with pytest.raises(ValueError, match="stochastic"):
        ops.cast_nvfp4(x, s, True, True, False, sr_key(3))


def test_the_self_check_agrees_on_its_probes():
    """What the first-use check on a GPU compares, on the probes of two classes."""
    for cls in ((torch.bfloat16, False, False), (torch.float32, True, True)):
        assert not selfcheck.run_checks(ops, reference, torch.device("cpu"), (cls,), ("cast_nvfp4", "cast_nvfp4_rht"))


def test_the_two_pass_fallback_of_the_nvfp4_casts():
    """The two-pass form (one store per launch) the first-use check switches a differing op to
    on a GPU gives the torch path's bits too (one input class: the probes cost seconds each under
    the interpreter; every class runs one pass in the tests above)."""
    x = torch.empty(64, 128, dtype=torch.float32)
    names = ("cast_nvfp4", "cast_nvfp4_dual")
    cls = (torch.float32, True, True)
    for name in names:
        ops.set_two_pass(cls, name, True)
    try:
        assert all(ops.two_pass(name, x) for name in names)
        assert not selfcheck.run_checks(ops, reference, torch.device("cpu"), (cls,), names)
    finally:
        ops._TWO_PASS.clear()


def test_nvfp4_linear_through_the_kernel_is_bit_identical(monkeypatch, seed):
    """A whole NVFP4 Float8Linear fwd+bwd with its casts through the kernels as on CUDA (x, the
    weight's two layouts from one call, dY's stochastically rounded cast for grad_input, x^T and
    dY^T with the random Hadamard transform in the kernel) gives the torch path's output and
    gradients bit for bit."""
    from lowprec import fp8
    from lowprec.fp8 import kernels
    from lowprec.fp8.kinds import nvfp4 as nvfp4_kind

    lin = torch.nn.Linear(96, 64, bias=False)
    x = torch.randn(40, 96) * 3
    outs, routed, keys = [], [], []
    real = kernels.cast_nvfp4
    for fused in (True, False):
        if fused:
            monkeypatch.setattr(
                kernels,
                "available",
                lambda device, op=None, x=None: routed.append(op) or op in ("cast_nvfp4", "cast_nvfp4_rht", "amax"),
            )
            # grad_input's weight: the kernel's transposed layout, never the torch unpack/repack
            monkeypatch.setattr(nvfp4_kind, "transpose_2d", lambda q: pytest.fail("transpose_2d ran"))
            monkeypatch.setattr(kernels, "cast_nvfp4", lambda *a: keys.append(a[5] if len(a) > 5 else -1) or real(*a))
        else:
            monkeypatch.undo()
        m = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("nvfp4"))
        xi = x.clone().requires_grad_()
        with fp8.autocast():
            y = m(xi)
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        outs.append((y.detach(), xi.grad, m.weight.grad))
    assert "cast_nvfp4" in routed and "cast_nvfp4_rht" in routed
    assert any(k >= 0 for k in keys)  # dY's stochastically rounded cast (grad_input) went there too
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(1, 1), (17, 40), (37, 130), (64, 128), (100, 64)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("streams", [(None, None), (2**63 - 25, 7), (None, 3)])
def test_both_operands_from_one_read(streams, in_dtype, shape, seed):
    """``nvfp4_dual_amax`` / ``cast_nvfp4_dual``: x's 1x16 cast and its Hadamard-rotated weight-gradient
    operand, each with its own tensor scale and rounding stream, are the separate ops' bit for bit
    (and ``quantize_nvfp4(x, s0)``, ``quantize_nvfp4(rht(x).t(), s1)``)."""
    t = awkward(shape, in_dtype)
    bits = rht_sign_bits(5)
    amaxes = ops.nvfp4_dual_amax(t, bits)
    assert torch.equal(amaxes, reference.nvfp4_dual_amax(t, bits))
    assert torch.equal(amaxes[0], ops.amax(t)) and torch.equal(amaxes[1], ops.rht_amax(t, bits))
    s, _ = tensor_scales(amaxes)
    keys = [-1 if k is None else sr_key(k) for k in streams]
    got = ops.cast_nvfp4_dual(t, s, bits, *keys)
    assert same(got, reference.cast_nvfp4_dual(t, s, bits, *keys))
    assert same(got[:2], ops.cast_nvfp4(t, s[0], False, True, False, keys[0])[:2])
    assert same(got[2:], ops.cast_nvfp4_rht(t, s[1], bits, keys[1]))
    assert same(got[:2], as_bytes(quantize_nvfp4(t, streams[0])))
    assert same(got[2:], as_bytes(quantize_nvfp4(rht(t, 5).t(), streams[1])))


def test_both_operands_on_zero_nan_inf_views_and_two_passes(monkeypatch):
    """A zero tensor, an inf, a NaN (every scale NaN), a transposed view read through its strides,
    and the two-pass form the device check falls back to."""
    bits = rht_sign_bits(3)
    for fill in (None, float("inf"), float("nan")):
        t = torch.zeros(40, 48) if fill is None else torch.randn(40, 48)
        if fill is not None:
            t[21, 5] = fill
        a = ops.nvfp4_dual_amax(t, bits)
        want = reference.nvfp4_dual_amax(t, bits)
        assert torch.equal(a.isnan(), want.isnan()) and torch.equal(a.nan_to_num(), want.nan_to_num())
        s, _ = tensor_scales(want)
        got = ops.cast_nvfp4_dual(t, s, bits, sr_key(1), sr_key(2))
        assert same(got, reference.cast_nvfp4_dual(t, s, bits, sr_key(1), sr_key(2)))
        if fill is not None and fill != fill:
            assert (got[1] == 0x7F).all() and (got[3] == 0x7F).all()
    view = awkward((48, 33), torch.float32).t()
    s, _ = tensor_scales(reference.nvfp4_dual_amax(view, bits))
    assert torch.equal(ops.nvfp4_dual_amax(view, bits), reference.nvfp4_dual_amax(view, bits))
    one = ops.cast_nvfp4_dual(view, s, bits, sr_key(4), -1)
    assert same(one, reference.cast_nvfp4_dual(view, s, bits, sr_key(4), -1))
    monkeypatch.setattr(ops_nvfp4, "two_pass", lambda name, x: name == "cast_nvfp4_dual")
    assert same(ops.cast_nvfp4_dual(view, s, bits, sr_key(4), -1), one)


def test_a_wrong_dual_kernel_fails_the_comparison(monkeypatch):
    """A moved E2M1 boundary, a flipped Hadamard sign, and the two streams swapped: each caught."""
    x = e2m1_ties()
    bits = rht_sign_bits(9)
    s, _ = tensor_scales(reference.nvfp4_dual_amax(x, bits))
    want = reference.cast_nvfp4_dual(x, s, bits, sr_key(1), sr_key(2))
    assert not same(ops.cast_nvfp4_dual(x, s, bits, sr_key(2), sr_key(1)), want)
    assert not same(ops.cast_nvfp4_dual(x, s, bits ^ 2, sr_key(1), sr_key(2)), want)
    assert not torch.equal(ops.nvfp4_dual_amax(torch.randn(32, 64), bits ^ 1), reference.nvfp4_dual_amax(x, bits))
    monkeypatch.setattr(triton_nvfp4, "_B1", 0.75)
    assert not same(ops.cast_nvfp4_dual(x, s, bits), reference.cast_nvfp4_dual(x, s, bits))


def test_the_dual_operators_and_their_self_check():
    x = awkward((40, 96), torch.bfloat16)
    bits = rht_sign_bits(2)
    s, _ = tensor_scales(reference.nvfp4_dual_amax(x, bits))
    torch.library.opcheck(torch.ops.lowprec.nvfp4_dual_amax.default, (x, bits))
    torch.library.opcheck(torch.ops.lowprec.cast_nvfp4_dual.default, (x, s, bits, sr_key(2), -1))
    with pytest.raises(ValueError, match="encode factors"):
        ops.cast_nvfp4_dual(x, s[0], bits)
    for cls in ((torch.bfloat16, False, False), (torch.float32, True, True)):
        assert not selfcheck.run_checks(ops, reference, torch.device("cpu"), (cls,), ("cast_nvfp4_dual",))


FUSED_OPS = ("cast_nvfp4", "cast_nvfp4_dual", "amax")


@pytest.mark.parametrize("grouped", [False, True])
def test_nvfp4_through_the_dual_kernels_is_bit_identical(monkeypatch, grouped, seed):
    """A whole NVFP4 Float8Linear (or grouped expert GEMMs) fwd+bwd with x's and dY's two operands
    each from ``nvfp4_dual_amax`` + ``cast_nvfp4_dual`` (dY with both its stochastic-rounding
    streams) gives the torch path's output and gradients bit for bit; the separate ops do not run
    for x or dY."""
    from lowprec import fp8
    from lowprec.fp8 import kernels

    outs, keys = [], []
    real = kernels.cast_nvfp4_dual
    for fused in (True, False):
        if fused:
            monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: op in FUSED_OPS)
            monkeypatch.setattr(kernels, "cast_nvfp4_dual", lambda *a: keys.append(a[3:]) or real(*a))
            monkeypatch.setattr(kernels, "cast_nvfp4_rht", lambda *a: pytest.fail("cast_nvfp4_rht ran"))
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        if grouped:
            from lowprec.fp8.kinds import base
            from lowprec.fp8.modules.grouped_mx import grouped_mx_gemms

            recipe = fp8.Recipe.from_name("nvfp4")
            w = (torch.randn(3, 48, 64) / 8).requires_grad_()
            xi = (torch.randn(41, 64) * 3).requires_grad_()
            seeds = [(11, 12), None, (13, 14)]
            y = grouped_mx_gemms(xi, w, (20, 0, 21), recipe, torch.float32, base.get("nvfp4").codec, seeds)
            params = w
        else:
            lin = torch.nn.Linear(96, 64, bias=False)
            m = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("nvfp4"))
            xi = (torch.randn(40, 96) * 3).requires_grad_()
            with fp8.autocast():
                y = m(xi)
            params = m.weight
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        outs.append((y.detach(), xi.grad, params.grad))
    assert len(keys) == (4 if grouped else 2) and all(k >= 0 for k in keys[-1]), keys
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
