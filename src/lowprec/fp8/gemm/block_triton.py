"""Blockwise-scaled FP8 GEMMs through lowprec's Triton kernel, where torch has none.

torch's blockwise ``scaled_mm`` (:mod:`lowprec.fp8.gemm.block`) is cuBLAS on Hopper (sm_90)
for whole 128-tiles. Elsewhere (Ada sm_89, Blackwell sm_100, a torch build without it, a K
that is not whole tiles) the blockwise recipe's GEMMs run on
:func:`lowprec.fp8.kernels.gemm_ops.block_scaled_mm`: 1 x b tiles for A, b x b blocks or b x 1
tiles for B (b = the recipe's ``block_size``, 32/64/128), float32 accumulation, the output
dtype written by the kernel (the weight gradient lands in float32 without a cast).

Where it runs: CUDA compute capability 8.9+ (FP8 tensor cores), triton importable,
``LOWPREC_DISABLE_TRITON`` unset, and a first-use self-check on the device against the
float32 emulation (as torch's kernel gets). Its accuracy against the emulation: under the
Triton interpreter (CI) within ``cpu_gemm.py``'s documented bound (``K * eps32 * (|A| @ |B|)``
plus the output rounding); on hardware the tensor cores' FP8 accumulation inside one K-block is
less precise than float32, so the self-check allows ``2**-7 * max |ref|``, the bound it uses for
torch's kernel.
"""

from __future__ import annotations


import torch

from lowprec.fp8.gemm.capability import cuda_capability, is_cuda
from lowprec.fp8.cast.quantize import Float8Data, dequantize
from lowprec.fp8.gemm import block as block_gemm
from lowprec.fp8.kernels.select import checked_once, emulation_gap, self_check_verdict, triton_allowed
from lowprec.fp8.cast.quantize import quantize_blockwise

__all__ = ["supported", "runs", "mm", "self_check", "describe_cuda", "KERNEL"]


KERNEL = "lowprec Triton blockwise FP8 GEMM"
_CHECKED: dict[int | None, bool] = {}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def supported(a: Float8Data, b: Float8Data) -> bool:
    """Operand tiles the kernel takes: A in 1 x b tiles, B in b x b blocks or b x 1 tiles."""
    if a.granularity != "block" or b.granularity != "block" or a.block is None or b.block is None:
        return False
    bs = a.block[1]
    return (
        a.block == (1, bs)
        and bs in (32, 64, 128)
        and b.block in ((bs, bs), (bs, 1))
        and a.data.dtype in _FP8
        and b.data.dtype in _FP8
    )


def _triton_allowed() -> bool:
    return triton_allowed()  # a module-level name tests replace


def runs(device: torch.device, a: Float8Data, b: Float8Data) -> bool:
    """Whether this GEMM runs on the Triton kernel here (checks the device once)."""
    return (
        is_cuda(device)
        and supported(a, b)
        and cuda_capability(device) >= (8, 9)
        and _triton_allowed()
        and self_check(device)
    )


def describe_cuda(device: torch.device, block_size: int) -> str:
    """Which kernel the blockwise recipe's GEMMs take on this CUDA device (for reports; no kernel runs)."""

    sm = cuda_capability(device)
    triton_ok = sm >= (8, 9) and block_size in (32, 64, 128) and _triton_allowed()
    fallback = "lowprec's Triton blockwise GEMM" if triton_ok else "emulation in float32"
    if sm[0] == 9 and block_size == 128 and block_gemm._torch_has_it():
        return (
            f"torch blockwise-scaled scaled_mm on cuda sm_{sm[0]}{sm[1]} (1x128 x 128x128; self-checked at first "
            f"use); shapes it cannot take: {fallback}"
        )
    if triton_ok:
        return f"{KERNEL} on cuda sm_{sm[0]}{sm[1]} (1x{block_size} x {block_size}x{block_size}; self-checked at first use)"
    return (
        f"emulated: torch's blockwise FP8 GEMM needs sm_90 and block_size 128, lowprec's Triton one sm_89+, "
        f"triton and block_size 32/64/128 (here sm_{sm[0]}{sm[1]}, block_size {block_size})"
    )


def mm(a: Float8Data, b: Float8Data, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` on the kernel (``supported(a, b)`` must hold)."""
    from lowprec.fp8.kernels import gemm_ops  # imports triton: only reached where the kernel runs

    kernel_out = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    sa = a.scale.reciprocal().to(torch.float32)  # dequantization scales, as the emulation multiplies
    sb = b.scale.reciprocal().to(torch.float32)
    out = gemm_ops.block_scaled_mm(a.data, b.data, sa, sb, a.tiles[1], b.tiles[1], kernel_out)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def self_check(device: torch.device) -> bool:
    """Once per device: does the kernel compile, run and agree with the float32 emulation?"""
    return checked_once(_CHECKED, device, _check)


def _check(device: torch.device) -> bool:
    def cases() -> str:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x, w, g = (torch.randn(s, generator=gen).to(device) for s in ((96, 256), (160, 256), (96, 160)))
        a = quantize_blockwise(x, torch.float8_e4m3fn, (1, 128))
        pairs = [
            (a, quantize_blockwise(w, torch.float8_e4m3fn, (128, 128)).t()),  # output / grad_input
            (
                quantize_blockwise(g, torch.float8_e4m3fn, (128, 1)).t(),  # grad_weight: dY^T x X
                quantize_blockwise(x, torch.float8_e4m3fn, (128, 1)),
            ),
        ]
        for qa, qb in pairs:
            gap = emulation_gap(mm(qa, qb, torch.float32), dequantize(qa) @ dequantize(qb))
            if gap:
                return f"{gap} ({qa.block} x {qb.block})"
        return ""

    return self_check_verdict(device, KERNEL, "blockwise FP8 GEMMs", "are emulated", cases)
