"""The torch._scaled_mm path against emulation."""

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.gemm.dispatch import gemm_path, native_scaled_mm_available
from tests.conftest import assert_within_gemm_bound, sqnr

CPU = torch.device("cpu")


@pytest.mark.skipif(not native_scaled_mm_available(CPU), reason="torch._scaled_mm has no CPU kernel in this torch")
@pytest.mark.parametrize("gran", ["tensor", "axis"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128, 48), (33, 80, 17), (1, 16, 16)])
@pytest.mark.parametrize("b_dtype", [fp8.E4M3, fp8.E5M2])
def test_scaled_mm_matches_emulation_on_cpu(seed, gran, out_dtype, shape, b_dtype):
    # torch's CPU kernel dequantizes as data * (1/scale) and accumulates in float32, like the
    # emulation; on some CPUs it is bit-exact with it, on others (other summation orders, a GEMV
    # path for small M) not. So: agreement within float32 summation-order rounding, on any CPU.
    # Tiny shapes: this kernel runs at ~0.2 GFLOP/s on some CPUs.
    m, k, n = shape
    a = fp8.quantize(torch.randn(m, k) * 5, fp8.E4M3, gran, dim=1)
    b = fp8.quantize(torch.randn(n, k) / 7, b_dtype, gran, dim=1).t()
    native = fp8.scaled_mm(a, b, out_dtype, path="scaled_mm")
    emulated = fp8.scaled_mm(a, b, out_dtype, path="emulate")
    assert native.dtype == out_dtype
    assert_within_gemm_bound(native, emulated, a, b, output_roundings=1 if out_dtype == torch.bfloat16 else 0)


def test_mixed_tensor_and_axis_operands(seed):
    a = fp8.quantize(torch.randn(32, 64), fp8.E4M3, "axis", dim=1)
    b = fp8.quantize(torch.randn(64, 48), fp8.E4M3, "tensor")
    ref = a.dequantize() @ b.dequantize()
    assert_within_gemm_bound(fp8.scaled_mm(a, b, torch.float32), ref, a, b, output_roundings=1)


def test_block_scales_take_the_upcast_path_on_cpu(seed):
    x, w = torch.randn(64, 256), torch.randn(128, 256)
    a = fp8.quantize(x, fp8.E4M3, "block", block=(1, 128))
    b = fp8.quantize(w, fp8.E4M3, "block", block=(128, 128)).t()
    assert gemm_path("auto", CPU, a, b) == "upcast"
    assert sqnr(x @ w.t(), fp8.scaled_mm(a, b, torch.float32)) > 25
    with pytest.raises(RuntimeError, match="gemm='auto' or 'emulate'"):
        fp8.scaled_mm(a, b, torch.float32, path="scaled_mm")


def test_shape_mismatch_is_a_clear_error():
    a = fp8.quantize(torch.randn(4, 16), fp8.E4M3, "tensor")
    with pytest.raises(ValueError, match=r"\(M, K\) x \(K, N\)"):
        fp8.scaled_mm(a, a, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["tensor", "axis"])
def test_scaled_mm_matches_emulation_on_cuda(gran):
    dev = torch.device("cuda")
    if not native_scaled_mm_available(dev, gran):
        pytest.skip("GPU has no FP8 GEMM for this granularity")
    torch.manual_seed(0)
    a = fp8.quantize(torch.randn(1000, 4096, device=dev), fp8.E4M3, gran, dim=1)
    b = fp8.quantize(torch.randn(3000, 4096, device=dev), fp8.E4M3, gran, dim=1).t()
    native = fp8.scaled_mm(a, b, torch.float32, path="scaled_mm")
    emulated = fp8.scaled_mm(a, b, torch.float32, path="emulate")
    # cuBLAS sums in another order, in the tensor cores' FP8 accumulator, which keeps fewer
    # bits than float32 on Hopper (DeepSeek-V3 s3.3.2 measures ~14): 77.9 dB on an H200 for
    # tensor scales, where a float32 sum would agree to ~100; bf16 output for axis scales.
    assert sqnr(emulated, native) > (45 if gran == "axis" else 70)
