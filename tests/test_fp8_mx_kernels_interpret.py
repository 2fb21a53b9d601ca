"""The MXFP8 cast kernel (``lowprec::cast_mx``, ``fp8/kernels/triton_mx.py``) run by Triton's CPU
interpreter against ``quantize_mx``, bit for bit: elements and E8M0 scale bytes, along rows and
along columns (``quantize_mx(x.t())``) from one read. Skipped where triton is not installed and on
machines with a GPU (test_fp8_kernels_gpu.py runs the compiled kernel there)."""

import pytest
import torch

from tests import triton_interpret

ops, _ = triton_interpret.load(__file__)

from lowprec.fp8 import E4M3, E5M2  # noqa: E402
from lowprec.fp8.cast.mx import quantize_mx  # noqa: E402
from lowprec.fp8.kernels import reference, selfcheck  # noqa: E402
from tests.test_fp8_kernels_interpret import awkward  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.interpreting()


def assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert selfcheck._same(got, want), "differs from quantize_mx"


@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (64, 128), (67, 130)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rceil", [True, False])
def test_cast_mx_matches_quantize_mx(rceil, dtype, in_dtype, shape, seed):
    x = awkward(shape, in_dtype)
    got = ops.cast_mx(x, dtype, rceil, True, True)
    want = reference.cast_mx(x, dtype, rceil, True, True)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    # what quantize_mx itself holds: the row cast of x, the row cast of x.t()
    rounding = "rceil" if rceil else "floor"
    for (q, s), src in (((got[0], got[1]), x), ((got[2], got[3]), x.t())):
        ref = quantize_mx(src, dtype, rounding)
        assert_same(q, ref.data)
        assert torch.equal(s, ref.scale.view(torch.uint8))


@pytest.mark.parametrize("rows, cols", [(True, False), (False, True)])
def test_one_layout_alone(rows, cols, seed):
    x = awkward((40, 96), torch.bfloat16)
    q, s, qt, st = ops.cast_mx(x, E4M3, True, rows, cols)
    rq, rs, rqt, rst = reference.cast_mx(x, E4M3, True, rows, cols)
    for g, w in ((q, rq), (s, rs), (qt, rqt), (st, rst)):
        assert_same(g, w)
    assert (q.numel() == 0) == (not rows) and (qt.numel() == 0) == (not cols)


def test_block_edges_zeros_nan_inf_and_subnormal_amax():
    """A zero block (scale byte 0), a block holding NaN and one holding inf (byte 255), an amax
    whose mantissa is exactly 1.75 and just above (rceil's step), a subnormal amax, a huge one."""
    x = torch.zeros(32, 256)
    x[0, 32:64] = torch.linspace(-1, 1, 32)
    x[0, 64] = float("nan")
    x[0, 96] = float("-inf")
    x[0, 128] = 1.75 * 2.0**3
    x[1, 128] = torch.nextafter(torch.tensor(1.75 * 2.0**3), torch.tensor(100.0))
    x[2, 160:192] = 2.0**-140  # subnormal float32
    x[3, 192:224] = 3.0e38
    x[4:, :] = torch.randn(28, 256)
    for dtype in (E4M3, E5M2):
        for rceil in (True, False):
            got = ops.cast_mx(x, dtype, rceil, True, True)
            want = reference.cast_mx(x, dtype, rceil, True, True)
            for g, w in zip(got, want, strict=True):
                assert_same(g, w)
    s = ops.cast_mx(x, E4M3, True, True, False)[1]
    assert s[0, 0].item() == 0 and s[0, 2].item() == 255 and s[0, 3].item() == 255


def test_strided_input_reads_in_place(seed):
    """A transposed view is read through its strides: the same casts as its contiguous copy."""
    base = awkward((96, 40), torch.float32)
    view = base.t()
    got = ops.cast_mx(view, E5M2, True, True, True)
    want = ops.cast_mx(view.contiguous(), E5M2, True, True, True)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def test_operator_fake_matches(seed):
    x = awkward((48, 80), torch.float32)
    torch.library.opcheck(torch.ops.lowprec.cast_mx.default, (x, E4M3, True, True, True))
    torch.library.opcheck(torch.ops.lowprec.cast_mx.default, (x, E5M2, False, False, True))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_linear_through_the_kernel_is_bit_identical(monkeypatch, rounding, seed):
    """A whole MXFP8 Float8Linear fwd+bwd with its casts through the kernel (as on CUDA, the
    transposed operands of the backward GEMMs read as column casts of their bases) gives the
    torch path's output and gradients bit for bit."""
    from lowprec import fp8
    from lowprec.fp8 import kernels

    lin = torch.nn.Linear(96, 64, bias=False)
    x = torch.randn(40, 96) * 3
    outs = []
    for fused in (True, False):
        if fused:
            monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: op == "cast_mx")
        else:
            monkeypatch.undo()
        m = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("mxfp8", scale_rounding=rounding))
        xi = x.clone().requires_grad_()
        with fp8.autocast():
            y = m(xi)
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        outs.append((y.detach(), xi.grad, m.weight.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
