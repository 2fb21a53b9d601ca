"""Block-scaled GEMMs (MXFP8, NVFP4): torch's block-scaled ``scaled_mm`` on sm_100+, else exact emulation.

``mx_mm(a, bt)`` computes ``dequant(a) @ dequant(bt)^T`` for ``a`` (M, K) and ``bt`` (N, K), both
:class:`~lowprec.fp8.cast.mx.BlockScaledData` quantized along K with the same block size (the layout
cuBLAS reads: A row-major, B column-major).

Paths
-----
``emulate``  any device: elements times their block scale in float32 (exact: an E4M3 value
             times a power of two, or an E2M1 value times an E4M3 scale, has at most 5
             significant bits), one float32 matmul, NVFP4's two tensor scales applied to the
             output (as cuBLAS applies them, as ``alpha``). The CPU path, and the reference.
``scaled_mm`` CUDA sm_100+ where ``torch.nn.functional.scaled_mm`` exists:
             ``ScalingType.BlockWise1x32`` with E8M0 scales (MXFP8), ``BlockWise1x16`` with E4M3
             scales plus a ``TensorWise`` float32 scale (NVFP4), scales in the swizzled layout
             below; bf16 and float32 outputs (grad_weight's) come straight from the GEMM's
             float32 accumulator, other dtypes by a cast of the bf16 output; :func:`mx_mm_into`
             writes into a given buffer. No sm_100 GPU was available to this project when it
             was written: the path is selected by capability, and ``tests/test_mx_gemm.py``
             checks its scale layout on CPU against a reference written from the cuBLAS
             documentation.

``upcast``    CPU: the GEMM in bf16 (oneDNN; fp32 accumulation, one bf16 rounding of the
             output), its operands built straight in bf16 and exact: an E4M3/E5M2 element's
             bits shifted into bf16 position (``cpu_gemm.upcast_to_bf16``), an E2M1 element
             from a 16-entry table; times its block scale in bf16 (E8M0 bits shifted into the
             bf16 exponent; an E4M3 scale upcast the same way). The products are exact in bf16
             (at most 6 significant bits, against bf16's 8) as long as they are normal numbers:
             always for NVFP4 (E2M1 x E4M3 spans 2**-10 .. 2688), and for MXFP8 unless a block
             with a non-zero element has a scale below 2**-117 (E4M3; 2**-110 for E5M2), where
             the smallest element would fall below bf16's normal range: such a GEMM takes
             ``emulate`` (checked on the scales, 1/32 of the data). NVFP4's tensor scales (not
             powers of two) are the GEMM's ``alpha``, applied to the fp32 accumulator.
             Bound against ``emulate``: the same exact products summed in another order
             (<= K * eps32 * sum|a||b|) plus the bf16 rounding of the output (2**-8 relative);
             ``tests/test_mx_cpu_fast.py`` checks it.

``auto`` (the recipes' default) takes ``scaled_mm`` where it can run, ``upcast`` on CPU, else
``emulate`` (logged once on CUDA). ``emulate`` stays reachable everywhere (``gemm="emulate"``).

Scale layout (cuBLAS "1D block scaling factors layout"; cuDNN's "128x4" layout): the (rows,
K/block) scale matrix is padded to whole 128 x 4 tiles; tiles are stored one after the other,
row of tiles by row of tiles; inside a tile the scale of (row r, column c) sits at byte
``(r % 32) * 16 + (r // 32) * 4 + c``, so the scales of rows r, r+32, r+64, r+96 are adjacent.
"""

from __future__ import annotations

import logging

from typing import Any

import torch

from lowprec.fp8.gemm.capability import cuda_capability, is_cuda, meta_out_kernel
from lowprec.fp8.gemm.cpu import upcast_to_bf16
from lowprec.fp8.cast.mx import BlockScaledData, e8m0_decode
from lowprec.fp8.cast.nvfp4 import E2M1_VALUES, e2m1_unpack

