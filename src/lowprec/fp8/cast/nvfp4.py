"""NVFP4 (TransformerEngine's NVFP4BlockScaling): E2M1 elements, an E4M3 scale per 16, an fp32 tensor scale.

E2M1 (1 sign, 2 exponent, 1 mantissa bit) holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives;
two values are packed per byte (``torch.float4_e2m1fn_x2``; the element with the even index in
the low nibble, as cuBLAS reads it). Two scale levels (NVIDIA, arXiv 2509.25149, section 2):

* per tensor: ``S = 448 * 6 / amax(x)`` (float32), so that every block scale fits E4M3;
  ``tensor_scale = 1 / S`` is the decode factor kept beside the data;
* per block of 16 along the contraction dim: ``s_b = e4m3(amax_b / 6 * S)`` (at most 448),
  elements ``e2m1(x * S / s_b)`` (saturated at 6). Decode: ``x ~= e * s_b * tensor_scale``.

A block whose E4M3 scale rounds to 0 (its amax below 2**-9 * amax / 448 * 6 ... i.e. tiny next to
the tensor's largest value) is flushed to zero: telemetry counts it as underflow.

Weights are quantized in 16x16 tiles (:func:`quantize_nvfp4_2d`): one scale per tile, so the
dgrad GEMM's W^T (quantized along the other dim) is the *same* numbers transposed
(:func:`transpose_2d`), and forward and backward see one weight. Activations and gradients use
1x16 blocks. Gradients are rounded stochastically (:func:`e2m1_encode` with a seed: P(round up)
= distance to the lower grid value / grid step, so the rounding is unbiased in expectation; the
noise is counter-based, :func:`sr_uniform`, a hash of the seed and the element's index, so a
Triton kernel draws the same); weights and activations round to nearest, ties to even.
Padding as for MXFP8 (``mx.py``): the contraction dim is zero-padded to whole blocks before the
amax and stored padded.
"""

from __future__ import annotations

import torch

from lowprec.fp8.cast.formats import E4M3
from lowprec.fp8.cast.mx import (
    E2M1_VALUES,
    BlockScaledData,
    e2m1_decode,
    e2m1_grid as _grid,
    e2m1_unpack,
    e2m1_unpack_codes,
    pad_to_blocks,
)

__all__ = [
    "NVFP4_BLOCK",
    "E2M1_VALUES",
    "e2m1_encode",
    "e2m1_decode",
    "e2m1_pack",
    "e2m1_unpack",
    "quantize_nvfp4",
    "quantize_nvfp4_2d",
    "transpose_2d",
    "tensor_scales",
    "mix32",
    "sr_key",
    "SRKey",
    "sr_uniform",
    "RNE_POSITIVE_BOUNDS",
]

NVFP4_BLOCK = 16
FP4_MAX = 6.0
_E4M3_MAX = 448.0
FP4X2 = torch.float4_e2m1fn_x2


def _code_of(a: torch.Tensor, rnd) -> torch.Tensor:
    """Magnitudes in [0, 6] -> E2M1 codes with ``rnd`` (``torch.round``: ties to even, or
    ``torch.floor``) applied in the binade's own step: 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
    Below 2 the code is the count of halves; above, the code counts on from 4 (value 2)."""
    return torch.where(a < 2, rnd(a * 2), torch.where(a < 4, rnd(a) + 2, rnd(a * 0.5) + 4)).clamp_(max=7)


