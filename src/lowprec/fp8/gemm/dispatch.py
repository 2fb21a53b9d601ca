"""Scaled GEMM dispatch: ``torch._scaled_mm`` on FP8 GPUs, the exact bf16-upcast GEMM on CPU.

``scaled_mm(a, b)`` computes ``dequant(a) @ dequant(b)`` for ``a`` of logical shape (M, K)
and ``b`` of logical shape (K, N), both :class:`Float8Data`, contraction over K.

Paths
-----
``scaled_mm``  ``torch._scaled_mm``: CUDA with compute capability 8.9+ (axiswise scales need
               9.0). Layout rules handled here: A row-major, B column-major, every dim padded to
               a multiple of 16 with zeros (zeros add nothing to a dot product; padded output is
               sliced away). On CPU only where ``cpu_gemm.cpu_gemm_choice()`` measured it
               faster than ``upcast`` (or ``LOWPREC_CPU_FP8_GEMM=scaled_mm`` forces it).
``upcast``     CPU: FP8 operands upcast exactly to bf16, one bf16 GEMM accumulating in float32,
               scales on the output (per-tensor/per-axis) or folded into the operands
               (power-of-two block scales). See ``cpu_gemm.py`` for why and the error bound.
``emulate``    dequantize both operands to float32 (``data * (1/scale)``) and ``torch.matmul``
               in float32; any device, any granularity. The reference the others are tested
               against. Block scales on CUDA take this path where torch's blockwise kernel
               (``block_gemm.py``: sm_90, 1x128 x 128x128 and 1x128 x 1x128) and lowprec's
               Triton blockwise kernel (``triton`` below) cannot run.
``triton``     blockwise scales on CUDA sm_89+ where torch's kernel cannot run: lowprec's Triton
               GEMM (``block_gemm_triton.py``), self-checked once per device. A resolved path
               only: ``gemm='auto'`` and ``gemm='scaled_mm'`` (a real FP8 kernel) both take it.

``auto`` picks ``scaled_mm`` on FP8 GPUs, the probe's choice on CPU, ``emulate`` elsewhere.
The kernels agree with ``emulate`` within documented bounds, not bit for bit: cuBLAS and
oneDNN sum in their own orders (``tests/test_fp8_gemm.py``, ``tests/test_fp8_cpu_gemm.py``).
"""

from __future__ import annotations

import logging

import torch

from lowprec.fp8.gemm import block as block_gemm, block_triton as block_gemm_triton, cpu as cpu_gemm
from lowprec.fp8.gemm.capability import cuda_capability, is_cuda, meta_out_kernel
from lowprec.fp8.cast.quantize import Float8Data, dequantize

__all__ = ["scaled_mm", "native_scaled_mm_available", "gemm_path", "GEMM_PATHS"]

logger = logging.getLogger("lowprec.fp8")

GEMM_PATHS = ("auto", "scaled_mm", "upcast", "emulate")  # the values of Recipe.gemm

_E5M2 = torch.float8_e5m2


def native_scaled_mm_available(device: torch.device, granularity: str = "tensor") -> bool:
    """Whether ``torch._scaled_mm`` runs here for this granularity (no probing kernel call).

    On CPU this says whether the kernel exists, not whether it is used: ``auto`` uses it only
    where the one-time probe in ``cpu_gemm`` measured it faster than the upcast path.
    """
    if granularity == "block" or not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return cpu_gemm.cpu_scaled_mm_exists()
    if is_cuda(device):
        need = (9, 0) if granularity == "axis" else (8, 9)
        return cuda_capability(device) >= need  # fp8.trace_as may state it for a trace
    return False


def _granularity(a: Float8Data, b: Float8Data) -> str:
    grans = (a.granularity, b.granularity)
    return "block" if "block" in grans else ("axis" if "axis" in grans else "tensor")


def default_path(device: torch.device, granularity: str) -> str:
    """What ``auto`` runs for this device and granularity (before operand dtypes are known)."""
    if device.type == "cpu":
        if granularity == "block":
            return "upcast"
        return cpu_gemm.cpu_gemm_path()
    return "scaled_mm" if native_scaled_mm_available(device, granularity) else "emulate"