__all__ = [
    "mx_mm",
    "mx_mm_into",
    "swizzle_scales",
    "native_block_scaled_available",
    "mx_gemm_path",
]  # paths: see docstring

logger = logging.getLogger("lowprec.fp8")
_LOGGED: set[str] = set()


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols) block scales -> the flat tiled layout cuBLAS reads (see module docstring).

    Padding (rows to 128, cols to 4) is zero bytes: it scales padded zero data only.
    """
    rows, cols = scale.shape
    raw = scale.view(torch.uint8)
    pr, pc = (-rows) % 128, (-cols) % 4
    if pr or pc:
        raw = torch.nn.functional.pad(raw, (0, pc, 0, pr))
    nr, nc = raw.shape[0] // 128, raw.shape[1] // 4
    # (tile row, r//32, r%32, tile col, c) -> (tile row, tile col, r%32, r//32, c)
    tiles = raw.reshape(nr, 4, 32, nc, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(-1).view(scale.dtype)


def native_block_scaled_available(device: torch.device) -> bool:
    """Whether torch's block-scaled ``scaled_mm`` can run here: CUDA sm_100+ and a torch that has
    ``torch.nn.functional.scaled_mm`` with block scaling types (no kernel call)."""
    F = torch.nn.functional
    if not (is_cuda(device) and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    if not hasattr(F.ScalingType, "BlockWise1x32"):
        return False
    return cuda_capability(device) >= (10, 0)


def mx_gemm_path(requested: str, device: torch.device) -> str:
    """Resolve a recipe's ``gemm`` field for a block-scaled GEMM on ``device``."""
    native = native_block_scaled_available(device)
    if requested == "scaled_mm":
        if not native:
            raise RuntimeError(
                f"gemm='scaled_mm' was asked for, but torch's block-scaled scaled_mm needs CUDA sm_100+ "
                f"(this GEMM runs on {device}, torch {torch.__version__}); use gemm='auto' or 'emulate'"
            )
        return "scaled_mm"
    if requested == "auto" and native:
        return "scaled_mm"
    if requested in ("auto", "upcast") and device.type == "cpu":
        return "upcast"
    if requested == "upcast":
        raise RuntimeError(f"gemm='upcast' is the CPU path; this GEMM runs on {device}: use gemm='auto'")
    if requested == "auto" and is_cuda(device) and "cuda" not in _LOGGED:
        _LOGGED.add("cuda")
        logger.warning(
            "lowprec.fp8: MXFP8/NVFP4 GEMMs on %s run emulated in float32: torch's block-scaled "
            "scaled_mm needs sm_100+",
            device,
        )
    return "emulate"


def _elements(q: BlockScaledData) -> torch.Tensor:
    """Elements times block scales, float32, padded width (exact; see module docstring)."""
    if q.tensor_scale is None:
        elems, scale = q.data.to(torch.float32), e8m0_decode(q.scale)
    else:
        elems, scale = e2m1_unpack(q.data), q.scale.to(torch.float32)
    return (elems.reshape(q.rows, -1, q.block) * scale.unsqueeze(-1)).reshape(q.rows, -1)