def _rne_boundaries() -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest-even E2M1 encoding as one ``bucketize`` over the signed line.

    Between two neighbouring values of the signed grid (-6 .. 6) the midpoint is the boundary;
    at a tie the value goes to the even code (the one with mantissa bit 0): ``bucketize``
    (``right=False``) sends a value equal to a boundary to the lower bucket, so a boundary whose
    tie must go up is moved one float32 ulp down (no float32 lies between: exact). Returns
    (15 boundaries, 16 codes: bucket i -> code; bucket 15 is NaN's -> 0). Checked against the
    per-binade ``torch.round`` rule (``_code_of``) in ``tests/test_mx_cpu_fast.py``.
    """
    mags = list(E2M1_VALUES)
    signed = [-v for v in reversed(mags[1:])] + mags  # -6 .. 6, 15 values
    code = [8 | mags.index(-v) for v in signed if v < 0] + list(range(8))
    bounds = []
    for lo, hi, c_lo, c_hi in zip(signed, signed[1:], code, code[1:]):
        mid = torch.tensor((lo + hi) / 2, dtype=torch.float32)
        if c_hi % 2 == 0 and c_lo % 2 == 1:  # tie goes up (to hi): just below the midpoint
            mid = torch.nextafter(mid, torch.tensor(-float("inf")))
        bounds.append(float(mid))
    bounds.append(float("inf"))  # +inf saturates to 6 (bucket 14); only NaN lands above (15)
    code = [c if c != 8 else 0 for c in code] + [0]  # no negative zero; NaN -> 0
    return torch.tensor(bounds, dtype=torch.float32), torch.tensor(code, dtype=torch.uint8)


_RNE: dict = {}
# the positive boundaries of the signed line (0.25 .. 5): the RNE code of |y| is the count of
# them below |y| (the negative side's boundaries are these moved one ulp out: the same count)
RNE_POSITIVE_BOUNDS = tuple(float(b) for b in _rne_boundaries()[0] if 0 < b < float("inf"))


def _encode_rne(y: torch.Tensor) -> torch.Tensor:
    if y.device not in _RNE:
        b, c = _rne_boundaries()
        _RNE[y.device] = (b.to(y.device), c.to(y.device))
    bounds, codes = _RNE[y.device]
    # contiguous: torch copies a strided input anyway, with a UserWarning to the user
    return codes[torch.bucketize(y.contiguous(), bounds, out_int32=True)]


def _sr_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid (0 .. 6) and 1 / (step to the next grid value) per code (0 for 6, the top)."""
    grid = _grid(device)
    step = torch.cat([grid[1:] - grid[:-1], torch.zeros(1, device=grid.device)])
    return grid, torch.where(step > 0, 1 / torch.where(step > 0, step, 1.0), 0.0)


def mix32(x):
    """lowbias32 (C. Wellons' hash-prospector), a bijective 32-bit integer mixer, on a Python int or
    an int64 tensor holding values in [0, 2**32): the same bits as Triton's uint32 arithmetic
    (each multiply split in 16-bit halves, so no int64 product overflows). A tensor is not
    changed: the mixing runs in place on a copy (:func:`_mix32_`)."""
    if isinstance(x, torch.Tensor):
        return _mix32_(x.clone())
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: int, c: int) -> int:
    """``(x * c) mod 2**32`` for x in [0, 2**32)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """:func:`_mul32` in place on an int64 tensor (one temporary: the high half's product)."""
    hi = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(0xFFFFFFFF)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int64 tensor (12x faster on CPU than the out-of-place form)."""
    x ^= x >> 16
    _mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    _mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def sr_key(seed: int) -> int:
    """The 32-bit key of a stochastic-rounding stream: ``seed_lo ^ mix32(seed_hi)`` of a 64-bit seed."""
    seed = int(seed) & (2**64 - 1)
    return (seed & 0xFFFFFFFF) ^ mix32(seed >> 32)


class SRKey(int):
    """A stream already keyed (:func:`sr_key` of its seed): what the fused cast op takes."""


def sr_uniform(key: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """The counter-based noise: element ``i`` (its index in the row-major ``shape``, the quantized
    operand's layout with the contraction dim padded to whole blocks) gets
    ``u = (mix32(key ^ (i mod 2**32)) >> 8) * 2**-24``, a float32 in [0, 1) on a 2**-24 grid."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64, device=device).reshape(shape)
    if n > 2**32:
        i.bitwise_and_(0xFFFFFFFF)
    return (_mix32_(i.bitwise_xor_(key)) >> 8).to(torch.float32).mul_(2.0**-24)


def e2m1_encode(y: torch.Tensor, generator: torch.Generator | int | None = None) -> torch.Tensor:
    """Already-scaled float32 values -> E2M1 codes (uint8, 0..15), saturating at +-6.

    ``generator=None``: round to nearest, ties to even (``torch.round`` in each binade's step
    gives the even code at a tie: 0.75 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Otherwise
    stochastic rounding: up with probability (|y| - lo) / (hi - lo), the noise
    :func:`sr_uniform` of the stream ``generator`` (an int seed; a ``torch.Generator`` gives one
    seed per call, drawn from it) at each element's row-major index in ``y``, so the fused cast
    kernel draws the same noise. NaN becomes code 0; callers carry NaN in the scale instead
    (E2M1 has no NaN).
    """
    if generator is None:  # one pass (see _rne_boundaries); same codes as _code_of with round
        return _encode_rne(y.to(torch.float32))
    if isinstance(generator, torch.Generator):
        generator = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    a = torch.nan_to_num(y.abs(), nan=0.0).clamp_(max=FP4_MAX)
    grid, inv_step = _sr_tables(y.device)
    # lo: the largest grid value <= a (one bucketize; the same code as _code_of with floor)
    lo = torch.bucketize(a.contiguous(), grid, right=True, out_int32=True).sub_(1)  # contiguous: as _encode_rne
    # (a - lo) / step as a multiply by 1/step (powers of two: exact, the same p); 6 -> p = 0
    p = (a - grid[lo]).mul_(inv_step[lo])
    key = generator if isinstance(generator, SRKey) else sr_key(generator)
    u = sr_uniform(key, tuple(a.shape), a.device)
    code = (lo + (u < p)).to(torch.uint8)
    sign = ((y < 0) & (code > 0)).to(torch.uint8) << 3  # no negative zero
    return code | sign


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes, C even -> (R, C/2) ``float4_e2m1fn_x2`` (even index in the low nibble)."""
    lo, hi = codes[:, 0::2], codes[:, 1::2]
    return (lo | (hi << 4)).contiguous().view(FP4X2)


def tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, 1/S) from the tensor's amax (a float32 scalar): encode and decode per-tensor factors;
    S = 448 * 6 / amax (1 for a zero tensor, NaN for a non-finite one, which then reaches every
    decoded value)."""
    s = torch.where(amax > 0, (_E4M3_MAX * FP4_MAX) / amax, torch.ones_like(amax))
    s = torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))
    return s, s.reciprocal()


