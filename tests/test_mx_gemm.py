"""Block-scaled GEMM dispatch (lowprec/fp8/gemm/mx.py): the swizzled scale layout against a
reference written from NVIDIA's documentation, emulation against dequantization, the native
call's plumbing through a CPU stand-in for torch's scaled_mm, and the path rules."""

import pytest
import torch

from lowprec.fp8.gemm import mx as mx_gemm
from lowprec.fp8.cast.mx import BlockScaledData, e8m0_decode, quantize_mx
from lowprec.fp8.gemm.mx import mx_gemm_path, mx_mm, native_block_scaled_available, swizzle_scales
from lowprec.fp8.cast.nvfp4 import e2m1_unpack, quantize_nvfp4, quantize_nvfp4_2d


def reference_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS "1D block scaling factors layout", written element by element from the docs: the
    scale matrix is cut into 128-row x 4-column tiles (zero-padded), tiles stored one after the
    other along the rows of tiles; in a tile, the scale of row r, column c is at byte
    (r mod 32) * 16 + (r div 32) * 4 + c (the 512-byte tile is a 32 x 16 array
    whose row i holds rows i, i+32, i+64, i+96 of the tile, 4 scales each)."""
    rows, cols = scale.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(tiles_r * tiles_c * 512, dtype=torch.uint8)
    raw = scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_c + c // 4
            rr, cc = r % 128, c % 4
            out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = raw[r, c]
    return out


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of the reference layout (for the scaled_mm stand-in)."""
    tiles_c = -(-cols // 4)
    out = torch.empty(rows, cols, dtype=torch.uint8)
    raw = flat.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_c + c // 4
            rr = r % 128
            out[r, c] = raw[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4]
    return out


@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 5), (7, 3), (257, 9)])
def test_swizzled_scale_layout_matches_the_documented_one(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    scale = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = swizzle_scales(scale)
    assert got.dtype == torch.float8_e8m0fnu
    assert torch.equal(got.view(torch.uint8), reference_swizzle(scale))


def test_emulation_is_dequantize_then_matmul():
    torch.manual_seed(0)
    a, b = torch.randn(33, 70), torch.randn(20, 70)
    qa, qb = quantize_mx(a), quantize_mx(b)
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    assert torch.allclose(mx_mm(qa, qb, torch.float32, path="emulate").double(), ref, rtol=1e-5, atol=1e-4)
    na, nb = quantize_nvfp4(a), quantize_nvfp4_2d(b)
    ref = na.dequantize().double() @ nb.dequantize().double().t()
    assert torch.allclose(mx_mm(na, nb, torch.float32, path="emulate").double(), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="quantized along the same K"):
        mx_mm(qa, quantize_mx(torch.randn(20, 64)), torch.float32)
    with pytest.raises(ValueError, match="nvfp4"):
        mx_mm(qa, nb, torch.float32)


def test_paths_on_a_machine_without_the_kernel():
    cpu = torch.device("cpu")
    assert not native_block_scaled_available(cpu)
    assert mx_gemm_path("auto", cpu) == "upcast" and mx_gemm_path("upcast", cpu) == "upcast"
    assert mx_gemm_path("emulate", cpu) == "emulate"
    with pytest.raises(RuntimeError, match="sm_100"):
        mx_gemm_path("scaled_mm", cpu)


def fake_scaled_mm(calls):
    """A CPU stand-in for torch.nn.functional.scaled_mm that reads swizzled block scales the
    documented way and computes the block-scaled product."""
    F = torch.nn.functional

    def decode(data, scale, recipe, rows):
        if isinstance(recipe, list):  # NVFP4: [BlockWise1x16, TensorWise]
            block_scale, tensor_scale = scale
            elems = e2m1_unpack(data)
            s = unswizzle(block_scale, rows, elems.shape[1] // 16).view(torch.float8_e4m3fn).to(torch.float32)
            return (elems.reshape(rows, -1, 16) * s[..., None]).reshape(rows, -1) * tensor_scale
        assert recipe == F.ScalingType.BlockWise1x32
        elems = data.to(torch.float32)
        s = e8m0_decode(unswizzle(scale, rows, elems.shape[1] // 32).view(torch.float8_e8m0fnu))
        return (elems.reshape(rows, -1, 32) * s[..., None]).reshape(rows, -1)

    def scaled_mm(
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None, output_dtype=None
    ):
        calls.append((tuple(mat_a.shape), tuple(mat_b.shape), swizzle_a))
        # torch's check (its meta kernel): the contraction in whole 16-byte runs, FP4 included
        assert mat_a.shape[1] % 16 == 0 and mat_b.shape[0] % 16 == 0, (mat_a.shape, mat_b.shape)
        a = decode(mat_a, scale_a, recipe_a, mat_a.shape[0])
        b = decode(mat_b.t(), scale_b, recipe_b, mat_b.shape[1])
        return (a @ b.t()).to(output_dtype)

    return scaled_mm


@pytest.mark.parametrize("k", [96, 80, 1000])  # NVFP4 at 80 / 1000: 16-element blocks, not 32: padded
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_native_call_passes_data_and_swizzled_scales_as_cublas_reads_them(monkeypatch, fmt, k):
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake_scaled_mm(calls), raising=False)
    monkeypatch.setattr(mx_gemm, "native_block_scaled_available", lambda device: True)
    torch.manual_seed(1)
    a, b = torch.randn(37, k), torch.randn(21, k)  # M, N not multiples of 16: padded for the kernel
    if fmt == "mxfp8":
        qa, qb = quantize_mx(a), quantize_mx(b)
    else:
        qa, qb = quantize_nvfp4(a), quantize_nvfp4_2d(b)
    native = mx_mm(qa, qb, torch.float32, path="scaled_mm")
    assert calls and calls[0][0][0] == 48 and calls[0][1][1] == 32
    emulated = mx_mm(qa, qb, torch.float32, path="emulate")
    # the stand-in outputs bf16, as the kernel does
    assert torch.allclose(native, emulated, rtol=2**-7, atol=1e-2 * emulated.abs().max().item())
    assert isinstance(qa, BlockScaledData)
