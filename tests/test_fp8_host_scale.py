"""The CPU host-float scale arithmetic (fp8/cast/host_scale.py) gives torch's bits exactly."""

import math

import pytest
import torch

from lowprec.fp8.cast import host_scale
from lowprec.fp8.cast.quantize import quantize_tensorwise
from lowprec.fp8.cast.scaling import amax, amax_to_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _amaxes():
    gen = torch.Generator().manual_seed(0)
    mags = torch.rand(400, generator=gen, dtype=torch.float64) * 80 - 50  # 1e-50 .. 1e30
    vals = (10.0**mags).to(torch.float32).tolist()
    return vals + [0.0, 1e-12, 1e-13, 448.0, 57344.0, 3.0e38, math.inf, math.nan]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_value_matches_amax_to_scale(dtype, margin):
    for a in _amaxes():
        ref = amax_to_scale(torch.tensor(a, dtype=torch.float32), dtype, margin=margin).item()
        got = host_scale.scale_value(a, dtype, margin)
        assert got == ref or (math.isnan(got) and math.isnan(ref)), (a, got, ref)


def test_reciprocal_and_product_match_float32_ops():
    vals = [v for v in _amaxes() if not math.isnan(v)] + [-2.5, -0.0]
    for a, b in zip(vals, reversed(vals)):
        ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
        ra, rb = ta.reciprocal(), tb.reciprocal()
        assert host_scale.reciprocal32(ta.item()) == ra.item()
        ref = (ra * rb).item()
        got = host_scale.f32(host_scale.reciprocal32(ta.item()) * host_scale.reciprocal32(tb.item()))
        assert got == ref or (math.isnan(got) and math.isnan(ref)), (a, b, got, ref)


def test_amax_value_matches_amax_including_nan():
    x = torch.randn(64, 48, dtype=torch.bfloat16) * 3
    assert host_scale.amax_value(x) == amax(x).item()
    x[3, 5] = float("nan")
    assert math.isnan(host_scale.amax_value(x))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("special", [None, "inf", "nan", "zeros"])
def test_cpu_tensorwise_cast_equals_torch_expression(dtype, special):
    """The CPU cast (host scale) against the torch expressions it replaces."""
    x = torch.randn(32, 40) * 5
    if special == "inf":
        x[1, 2] = float("inf")
    elif special == "nan":
        x[0, 0] = float("nan")
    elif special == "zeros":
        x.zero_()
    q = quantize_tensorwise(x.to(torch.bfloat16), dtype, margin=1)
    scale = amax_to_scale(amax(x.to(torch.bfloat16).float()), dtype, margin=1)
    m = 448.0 if dtype == E4M3 else 57344.0
    ref = (x.to(torch.bfloat16).float() * scale).clamp(-m, m).to(dtype)
    assert torch.equal(q.scale, scale) or (q.scale.isnan().item() and scale.isnan().item())
    assert torch.equal(q.data.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_cast_rounds_just_above_max_to_max(dtype):
    """What lets the CPU cast skip its clamp: torch's FP8 cast takes values a few float32 ulps
    above fp8_max (where amax * scale can land) to fp8_max, not to NaN."""
    m = 448.0 if dtype == E4M3 else 57344.0
    t = torch.tensor([m * (1 + 2**-23), m * (1 + 2**-20), -m * (1 + 2**-20)])
    assert t.to(dtype).float().tolist() == [m, m, -m]
    x = torch.randn(4096) * 7
    for a in x.abs().tolist()[:200]:  # the amax element itself, scaled by its own scale
        s = host_scale.scale_value(a, dtype)
        assert abs(a * s) <= m * (1 + 2**-20)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("interval,margin", [(1, 0), (2, 1), (3, 0)])
def test_delayed_step_matches_delayed_scale_step(algo, interval, margin):
    """The CPU delayed-scaling update against the torch one, over a sequence with zeros,
    inf and NaN amaxes (which the history must keep out)."""
    from lowprec.fp8.recipes import Recipe
    from lowprec.fp8.cast.scaling import delayed_scale_step

    recipe = Recipe.from_name("delayed", amax_history_len=4, amax_compute_algo=algo, interval=interval, margin=margin)
    hist_a, hist_b = torch.zeros(4), torch.zeros(4)
    scale_a, scale_b = torch.ones(()), torch.ones(())
    seq = [0.0, 3.5, math.inf, 120.0, 1e-13, math.nan, 7.25, 0.5, 2e4, 1.0, 0.0, 9.0]
    for step, a in enumerate(seq):
        st = torch.tensor(step)
        used, new_hist, new_scale = delayed_scale_step(hist_a, scale_a, st, torch.tensor(a), E4M3, recipe)
        hist_a.copy_(new_hist)
        scale_a.copy_(new_scale)
        got = host_scale.delayed_step(hist_b, scale_b, st, a, E4M3, recipe)
        assert torch.equal(hist_a, hist_b), step
        assert torch.equal(scale_a.nan_to_num(-1.0), scale_b.nan_to_num(-1.0)), step
        assert got == used.item() or (math.isnan(got) and used.isnan().item()), step
