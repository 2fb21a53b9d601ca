"""MXFP8 (OCP Microscaling v1.0): FP8 elements, one E8M0 power-of-two scale per 32 elements.

A block is 32 consecutive elements along the GEMM's contraction dim. Every operand is held as a
:class:`BlockScaledData` of logical shape (R, C) *quantized along C*: for ``A @ B`` with A (M, K)
and B (K, N) the two operands are ``quantize_mx(A)`` and ``quantize_mx(B.t())`` (both (., K)),
which is also the layout cuBLAS reads (A row-major, B column-major). The 1x32 and 32x1 casts of
one tensor are different numbers; each is made from the high-precision source (never from
another quantized copy).

Scale: X = 2**k, stored as E8M0 (the byte k + 127; 255 is NaN), elements = saturate(x / X).
Two rules for k, from the block amax a = m * 2**f (1 <= m < 2):

* ``floor`` (the OCP spec, section 6.3): k = f - emax, emax the element format's largest
  exponent (E4M3: 8, E5M2: 15). a / X = m * 2**emax can exceed the format max (448 = 1.75 * 2**8)
  when m > 1.75: those elements are clipped to 448 (up to 12.5% error on a block's largest value).
* ``rceil`` (NVIDIA, what TransformerEngine, cuBLAS's MXFP8 recipes and torchao's
  ``MXFP8_RCEIL`` use): the smallest k with a / 2**k <= max, i.e. k = f - emax + (m > 1.75).
  Nothing is clipped; a block whose amax mantissa is above 1.75 loses one bit at its small end.

**Default: rceil**, because it never saturates (floor clips the largest, most informative value
of about one block in eight on Gaussian data) and it is the rule Blackwell training recipes use,
so an emulated run here quantizes as the hardware run would. Both are computed exactly with
``frexp`` (no ``log2`` rounding).

Padding: the contraction dim is zero-padded to a whole number of blocks *before* the amax (zeros
never raise an amax), so a ragged last block's scale comes from its real elements alone; the
data is stored padded (zeros), and a GEMM of two operands padded alike adds only zero products.
The other dim is never padded here (the kernel's scale layout pads it, ``mx_gemm.py``).
An all-zero block gets the smallest scale (byte 0, 2**-127) and zero elements; a block holding
inf or NaN gets the NaN scale (byte 255) and NaN reaches the GEMM output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.catalog import FIELD_DEFAULTS, RECIPE_OPTIONS
from lowprec.fp8.cast.formats import E4M3, E5M2, fp8_max
from lowprec.fp8.gemm.capability import device_constant

__all__ = [
    "MX_BLOCK",
    "E8M0",
    "SCALE_ROUNDINGS",
    "DEFAULT_SCALE_ROUNDING",
    "BlockScaledData",
    "e8m0_encode",
    "e8m0_decode",
    "mx_scale_exponent",
    "pad_to_blocks",
    "quantize_mx",
    "dequantize_blocks",
]

MX_BLOCK = 32
SCALE_ROUNDINGS = RECIPE_OPTIONS["scale_rounding"].choices  # lowprec.catalog: the one list
DEFAULT_SCALE_ROUNDING = FIELD_DEFAULTS["scale_rounding"]
E8M0 = torch.float8_e8m0fnu
_EMAX = {E4M3: 8, E5M2: 15}  # largest exponent of each element format (448 = 1.75 * 2**8)
_E8M0_NAN = 255


@dataclass
class BlockScaledData:
    """A block-scaled matrix of logical shape (rows, cols), quantized along ``cols``.

    ``data``: (rows, cols padded to ``block``) FP8, or (rows, padded cols / 2) ``float4_e2m1fn_x2``
    (two E2M1 values per byte, NVFP4). ``scale``: (rows, padded cols / block), E8M0 (MXFP8) or
    E4M3 (NVFP4): the *decode* scale, x ~= element * scale. ``tensor_scale``: NVFP4's float32
    per-tensor decode factor (x ~= element * scale * tensor_scale), ``None`` for MXFP8.
    """

    data: torch.Tensor
    scale: torch.Tensor
    cols: int
    block: int
    tensor_scale: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def fmt(self) -> str:
        return "nvfp4" if self.tensor_scale is not None else "mxfp8"

    def nbytes(self) -> int:
        """Bytes held: elements, block scales (one byte each) and the tensor scale."""
        extra = 0 if self.tensor_scale is None else 4
        return self.data.numel() * self.data.element_size() + self.scale.numel() + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self, dtype)


def e8m0_encode(k: torch.Tensor) -> torch.Tensor:
    """Integer exponents (any int dtype) -> E8M0 scales 2**k, k clamped to [-127, 127]."""
    return (k.to(torch.int32).clamp(-127, 127) + 127).to(torch.uint8).view(E8M0)


def e8m0_decode(s: torch.Tensor) -> torch.Tensor:
    """E8M0 -> float32, exactly (2**-127 is a float32 subnormal); byte 255 -> NaN."""
    bits = s.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - 127)
    return torch.where(bits == _E8M0_NAN, torch.full_like(out, float("nan")), out)


def mx_scale_exponent(block_amax: torch.Tensor, elem_dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The scale exponent k (int32) of each block from its float32 amax (see module docstring).

    Non-finite amax -> 128 (encodes as NaN after :func:`_encode_with_nan`); zero amax -> -127.
    """
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding={rounding!r}; use one of {SCALE_ROUNDINGS}")
    emax = _EMAX[elem_dtype]
    mant, exp = torch.frexp(block_amax.to(torch.float32))  # amax = mant * 2**exp, 0.5 <= mant < 1
    f = exp - 1  # amax = (2 * mant) * 2**f with 1 <= 2 * mant < 2
    k = f - emax
    if rounding == "rceil":
        k = k + (2 * mant > 1.75).to(k.dtype)  # 1.75 = the element max's mantissa (448, 57344)
    k = torch.where(block_amax > 0, k, torch.full_like(k, -127))
    return torch.where(torch.isfinite(block_amax), k, torch.full_like(k, 128))


