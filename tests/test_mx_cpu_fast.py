"""The CPU fast path of the block-scaled recipes (lowprec/fp8/gemm/mx.py ``upcast``): exact bf16
operands, a bf16 GEMM within the documented bound of the float32 emulation, the fallback where
bf16 would not be exact, and the one-pass E2M1 encoder against the per-binade rounding rule."""

import warnings

import pytest
import torch

from conftest import assert_within_gemm_bound
from lowprec.fp8.gemm import mx as mx_gemm
from lowprec.fp8.cast.mx import quantize_mx
from lowprec.fp8.gemm.mx import _bf16_operand, mx_mm
from lowprec.fp8.cast.nvfp4 import FP4_MAX, _code_of, e2m1_encode, quantize_nvfp4, quantize_nvfp4_2d


class _Transposed:
    """B^T (N, K) seen as B (K, N), for the bound helper's ``dequant(a) @ dequant(b)``."""

    def __init__(self, q):
        self.q = q

    def dequantize(self):
        return self.q.dequantize().t()


def _cast(fmt, a, b):
    if fmt == "nvfp4":
        return quantize_nvfp4(a), quantize_nvfp4_2d(b)
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    return quantize_mx(a, dtype), quantize_mx(b)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("shape", [(64, 96, 48), (33, 70, 17)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fast_path_agrees_with_the_float32_emulation_within_the_bound(fmt, shape, out_dtype):
    m, k, n = shape
    g = torch.Generator().manual_seed(m * k + n)
    a, b = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g) / 5
    qa, qb = _cast(fmt, a, b)
    for q in (qa, qb):  # the operands themselves are exact: elements x block scales, no rounding
        ref = q.dequantize()
        got = _bf16_operand(q)[:, : q.cols].float()
        if q.tensor_scale is not None:
            ref = ref / q.tensor_scale  # dequantize folds the tensor scale in; the GEMM applies it as alpha
            assert torch.allclose(got, ref, rtol=2**-20, atol=0)
        else:
            assert torch.equal(got, ref)
    got = mx_mm(qa, qb, out_dtype)  # auto on CPU: the bf16 path
    ref = mx_mm(qa, qb, out_dtype, path="emulate")
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert_within_gemm_bound(got, ref, qa, _Transposed(qb), output_roundings=1)


def test_blocks_too_small_for_bf16_take_the_emulation(monkeypatch):
    a, b = torch.randn(8, 64), torch.randn(8, 64)
    a[0, :32] = 1e-36  # scale 2**-127+...: its elements times the scale fall below bf16's normal range
    a[1, :32] = 0.0  # an all-zero block (scale byte 0) is exact anyway
    qa, qb = quantize_mx(a), quantize_mx(b)
    assert int(qa.scale.view(torch.uint8)[0, 0]) < mx_gemm._MIN_EXACT_BYTE[torch.float8_e4m3fn]
    assert _bf16_operand(qa) is None
    assert _bf16_operand(quantize_mx(a[1:])) is not None
    called = []
    real = mx_gemm._emulate
    monkeypatch.setattr(mx_gemm, "_emulate", lambda *args: called.append(1) or real(*args))
    out = mx_mm(qa, qb, torch.float32)
    assert called and torch.equal(out, real(qa, qb, torch.float32))


def test_a_non_finite_block_reaches_the_output():
    a, b = torch.randn(4, 64), torch.randn(6, 64)
    a[2, 5] = float("inf")
    out = mx_mm(quantize_mx(a), quantize_mx(b), torch.bfloat16)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()
    assert torch.isnan(mx_mm(quantize_nvfp4(a), quantize_nvfp4_2d(b), torch.bfloat16)).all()


def test_one_pass_e2m1_encoding_is_round_to_nearest_even():
    grid = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 1e30, float("inf")])
    pts = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    g = torch.Generator().manual_seed(0)
    pts = torch.cat([pts, -pts, torch.randn(20000, generator=g) * 3, torch.tensor([float("nan")])])
    mag = _code_of(torch.nan_to_num(pts.abs(), nan=0.0).clamp(max=FP4_MAX), torch.round).to(torch.uint8)
    expected = mag | (((pts < 0) & (mag > 0)).to(torch.uint8) << 3)
    assert torch.equal(e2m1_encode(pts), expected)


@pytest.mark.parametrize("generator", [None, 7], ids=["rne", "stochastic"])
def test_e2m1_encoding_of_a_strided_view_is_silent_and_the_same(generator):
    # the column-major casts hand a transposed view: torch's bucketize warned once per program
    # ("input value tensor is non-contiguous") on the user's screen
    y = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strided = e2m1_encode(y.t(), generator)
    assert torch.equal(strided, e2m1_encode(y.t().contiguous(), generator))