def _tensor_scales(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tensor_scales(x32.abs().amax())


def _block_amax(tiles: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim in one pass (``aminmax``: no |x| temporary); NaN propagates.
    A zero block's amax is +0 (``abs_``: ``maximum(0, -0)`` may be either zero, which reached the
    E4M3 scale byte as 0x80 or 0x00)."""
    lo, hi = torch.aminmax(tiles, dim=-1)
    return torch.maximum(hi, -lo).abs_()


def _encode_blocks(
    tiles: torch.Tensor, block_amax: torch.Tensor, s: torch.Tensor, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales and E2M1 codes for ``tiles`` (..., block) given each block's amax."""
    scale = (block_amax / FP4_MAX * s).clamp(max=_E4M3_MAX).to(E4M3)
    sf = scale.to(torch.float32)
    enc = torch.where(sf > 0, s / torch.where(sf > 0, sf, 1.0), torch.zeros_like(sf))  # flushed block: zeros
    codes = e2m1_encode(tiles * enc.unsqueeze(-1), generator)
    return scale, codes


def quantize_nvfp4(
    x: torch.Tensor,
    generator: torch.Generator | int | None = None,
    block: int = NVFP4_BLOCK,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockScaledData:
    """NVFP4 with 1x``block`` blocks along the last dim of a 2-D ``x``; ``generator`` turns on
    stochastic rounding (gradients). ``scales``: (S, 1/S) already known (:func:`tensor_scales`
    of ``x``'s amax, as the fused cast takes them), else computed here."""
    if x.dim() != 2:
        raise ValueError(f"NVFP4 quantization needs a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    x32 = pad_to_blocks(x.detach().to(torch.float32, memory_format=torch.contiguous_format), block)
    tiles = x32.reshape(rows, -1, block)
    block_amax = _block_amax(tiles)
    # the tensor amax is the largest block amax
    s, decode = _tensor_scales(block_amax) if scales is None else scales
    scale, codes = _encode_blocks(tiles, block_amax, s, generator)
    return BlockScaledData(e2m1_pack(codes.reshape(rows, -1)), scale, cols, block, decode)


def quantize_nvfp4_2d(
    w: torch.Tensor, block: int = NVFP4_BLOCK, scales: tuple[torch.Tensor, torch.Tensor] | None = None
) -> BlockScaledData:
    """NVFP4 with ``block`` x ``block`` tiles (weights), round to nearest. The result is quantized
    along the last dim like any operand; its scale is the tile's, repeated on each of its rows.
    ``scales`` as for :func:`quantize_nvfp4`."""
    rows, cols = w.shape
    w32 = pad_to_blocks(w.detach().to(torch.float32), block)
    rp = (-rows) % block
    wp = torch.nn.functional.pad(w32, (0, 0, 0, rp)) if rp else w32  # zero rows: amax only
    s, decode = _tensor_scales(w32) if scales is None else scales
    nr, nc = wp.shape[0] // block, wp.shape[1] // block
    tile_amax = wp.reshape(nr, block, nc, block).abs().amax(dim=(1, 3))  # (nr, nc)
    row_amax = tile_amax.repeat_interleave(block, dim=0)[:rows]  # each row's blocks: its tile's amax
    scale, codes = _encode_blocks(w32.reshape(rows, nc, block), row_amax, s, None)
    return BlockScaledData(e2m1_pack(codes.reshape(rows, -1)), scale, cols, block, decode)


def transpose_2d(q: BlockScaledData) -> BlockScaledData:
    """The 2-D-quantized (R, C) operand as the (C, R) operand quantized along R: the same E2M1
    values and tile scales, transposed (no rounding happens; nothing is re-quantized)."""
    b = q.block
    rows, cols = q.shape
    codes = e2m1_unpack_codes(q.data)[:, :cols]  # (R, C)
    codes_t = pad_to_blocks(codes.t().contiguous(), b)  # (C, R padded)
    nr = -(-rows // b)
    tile = q.scale[0::b]  # (nr, C padded / b): one row per tile row
    scale_t = tile.t().contiguous().view(torch.uint8).repeat_interleave(b, dim=0)[:cols].view(E4M3)
    assert scale_t.shape == (cols, nr)
    return BlockScaledData(e2m1_pack(codes_t), scale_t.contiguous(), rows, b, q.tensor_scale)