def _emulate(a: BlockScaledData, bt: BlockScaledData, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.matmul(_elements(a), _elements(bt).t())
    if a.tensor_scale is not None and bt.tensor_scale is not None:  # NVFP4: both or neither
        out = out * (a.tensor_scale * bt.tensor_scale)
    return out if out.dtype == out_dtype else out.to(out_dtype)  # as gemm.as_dtype


# E8M0 bytes below which an MXFP8 block's smallest element times its scale is not a normal bf16
# number: scale 2**k, element bits down to 2**-9 (E4M3) / 2**-16 (E5M2), normal from 2**-126
_MIN_EXACT_BYTE = {torch.float8_e4m3fn: 127 - 117, torch.float8_e5m2: 127 - 110}
_BF16_NAN = 0x7FC0


def _e8m0_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 -> bf16 by bits: the byte is the bf16 exponent field (255 -> NaN, 0 -> 0: callers
    only let byte 0 through for blocks whose elements are all zero)."""
    bits = scale.view(torch.uint8).to(torch.int16)
    bits = torch.where(bits == 255, _BF16_NAN, bits << 7)
    return bits.view(torch.bfloat16)


def _e2m1_table(device) -> torch.Tensor:
    """The two bf16 values of each byte's E2M1 codes (low nibble first) as one int32 word per
    byte, shape (256,): decoding is then a 4-byte ``index_select`` per byte (17x faster on CPU
    than advanced indexing of a (256, 2) table)."""
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.bfloat16)
    b = torch.arange(256)
    pairs = torch.stack([vals[b & 15], vals[b >> 4]], dim=-1).contiguous()
    return pairs.view(torch.int32).reshape(256).to(device)


_TABLES: dict = {}


def _bf16_operand(q: BlockScaledData) -> torch.Tensor | None:
    """Elements times block scales as exact bf16, padded width; ``None`` where not exact."""
    if q.tensor_scale is None:
        raw = q.scale.view(torch.uint8)
        small = raw < _MIN_EXACT_BYTE[q.data.dtype]
        if bool(small.any()):  # rare: tiny blocks; exact only if all their elements are zero
            blocks = q.data.view(torch.uint8).reshape(q.rows, -1, q.block)[small]
            if bool((blocks & 0x7F).any()):
                return None
        elems, scale = upcast_to_bf16(q.data), _e8m0_to_bf16(q.scale)
    else:
        key = q.data.device
        if key not in _TABLES:
            _TABLES[key] = _e2m1_table(key)
        idx = q.data.view(torch.uint8).reshape(-1).to(torch.int32)
        elems = _TABLES[key].index_select(0, idx).view(torch.bfloat16).reshape(q.rows, -1)
        scale = upcast_to_bf16(q.scale)
    out = elems.reshape(q.rows, -1, q.block).mul_(scale.unsqueeze(-1))
    return out.reshape(q.rows, -1)


def _upcast(a: BlockScaledData, bt: BlockScaledData, out_dtype: torch.dtype) -> torch.Tensor:
    av = _bf16_operand(a)
    bv = _bf16_operand(bt) if av is not None else None
    if av is None or bv is None:
        return _emulate(a, bt, out_dtype)
    if a.tensor_scale is None or bt.tensor_scale is None:  # MXFP8 (NVFP4 has both)
        out = torch.mm(av, bv.t())
    else:  # the tensor scales as alpha: on the fp32 accumulator, one rounding of the output
        alpha = float(a.tensor_scale * bt.tensor_scale)
        out = torch.addmm(torch.zeros((), dtype=torch.bfloat16, device=av.device), av, bv.t(), beta=0, alpha=alpha)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def _rows_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (``t`` itself where it has them)."""
    if t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, rows - t.shape[0])).view(t.dtype)


