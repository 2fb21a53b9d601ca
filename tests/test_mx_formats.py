"""Block-scaled formats: E8M0, MXFP8 scale rounding and padding, E2M1, NVFP4, stochastic rounding,
the random Hadamard transform (lowprec/fp8/cast/mx.py, nvfp4.py, hadamard.py)."""

import math

import pytest
import torch

from lowprec.fp8.cast.hadamard import apply_rht, hadamard_matrix, random_hadamard
from lowprec.fp8.cast.mx import e8m0_decode, e8m0_encode, mx_scale_exponent, quantize_mx
from lowprec.fp8.cast.nvfp4 import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e2m1_pack,
    e2m1_unpack,
    quantize_nvfp4,
    quantize_nvfp4_2d,
    transpose_2d,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_every_e8m0_value_round_trips():
    bits = torch.arange(255, dtype=torch.uint8)  # 255 is NaN
    values = e8m0_decode(bits.view(torch.float8_e8m0fnu))
    assert torch.equal(values, torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float32))
    assert torch.equal(values, bits.view(torch.float8_e8m0fnu).to(torch.float32))  # torch's own decoding agrees
    k = torch.arange(-127, 128)
    assert torch.equal(e8m0_encode(k).view(torch.uint8), bits)
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu))).all()


@pytest.mark.parametrize(
    "amax,dtype,floor_k,rceil_k",
    [
        (448.0, E4M3, 0, 0),  # m = 1.75: both keep 448 representable
        (449.0, E4M3, 0, 1),  # m > 1.75: floor clips to 448, rceil moves up one binade
        (511.0, E4M3, 0, 1),
        (512.0, E4M3, 1, 1),
        (1.0, E4M3, -8, -8),
        (0.875, E4M3, -9, -9),  # 1.75 * 2**-1
        (0.9, E4M3, -9, -8),
        (57344.0, E5M2, 0, 0),
        (60000.0, E5M2, 0, 1),
        (0.0, E4M3, -127, -127),  # an all-zero block: the smallest scale
    ],
)
def test_scale_rounding_modes_on_hand_made_blocks(amax, dtype, floor_k, rceil_k):
    a = torch.tensor([amax])
    assert mx_scale_exponent(a, dtype, "floor").item() == floor_k
    assert mx_scale_exponent(a, dtype, "rceil").item() == rceil_k
    block = torch.zeros(1, 32)
    block[0, 5], block[0, 9] = amax, amax / 3
    for rounding, k in (("floor", floor_k), ("rceil", rceil_k)):
        q = quantize_mx(block, dtype, rounding)
        assert e8m0_decode(q.scale).item() == 2.0**k
        top = q.data.to(torch.float32)[0, 5].item()
        if amax:
            mx = 448.0 if dtype == E4M3 else 57344.0
            # rceil never saturates; floor clips exactly when amax / 2**k exceeds the max
            assert top == min(mx, top) and (top == mx) == (amax / 2.0**k >= mx)
            assert rounding == "floor" or amax / 2.0**k <= mx


def test_mx_blocks_run_along_the_contraction_dim_and_orientations_differ():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 96)  # columns of very different magnitudes
    rows, cols = quantize_mx(x), quantize_mx(x.t().contiguous())
    assert rows.scale.shape == (64, 3) and cols.scale.shape == (96, 2)
    # 1x32 and 32x1 casts of one tensor are different numbers (never re-quantized from each other)
    assert not torch.equal(rows.dequantize(), cols.dequantize().t())
    for q, src in ((rows, x), (cols, x.t())):
        rel = (q.dequantize() - src).abs() / src.abs().reshape(src.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1)[
            :, : src.shape[1]
        ]
        assert rel.max() <= 2.0**-3  # half an E4M3 step at the block's top binade, relative to the block amax


def test_ragged_shapes_pad_the_last_block_with_zeros():
    torch.manual_seed(1)
    x = torch.randn(5, 45)
    x[:, 32:] *= 1e-3  # the ragged last block (13 elements) is tiny: its scale must come from it alone
    q = quantize_mx(x)
    assert q.data.shape == (5, 64) and q.scale.shape == (5, 2) and q.cols == 45
    assert torch.equal(q.data[:, 45:].to(torch.float32), torch.zeros(5, 19))
    expected = mx_scale_exponent(x[:, 32:].abs().amax(1), E4M3, "rceil")
    assert torch.equal(q.scale[:, 1].view(torch.uint8).to(torch.int32), expected + 127)
    assert q.dequantize().shape == x.shape
    assert torch.allclose(q.dequantize()[:, 32:], x[:, 32:], rtol=2**-3, atol=0)
    n = quantize_nvfp4(x)
    assert n.data.shape == (5, 24) and n.scale.shape == (5, 3) and n.dequantize().shape == x.shape