def _encode_with_nan(k: torch.Tensor) -> torch.Tensor:
    bits = (k.clamp(-127, 128) + 127).to(torch.uint8)  # 128 + 127 = 255: NaN
    return bits.view(E8M0)


def pad_to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the last dim of a 2-D tensor to a multiple of ``block``."""
    pad = (-x.shape[-1]) % block
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_mx(
    x: torch.Tensor,
    elem_dtype: torch.dtype = E4M3,
    rounding: str = DEFAULT_SCALE_ROUNDING,
    block: int = MX_BLOCK,
) -> BlockScaledData:
    """MXFP8-quantize a 2-D high-precision ``x`` (R, C) along C; pure."""
    if x.dim() != 2:
        raise ValueError(f"MX quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    if elem_dtype not in _EMAX:
        raise ValueError(f"MXFP8 elements are E4M3 or E5M2, got {elem_dtype}")
    rows, cols = x.shape
    xp = pad_to_blocks(x.detach().to(torch.float32, memory_format=torch.contiguous_format), block)
    tiles = xp.reshape(rows, -1, block)
    lo, hi = torch.aminmax(tiles, dim=-1)  # one pass, no |x| temporary; NaN propagates
    amax = torch.maximum(hi, -lo)
    # a NaN anywhere in a block: amax() propagates it, so the block's scale is NaN too
    k = mx_scale_exponent(amax, elem_dtype, rounding)
    scale = _encode_with_nan(k)
    # x / 2**k as an exact multiply by 2**-k (k in [-127, 127]; both powers are float32 numbers)
    inv = torch.ldexp(torch.ones_like(amax), (-k).clamp(-127, 127))
    m = fp8_max(elem_dtype)
    y = tiles * inv.unsqueeze(-1)
    # clamp_ keeps NaN and saturates +-inf: a block holding either has the NaN scale anyway
    y = y.clamp_(-m, m)
    return BlockScaledData(y.reshape(rows, -1).to(elem_dtype), scale, cols, block)


# E2M1 elements (NVFP4's, ``nvfp4.py``): decoded here, where dequantize_blocks reads them
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7 (sign in bit 3)


def e2m1_grid(device) -> torch.Tensor:
    """The E2M1 magnitudes on ``device``, made once per device (``capability.device_constant``).
    Not for in-place use."""
    return device_constant(("e2m1",), device, lambda d: torch.tensor(E2M1_VALUES, dtype=torch.float32, device=d))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32."""
    c = codes.to(torch.int64)
    mag = e2m1_grid(codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e2m1_unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) packed -> (R, C) float32 values."""
    return e2m1_decode(e2m1_unpack_codes(packed))


def dequantize_blocks(q: BlockScaledData, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements times their block's decode scale (times the tensor scale for NVFP4), (rows, cols)."""
    if q.tensor_scale is None:
        elems = q.data.to(torch.float32)
        scale = e8m0_decode(q.scale)
    else:
        elems = e2m1_unpack(q.data)
        scale = q.scale.to(torch.float32) * q.tensor_scale
    rows = q.rows
    out = (elems.reshape(rows, -1, q.block) * scale.unsqueeze(-1)).reshape(rows, -1)
    return out[:, : q.cols].to(dtype)