def _bytes_to_16(t: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 data with zero bytes appended to a multiple of 16 per row (``t`` itself where
    it has them). NVFP4 pads the contraction to 16-element blocks; torch's FP4 GEMM wants 32, and a
    token count such as 1000 or 1040 (or an expert's group) is not one: the added zero elements
    fall in a block the scale swizzle already pads with a zero scale (its columns go to 4)."""
    pad = (-t.shape[1]) % 16
    if not pad:
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


# output dtypes the block-scaled GEMM writes itself, from its float32 accumulator (one rounding)
_DIRECT_OUT = (torch.bfloat16, torch.float32)


def _v2_ints(items: Any) -> list[int]:
    return [i.value for i in (items if isinstance(items, list) else [items])]


def _native(
    a: BlockScaledData, bt: BlockScaledData, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    F = torch.nn.functional
    m, n = a.rows, bt.rows
    mp, np_ = -(-m // 16) * 16, -(-n // 16) * 16
    # rows padded to 16 only where they are not whole (a pad of nothing still copies), row-major
    # both (the kernel's A and column-major B^T): a transposed weight's cast (grad_input re-casting
    # W^T from the Parameter) is column-major, and torch refuses it
    ad, bd = _rows_to(a.data, mp), _rows_to(bt.data, np_)
    if a.tensor_scale is not None:  # NVFP4: torch takes the contraction in whole 16-byte (32-element) runs
        ad, bd = _bytes_to_16(ad), _bytes_to_16(bd)
    ad, bd = ad.contiguous(), bd.contiguous()
    swz = F.SwizzleType.SWIZZLE_32_4_4
    sa: Any
    sb: Any
    ra: Any
    rb: Any
    za: Any
    zb: Any
    if a.tensor_scale is None:
        rec = F.ScalingType.BlockWise1x32
        sa, sb, ra, rb = swizzle_scales(a.scale), swizzle_scales(bt.scale), rec, rec
        za, zb = swz, swz
    else:
        blk, tw = F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise
        sa, sb = [swizzle_scales(a.scale), a.tensor_scale], [swizzle_scales(bt.scale), bt.tensor_scale]
        ra = rb = [blk, tw]
        za = zb = [swz, F.SwizzleType.NO_SWIZZLE]
    odt = out_dtype if out_dtype in _DIRECT_OUT else torch.bfloat16
    whole = (mp, np_) == (m, n)
    if out is not None and out.dtype == odt and whole and out.is_contiguous() and not torch.compiler.is_compiling():
        # straight into the caller's buffer (an output's rows, an expert's gradient): F.scaled_mm's
        # call with out= (the same kernel); under torch.compile (no fake kernel for out=) a copy
        if ad.device.type == "meta":
            meta_out_kernel("aten::_scaled_mm_v2.out", torch._scaled_mm_v2)
        as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
        return torch._scaled_mm_v2(
            ad, bd.t(), as_list(sa), _v2_ints(ra), _v2_ints(za), as_list(sb), _v2_ints(rb), _v2_ints(zb),
            None, odt, [], False, out=out,
        )  # fmt: skip
    res = F.scaled_mm(ad, bd.t(), sa, ra, sb, rb, swizzle_a=za, swizzle_b=zb, output_dtype=odt)
    res = res if res.shape == (m, n) else res[:m, :n]
    res = res if res.dtype == out_dtype else res.to(out_dtype)  # as gemm.as_dtype
    return res if out is None else out.copy_(res)


def _check_operands(a: BlockScaledData, bt: BlockScaledData) -> None:
    if a.cols != bt.cols or a.block != bt.block or a.fmt != bt.fmt:
        raise ValueError(
            f"mx_mm needs two {a.fmt} operands quantized along the same K: got {a.fmt} {a.shape}/{a.block} "
            f"and {bt.fmt} {bt.shape}/{bt.block}"
        )


def mx_mm_into(a: BlockScaledData, bt: BlockScaledData, out: torch.Tensor, *, path: str = "auto") -> torch.Tensor:
    """:func:`mx_mm` written into ``out`` ((a.rows, bt.rows), its dtype the output's): an
    output's rows or an expert's gradient slice. torch's block-scaled GEMM writes it itself
    where the rows are whole (multiples of 16); elsewhere the product is copied in."""
    _check_operands(a, bt)
    resolved = mx_gemm_path(path, a.data.device)
    if resolved == "scaled_mm":
        return _native(a, bt, out.dtype, out)
    return out.copy_(_upcast(a, bt, out.dtype) if resolved == "upcast" else _emulate(a, bt, out.dtype))


def mx_mm(a: BlockScaledData, bt: BlockScaledData, out_dtype: torch.dtype, *, path: str = "auto") -> torch.Tensor:
    """``dequant(a) @ dequant(bt)^T`` in ``out_dtype`` (see module docstring for the paths)."""
    _check_operands(a, bt)
    resolved = mx_gemm_path(path, a.data.device)
    if resolved == "scaled_mm":
        return _native(a, bt, out_dtype)
    if resolved == "upcast":
        return _upcast(a, bt, out_dtype)
    return _emulate(a, bt, out_dtype)