def test_non_finite_values_reach_the_output():
    x = torch.randn(2, 64)
    x[0, 3] = float("inf")
    q = quantize_mx(x)
    deq = q.dequantize()
    assert torch.isnan(deq[0, :32]).all() and torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[1]).all()
    assert torch.isnan(quantize_nvfp4(x).dequantize()).all()  # the tensor scale carries it


def test_every_e2m1_value_round_trips_and_packs_two_per_byte():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    grid = torch.tensor(E2M1_VALUES)
    assert torch.equal(values, torch.cat([grid, -grid]))
    assert torch.equal(e2m1_encode(values), torch.where(codes == 8, 0, codes).to(torch.uint8))  # -0 -> +0
    packed = e2m1_pack(codes.reshape(2, 8))
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (2, 4)
    assert packed.view(torch.uint8)[0, 0].item() == 0x10  # element 0 in the low nibble, element 1 high
    assert torch.equal(e2m1_unpack(packed), values.reshape(2, 8))


def test_e2m1_round_to_nearest_ties_to_even():
    grid = torch.tensor(E2M1_VALUES)
    a = torch.cat([torch.linspace(0, 7, 7001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    dist = (a[:, None].clamp(max=6) - grid[None]).abs()
    nearest = dist == dist.min(1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    ref = torch.where(nearest.sum(1) > 1, even.int().argmax(1), dist.argmin(1))
    assert torch.equal(e2m1_encode(a).long(), ref)
    assert torch.equal(e2m1_encode(-a).long() & 7, ref)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    # 50_000 draws per value; one draw's variance is p(1-p) step^2 <= step^2/4 <= 1 (step <= 2), so
    # the mean's standard error is at most 1/sqrt(n) = 0.0045; 6 standard errors (0.027): a false
    # alarm rate of 2e-9 per value, while round-to-nearest (bias up to 0.5 here) fails by far
    values = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.9, 2.2, 2.75, 3.3, 4.5, 5.9, -0.7, -4.1])
    n = 50_000
    y = values.repeat(n, 1)
    g = torch.Generator().manual_seed(1234)
    codes = e2m1_encode(y, g)
    means = e2m1_decode(codes).mean(0)
    assert (means - values).abs().max() <= 6 * 1.0 / math.sqrt(n)
    assert not torch.equal(
        e2m1_encode(y[:10], torch.Generator().manual_seed(1)), e2m1_encode(y[:10], torch.Generator().manual_seed(2))
    )
    assert torch.equal(codes, e2m1_encode(y, torch.Generator().manual_seed(1234)))
    on_grid = torch.tensor(E2M1_VALUES).repeat(100, 1)
    assert torch.equal(e2m1_decode(e2m1_encode(on_grid, g)), on_grid)  # grid values never move


def test_the_counter_based_rounding_noise():
    """``sr_uniform``: the same bits from Python ints and int64 tensors (the kernel's uint32
    arithmetic), a pure function of (key, index), uniform on [0, 1) to the eye of its mean,
    variance and deciles, and unrelated between neighbouring keys."""
    from lowprec.fp8.cast.nvfp4 import mix32, sr_key, sr_uniform

    edge = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B9]
    assert mix32(torch.tensor(edge)).tolist() == [mix32(v) for v in edge]
    assert all(0 <= mix32(v) < 2**32 for v in edge) and len({mix32(v) for v in edge}) == len(edge)
    assert 0 <= sr_key(2**64 - 1) < 2**32 and sr_key(5) != sr_key(5 + 2**32)
    u = sr_uniform(sr_key(1234), (256, 1024), "cpu")
    assert torch.equal(u, sr_uniform(sr_key(1234), (256, 1024), "cpu"))
    assert u.min() >= 0 and u.max() < 1
    n = u.numel()  # mean 1/2 (sd 0.29 / sqrt(n)), variance 1/12, each decile 1/10 of the draws
    assert abs(u.mean().item() - 0.5) < 6 * 0.2887 / math.sqrt(n)
    assert abs(u.var().item() - 1 / 12) < 1e-3
    deciles = torch.histc(u, bins=10, min=0, max=1) / n
    assert (deciles - 0.1).abs().max() < 6 * math.sqrt(0.09 / n)
    v = sr_uniform(sr_key(1235), (256, 1024), "cpu")
    assert abs(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1].item()) < 0.01


