"""Blockwise-scaled FP8 GEMMs on CUDA through torch's ``torch.nn.functional.scaled_mm``.

DeepSeek-V3 blockwise scaling (1x128 tiles for activations and gradients, 128x128 blocks for
weights) has a cuBLAS kernel on Hopper, which torch exposes as ``F.scaled_mm`` with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128``. The three GEMMs of the blockwise recipe
map onto the combinations torch accepts:

==========  ====================================  ====================================  ===============
GEMM        A (M, K): tiles along K               B (K, N): blocks                      torch recipes
==========  ====================================  ====================================  ===============
output      x, 1x128                              W^T, 128x128                          1x128 x 128x128
grad_input  dY, 1x128                             W, 128x128                            1x128 x 128x128
grad_weight dY^T, 1x128 (dY cast in 128x1 tiles)  x, 128x1 (1x128 along the contraction)  1x128 x 1x128
==========  ====================================  ====================================  ===============

Scale layouts, as torch's meta function checks them (``_check_scaled_mm_sizes_v2``): the
dequantization scales (our ``1/scale``) in float32, A's ``(M, ceil(K/128))`` column-major, a
128x128 B's ``(round_up(ceil(K/128), 4), N/128)`` column-major, a 1x128 B's ``(N, ceil(K/128))``
column-major. ``tests/test_fp8_block_gemm.py`` runs every GEMM of the recipe through that meta
function on fake CUDA tensors, so a layout mistake fails on a machine without a GPU.

On a real GPU the first call on a device runs a self-check: a small blockwise GEMM against the
float32 emulation; if the kernel raises (an older GPU, a torch built without it) or disagrees,
blockwise GEMMs on that device are emulated from then on, and one log line says why.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from lowprec.fp8.gemm.capability import meta_out_kernel, traced
from lowprec.fp8.cast.quantize import Float8Data, dequantize, quantize_blockwise
from lowprec.fp8.kernels.select import emulation_gap

__all__ = ["BLOCK", "supported", "blockwise_mm", "self_check"]

logger = logging.getLogger("lowprec.fp8")

BLOCK = 128
_CHECKED: dict[tuple[str, int | None], bool] = {}


def _torch_has_it() -> bool:
    st = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and st is not None and hasattr(st, "BlockWise1x128")


def _recipes(a: Float8Data, b: Float8Data):
    """torch's scaling types for (a, b), or None where torch has no kernel for the pair."""
    if a.granularity != "block" or b.granularity != "block" or a.block != (1, BLOCK):
        return None
    st = F.ScalingType
    if b.block == (BLOCK, BLOCK):
        return st.BlockWise1x128, st.BlockWise128x128
    if b.block == (BLOCK, 1):
        return st.BlockWise1x128, st.BlockWise1x128
    return None


def supported(a: Float8Data, b: Float8Data) -> bool:
    """Whether torch has a blockwise kernel for these operands (shape and tile rules only)."""
    if not _torch_has_it() or _recipes(a, b) is None:
        return False
    m, k = a.data.shape
    n = b.data.shape[1]
    # cuBLAS blockwise: K in whole 128-tiles, 128x128 B blocks whole along N, 16-aligned M
    if k % BLOCK or m % 16 or n % 16 or (b.block == (BLOCK, BLOCK) and n % BLOCK):
        return False
    return a.data.dtype == torch.float8_e4m3fn and b.data.dtype == torch.float8_e4m3fn


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _col_major_data(t: torch.Tensor) -> torch.Tensor:
    """B's FP8 data column-major, as it is where it already is, with any leading dimension (one
    expert's columns of all experts' transposed weight cast: cuBLAS takes the stride as ``ldb``,
    torch's checks ask for ``stride(0) == 1`` only); else copied. Scales keep their exact layout."""
    aligned = t.stride(1) % 16 == 0  # 16-byte aligned columns, as cuBLAS's FP8 kernels load them
    return t if t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]) and aligned else _col_major(t)


def _scales(a: Float8Data, b: Float8Data) -> tuple[torch.Tensor, torch.Tensor]:
    sa = _col_major(a.scale.reciprocal().to(torch.float32))  # (M, K/128)
    inv_b = b.scale.reciprocal().to(torch.float32)
    if b.block == (BLOCK, BLOCK):  # (K/128, N/128), K-blocks padded to a multiple of 4
        kb = inv_b.shape[0]
        pad = -kb % 4
        if pad:
            inv_b = F.pad(inv_b, (0, 0, 0, pad), value=1.0)
        return sa, _col_major(inv_b)
    return sa, inv_b.contiguous().t()  # (K/128, N) row-major = (N, K/128) column-major


def blockwise_mm(a: Float8Data, b: Float8Data, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` with torch's blockwise kernel (``supported(a, b)`` must hold).
    ``out`` ((M, N), ``out_dtype``): written by the kernel itself where it is contiguous in the
    kernel's output dtype (one expert's rows of a grouped output: no concatenation after), else
    copied there."""
    ra, rb = _recipes(a, b)
    sa, sb = _scales(a, b)
    ad = a.data.contiguous()  # row-major A
    bd = _col_major_data(b.data)  # column-major B
    kernel_out = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if out is not None and out.dtype == kernel_out and out.is_contiguous() and not torch.compiler.is_compiling():
        # F.scaled_mm's call with out= (the same kernel: torch's functional form runs this overload)
        if ad.device.type == "meta":
            meta_out_kernel("aten::_scaled_mm_v2.out", torch._scaled_mm_v2)
        return torch._scaled_mm_v2(
            ad, bd, [sa], [ra.value], [], [sb], [rb.value], [], None, kernel_out, [], False, out=out
        )
    res = F.scaled_mm(ad, bd, sa, ra, sb, rb, output_dtype=kernel_out)
    if out is not None:
        return out.copy_(res)
    return res if res.dtype == out_dtype else res.to(out_dtype)  # as gemm.as_dtype


def self_check(device: torch.device) -> bool:
    """Once per device: does the kernel run here and agree with the float32 emulation?"""
    if traced():  # fp8.trace_as: decisions only, nothing runs
        return True
    key = (device.type, device.index)
    if key in _CHECKED:
        return _CHECKED[key]

    ok, why = False, ""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(128, 256, device=device, generator=gen)
        w = torch.randn(128, 256, device=device, generator=gen)
        a = quantize_blockwise(x, torch.float8_e4m3fn, (1, BLOCK))
        b = quantize_blockwise(w, torch.float8_e4m3fn, (BLOCK, BLOCK)).t()
        got = blockwise_mm(a, b, torch.float32)
        why = emulation_gap(got, dequantize(a) @ dequantize(b))
        ok = not why
    except Exception as exc:  # noqa: BLE001 - any failure means: emulate on this device
        why = f"{type(exc).__name__}: {exc}"[:200]
    _CHECKED[key] = ok
    if not ok:
        logger.warning("lowprec.fp8: blockwise FP8 GEMMs on %s are emulated: torch's blockwise kernel %s", device, why)
    return ok
