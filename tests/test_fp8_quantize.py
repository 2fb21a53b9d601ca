"""Scaled casts: range, granularity, special values."""

import math

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.cast.quantize import quantize_axiswise, quantize_blockwise, quantize_tensorwise
from lowprec.fp8.cast.scaling import amax_to_scale
from tests.conftest import sqnr


@pytest.mark.parametrize("dtype,floor_db", [(fp8.E4M3, 28.0), (fp8.E5M2, 22.0)])
@pytest.mark.parametrize("gran", ["tensor", "axis", "block"])
def test_round_trip_sqnr(seed, dtype, floor_db, gran):
    # E4M3 has 3 mantissa bits: ~31 dB on N(0,1); E5M2 has 2: ~25 dB. A wrong scale is < 10 dB.
    x = torch.randn(96, 320) * 3
    q = fp8.quantize(x, dtype, gran, dim=1, block=(1, 128))
    assert q.data.dtype == dtype
    assert sqnr(x, q.dequantize()) > floor_db


def test_scale_uses_full_range(seed):
    x = torch.randn(64, 64)
    q = quantize_tensorwise(x, fp8.E4M3)
    assert q.data.float().abs().max().item() == pytest.approx(448.0, rel=0.07)


def test_axiswise_scale_shape_and_pow2(seed):
    x = torch.randn(32, 48) * torch.logspace(-3, 3, 32)[:, None]
    q = quantize_axiswise(x, fp8.E4M3, dim=1, power_of_2=True)
    assert q.scale.shape == (32, 1)
    for s in q.scale.flatten().tolist():
        assert math.frexp(s)[0] == 0.5  # exact power of two
    # every row uses its own range: the largest element of each row lands in [224, 448]
    row_max = q.data.float().abs().amax(dim=1)
    assert bool(((row_max >= 224) & (row_max <= 448)).all())


def test_blockwise_ragged_edges(seed):
    x = torch.randn(130, 200)
    q = quantize_blockwise(x, fp8.E4M3, (128, 128))
    assert q.scale.shape == (2, 2)
    assert sqnr(x, q.dequantize()) > 28


def test_zero_tensor_stays_zero():
    for gran in ("tensor", "axis", "block"):
        q = fp8.quantize(torch.zeros(16, 128), fp8.E4M3, gran, dim=1)
        assert torch.isfinite(q.scale).all()
        assert q.dequantize().abs().sum().item() == 0.0


def test_nan_is_never_finite():
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    for gran in ("tensor", "axis", "block"):
        q = fp8.quantize(x, fp8.E4M3, gran, dim=1)
        assert torch.isnan(q.dequantize()[3, 5])


def test_inf_does_not_become_finite():
    x = torch.randn(16, 32)
    x[0, 0] = float("inf")
    q = quantize_tensorwise(x, fp8.E4M3)
    assert not torch.isfinite(q.dequantize()).all()
    # a given (delayed) scale: inf must not saturate to 448 either
    q2 = quantize_tensorwise(x, fp8.E4M3, scale=torch.tensor(1.0))
    assert not torch.isfinite(q2.dequantize()[0, 0])
    assert (
        fp8.saturated_cast(torch.tensor([float("-inf")]), fp8.E5M2).float().isnan().all()
        or not torch.isfinite(fp8.saturated_cast(torch.tensor([float("-inf")]), fp8.E5M2).float()).all()
    )


def test_saturation_clamps_finite_values():
    y = fp8.saturated_cast(torch.tensor([1e6, -1e6, 3.0]), fp8.E4M3).float()
    assert y.tolist() == [448.0, -448.0, 3.0]


def test_margin_and_pow2_scale():
    a = torch.tensor(3.0)
    assert amax_to_scale(a, fp8.E4M3).item() == pytest.approx(448 / 3)
    assert amax_to_scale(a, fp8.E4M3, margin=2).item() == pytest.approx(448 / 3 / 4)
    assert amax_to_scale(a, fp8.E4M3, power_of_2=True).item() == 128.0  # 149.3 rounded down


def test_scales_are_exact_divisions_floored_by_their_exponent():
    """fp8_max / amax is one correctly rounded division (448 / 56 is 8, not the
    7.999999999999999 of ``56 ** -1 * 448``), and the power of two is its exponent: the same
    number on every device and in the Triton kernels (the H200 run found 4 against 8)."""
    from lowprec.fp8.cast.scaling import floor_pow2

    E4M3, E5M2 = fp8.E4M3, fp8.E5M2
    amax = torch.tensor([56.0, 14.0, 448.0, 3.0, 0.0, float("inf"), float("nan")])
    assert amax_to_scale(amax, E4M3)[:3].tolist() == [8.0, 32.0, 1.0]
    assert amax_to_scale(amax, E5M2)[1].item() == 4096.0
    pow2 = amax_to_scale(amax, E4M3, power_of_2=True)
    assert pow2[:4].tolist() == [8.0, 32.0, 1.0, 128.0]  # 448 / 3 = 149.3 -> 128
    assert pow2[4].item() == 2.0 ** int(torch.tensor(448.0 / 1e-12).log2().floor())  # eps-clamped zero amax
    assert pow2[5].item() == 0.0 and torch.isnan(pow2[6])
    s = torch.tensor([1.0, 1.5, 7.999999999999999, 8.0, 3e-300, 0.0], dtype=torch.float64)
    assert floor_pow2(s).tolist() == [1.0, 1.0, 4.0, 8.0, 2.0**-995, 0.0]