def test_the_butterfly_hadamard_transform_is_apply_rhts():
    """``rht`` (the butterfly the fused cast computes) is ``apply_rht`` with the seed's Q up to
    float32 summation order, and keeps the weight-gradient product: (Q^T dY)^T (Q^T X) = dY^T X."""
    from lowprec.fp8.cast.hadamard import rht, rht_sign_bits

    torch.manual_seed(0)
    x, dy = torch.randn(37, 24), torch.randn(37, 8)
    q = random_hadamard(seed=11)
    a, b = rht(x, 11), apply_rht(x, q)
    assert a.shape == b.shape == (48, 24)
    assert (a - b).abs().max() <= 4 * 2.0**-24 * x.abs().max() * 16
    g = rht(dy, 11).t() @ rht(x, 11)
    assert torch.allclose(g, dy.t() @ x, atol=1e-4, rtol=1e-5)
    signs = q[0] * 4  # the first row of H16 is all ones
    assert rht_sign_bits(11) == sum(1 << i for i in range(16) if signs[i] < 0)


def test_nvfp4_two_level_scales():
    torch.manual_seed(2)
    x = torch.randn(8, 64) * 3
    q = quantize_nvfp4(x)
    amax = x.abs().amax()
    assert torch.allclose(q.tensor_scale, amax / (448 * 6))
    assert q.scale.dtype == E4M3 and q.scale.shape == (8, 4)
    block_amax = x.reshape(8, 4, 16).abs().amax(-1)
    # each E4M3 block scale maps its amax near 6: within E4M3's rounding (2**-4 relative)
    ratio = block_amax / (q.scale.to(torch.float32) * q.tensor_scale)
    assert ((ratio - 6).abs() <= 6 * 2**-4).all()
    err = (q.dequantize() - x).abs() / block_amax.repeat_interleave(16, 1)
    assert err.max() <= 1 / 6 * 1.07  # half of E2M1's largest step (2) over 6, times the scale's rounding


def test_nvfp4_weight_tiles_serve_both_orientations_exactly():
    torch.manual_seed(3)
    w = torch.randn(40, 50)  # ragged in both dims
    q = quantize_nvfp4_2d(w)
    tile_amax = torch.nn.functional.pad(w, (0, 14, 0, 8)).reshape(3, 16, 4, 16).abs().amax((1, 3))
    assert torch.equal(q.scale.view(torch.uint8)[0::16], (tile_amax / 6 / q.tensor_scale).to(E4M3).view(torch.uint8))
    qt = transpose_2d(q)
    assert qt.shape == (50, 40) and qt.scale.shape == (50, 3)
    assert torch.equal(qt.dequantize(), q.dequantize().t())  # the same weight forward and backward


def test_hadamard_is_orthogonal_and_undone_in_the_gemm():
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))
    q = random_hadamard(seed=7)
    assert torch.equal(q @ q.t(), torch.eye(16))  # entries +-1/4: exact in float32
    assert torch.equal(q, random_hadamard(seed=7)) and not torch.equal(q, random_hadamard(seed=8))
    # on a device: made once per (seed, size, device), so a step copies nothing from the host
    on = random_hadamard(seed=7, device="cpu")
    assert torch.equal(on, q) and random_hadamard(seed=7, device="cpu") is on
    assert random_hadamard(seed=8, device="cpu") is not on and random_hadamard(seed=7, n=8, device="cpu").shape == (
        8,
        8,
    )
    torch.manual_seed(4)
    dy, x = torch.randn(37, 24, dtype=torch.float64), torch.randn(37, 40, dtype=torch.float64)  # M ragged
    qa = q.to(torch.float64)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 11)).reshape(-1, 16, t.shape[1])  # noqa: E731
    dyh, xh = (torch.matmul(qa.t(), pad(t)).reshape(48, -1) for t in (dy, x))
    assert torch.allclose(dyh.t() @ xh, dy.t() @ x, rtol=0, atol=1e-12)
    # apply_rht (float32) is the same transform
    assert torch.allclose(apply_rht(x.float(), q).double(), xh, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
