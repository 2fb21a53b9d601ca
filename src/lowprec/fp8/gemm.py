"""Scaled GEMM dispatch: ``torch._scaled_mm`` where the device has it, emulation elsewhere.

``scaled_mm(a, b)`` computes ``dequant(a) @ dequant(b)`` for ``a`` of logical shape (M, K)
and ``b`` of logical shape (K, N), both :class:`Float8Data`, contraction over K.

Paths
-----
``scaled_mm``  ``torch._scaled_mm``: CUDA with compute capability 8.9+ (axiswise scales need
               9.0), and CPU in recent torch (2.8+). Layout rules handled here: A row-major,
               B column-major, and on CUDA every dim padded to a multiple of 16 with zeros
               (zeros add nothing to a dot product; padded output is sliced away).
``emulate``    dequantize both operands to float32 (``data * (1/scale)``) and ``torch.matmul``
               in float32; any device, any granularity. Block scales always take this path:
               torch has no portable kernel for 1x128 / 128x128 scales.

On CPU the two paths are bit-identical (``_scaled_mm``'s CPU kernel dequantizes the same way
and accumulates in float32); ``tests/test_fp8_gemm.py`` checks it. On CUDA, cuBLAS
accumulates in a different order (and with fast accumulation, at lower precision), so the two
agree to within float32/fast-accum rounding, checked by ``pytest -m gpu``.
"""

from __future__ import annotations

import torch

from lowprec.fp8.capability import cuda_capability, is_cuda
from lowprec.fp8.quantize import Float8Data, dequantize

__all__ = ["scaled_mm", "native_scaled_mm_available", "gemm_path"]

_E5M2 = torch.float8_e5m2


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def native_scaled_mm_available(device: torch.device, granularity: str = "tensor") -> bool:
    """Whether ``torch._scaled_mm`` runs here for this granularity (no probing kernel call)."""
    if granularity == "block" or not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return _torch_version() >= (2, 8)
    if is_cuda(device):
        need = (9, 0) if granularity == "axis" else (8, 9)
        return cuda_capability(device) >= need  # fp8.trace_as may state it for a trace
    return False


def gemm_path(requested: str, device: torch.device, a: Float8Data, b: Float8Data) -> str:
    """Resolve ``auto`` | ``scaled_mm`` | ``emulate`` for one GEMM into the path that runs."""
    gran = "block" if "block" in (a.granularity, b.granularity) else (
        "axis" if "axis" in (a.granularity, b.granularity) else "tensor"
    )
    both_e5m2 = a.data.dtype == _E5M2 and b.data.dtype == _E5M2
    native = native_scaled_mm_available(device, gran) and not both_e5m2
    if requested == "emulate":
        return "emulate"
    if requested == "scaled_mm" and not native:
        raise RuntimeError(
            f"gemm='scaled_mm' was asked for, but torch._scaled_mm cannot run {gran} scales on "
            f"{device} (torch {torch.__version__}); use gemm='auto' or 'emulate'"
        )
    return "scaled_mm" if native else "emulate"


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = rows - x.shape[0], cols - x.shape[1]
    if pr == 0 and pc == 0:
        return x
    # F.pad has no FP8 kernel on every device: pad through a uint8 view (zero bits = 0.0).
    padded = torch.nn.functional.pad(x.view(torch.uint8), (0, pc, 0, pr))
    return padded.view(x.dtype)


def _axis_scale(q: Float8Data, shape: tuple[int, int]) -> torch.Tensor:
    """Dequantization scale for ``_scaled_mm``: scalar, or broadcast to (M, 1) / (1, N)."""
    inv = q.scale.reciprocal().to(torch.float32)
    return inv if q.scale.dim() == 0 else inv.expand(shape).contiguous()


def _native(a: Float8Data, b: Float8Data, out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    m, k = a.data.shape
    n = b.data.shape[1]
    axis = "axis" in (a.granularity, b.granularity)
    if axis:  # mixed tensor/axis operands: broadcast the scalar scale to a vector
        sa = a.scale.reciprocal().to(torch.float32).expand(m, 1).contiguous()
        sb = b.scale.reciprocal().to(torch.float32).expand(1, n).contiguous()
    else:
        sa, sb = _axis_scale(a, (m, 1)), _axis_scale(b, (1, n))
    ad, bd = a.data, b.data
    cuda = is_cuda(ad.device)
    if cuda:
        mp, kp, np_ = (-(-d // 16) * 16 for d in (m, k, n))
        ad, bd = _pad_to(ad, mp, kp), _pad_to(bd, kp, np_)
        if axis:
            sa = torch.nn.functional.pad(sa, (0, 0, 0, mp - m), value=1.0)
            sb = torch.nn.functional.pad(sb, (0, np_ - n), value=1.0)
    ad = ad.contiguous()  # row-major A
    bd = bd.t().contiguous().t()  # column-major B
    # cuBLAS rowwise scaling produces bf16 only; cast afterwards for float32 callers.
    kernel_out = torch.bfloat16 if (cuda and axis) else out_dtype
    out = torch._scaled_mm(ad, bd, scale_a=sa, scale_b=sb, out_dtype=kernel_out, use_fast_accum=use_fast_accum)
    if cuda:
        out = out[:m, :n]
    return out.to(out_dtype)


def _emulate(a: Float8Data, b: Float8Data, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.matmul(dequantize(a), dequantize(b)).to(out_dtype)


def scaled_mm(
    a: Float8Data,
    b: Float8Data,
    out_dtype: torch.dtype,
    *,
    path: str = "auto",
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` in ``out_dtype``; ``path`` is ``auto``/``scaled_mm``/``emulate``."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[0]:
        raise ValueError(f"scaled_mm needs (M, K) x (K, N), got {tuple(a.shape)} x {tuple(b.shape)}")
    resolved = gemm_path(path, a.data.device, a, b)
    if resolved == "scaled_mm":
        return _native(a, b, out_dtype, use_fast_accum)
    return _emulate(a, b, out_dtype)