def gemm_path(requested: str, device: torch.device, a: Float8Data, b: Float8Data) -> str:
    """Resolve ``auto`` | ``scaled_mm`` | ``upcast`` | ``emulate`` for one GEMM into the path that runs."""
    if requested not in GEMM_PATHS:
        raise ValueError(f"gemm={requested!r}; use one of {GEMM_PATHS}")
    gran = _granularity(a, b)
    both_e5m2 = a.data.dtype == _E5M2 and b.data.dtype == _E5M2
    if gran == "block":  # torch's blockwise kernel: sm_90, supported tile pairs, self-checked once
        native = (  # torch gates its DeepSeek-style kernel to Hopper (sm_90) in ScaledBlas.cpp
            is_cuda(device)
            and native_scaled_mm_available(device, "axis")
            and cuda_capability(device)[0] == 9
            and block_gemm.supported(a, b)
            and block_gemm.self_check(device)
        )
        if not native and requested in ("auto", "scaled_mm") and block_gemm_triton.runs(device, a, b):
            return "triton"  # lowprec's Triton blockwise kernel: sm_89+, where torch's cannot run
    else:
        native = native_scaled_mm_available(device, gran) and not both_e5m2
    if requested == "emulate":
        return "emulate"
    if requested == "upcast":
        if device.type != "cpu":
            raise RuntimeError(f"gemm='upcast' is the CPU path; this GEMM runs on {device}: use gemm='auto'")
        return "upcast"
    if requested == "scaled_mm":
        if not native:
            raise RuntimeError(
                f"gemm='scaled_mm' was asked for, but torch._scaled_mm cannot run {gran} scales on "
                f"{device} (torch {torch.__version__}); use gemm='auto' or 'emulate'"
            )
        return "scaled_mm"
    if gran == "block" and is_cuda(device):
        if not native and "block_cuda" not in _LOGGED:
            _LOGGED.add("block_cuda")
            logger.warning(
                "lowprec.fp8: a blockwise GEMM on %s (%sx%sx%s, tiles %s x %s) runs emulated in float32: "
                "torch's blockwise kernel needs sm_90, E4M3, K in whole 128-tiles and 16-aligned M/N; "
                "lowprec's Triton one needs sm_89+, triton, block_size 32/64/128 and its self-check",
                device,
                a.data.shape[0],
                a.data.shape[1],
                b.data.shape[1],
                a.block,
                b.block,
            )
        return "scaled_mm" if native else "emulate"
    path = default_path(device, gran)
    return "emulate" if path == "scaled_mm" and not native else path


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


def _native(
    a: Float8Data, b: Float8Data, out_dtype: torch.dtype, use_fast_accum: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
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
    if (
        out is not None
        and cuda
        and (mp, np_) == (m, n)  # padding K alone (a grad_weight over a ragged token group) keeps the output
        and out.dtype == kernel_out
        and out.is_contiguous()
        and not torch.compiler.is_compiling()
    ):  # the kernel writes the caller's buffer (one expert's slice of a grouped weight gradient)
        if ad.device.type == "meta":
            meta_out_kernel("aten::_scaled_mm.out", torch._scaled_mm)
        fast = use_fast_accum
        return torch._scaled_mm(ad, bd, scale_a=sa, scale_b=sb, out_dtype=kernel_out, use_fast_accum=fast, out=out)
    res = torch._scaled_mm(ad, bd, scale_a=sa, scale_b=sb, out_dtype=kernel_out, use_fast_accum=use_fast_accum)
    if res.shape != (m, n):
        res = res[:m, :n]
    if out is not None:
        return out.copy_(res)
    return as_dtype(res, out_dtype)


def as_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``, with no graph node when it is already: a GEMM's result must not be two
    nodes of one tensor. Dynamo (torch 2.11) returns a traced autograd.Function's intermediates as
    outputs beside its result; an identity ``.to`` makes the result and the GEMM's output the same
    tensor twice, autograd gives the tensor the later output's slot, and the backward receives a
    zero gradient (the compiled FP8 layers' zero gradients on the H200, docs/LOG.md)."""
    return out if out.dtype == dtype else out.to(dtype)


def _emulate(a: Float8Data, b: Float8Data, out_dtype: torch.dtype) -> torch.Tensor:
    return as_dtype(torch.matmul(dequantize(a), dequantize(b)), out_dtype)


def scaled_mm(
    a: Float8Data,
    b: Float8Data,
    out_dtype: torch.dtype,
    *,
    path: str = "auto",
    use_fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` in ``out_dtype``; ``path`` is ``auto``/``scaled_mm``/``emulate``.
    With ``out`` (``out_dtype``, (M, N)) the result is written there and returned: by the GEMM
    itself where ``torch._scaled_mm`` can (no padding, ``out`` in its output dtype), else copied."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[0]:
        raise ValueError(f"scaled_mm needs (M, K) x (K, N), got {tuple(a.shape)} x {tuple(b.shape)}")
    resolved = gemm_path(path, a.data.device, a, b)
    if resolved == "scaled_mm" and "block" not in (a.granularity, b.granularity):
        return _native(a, b, out_dtype, use_fast_accum, out)
    if resolved == "scaled_mm" and out is not None:
        return block_gemm.blockwise_mm(a, b, out_dtype, out)
    res = _scaled_mm_other(a, b, out_dtype, resolved)
    return res if out is None else out.copy_(res)


def _scaled_mm_other(a: Float8Data, b: Float8Data, out_dtype: torch.dtype, resolved: str) -> torch.Tensor:
    if resolved == "triton":
        return block_gemm_triton.mm(a, b, out_dtype)
    if resolved == "scaled_mm":
        return block_gemm.blockwise_mm(a, b, out_dtype)
    if resolved == "upcast":
        out = cpu_gemm.upcast_mm(a, b, out_dtype)
        if out is not None:
            return out
        _log_block_emulation()
    return _emulate(a, b, out_dtype)


_LOGGED: set[str] = set()


def _log_block_emulation() -> None:
    if "block" not in _LOGGED:
        _LOGGED.add("block")
        logger.warning(
            "lowprec.fp8: block scales that are not powers of two cannot be folded exactly into bf16 "
            "operands; those GEMMs run emulated in float32 on CPU (set power_of_2_scales=True for the "
            "bf16 path)"
        )
