"""Compressed storage of Adam's moments: pure encode/decode functions, no optimizer state.

First moment ``m`` (signed, roughly the size of the gradient):
    FP8 (E4M3 by default) with one power-of-two scale per ``block_size`` consecutive elements
    of the flattened tensor, or one per tensor (``block_size=None``). Encoding goes through
    ``lowprec.fp8`` (quantize, scaling, saturated_cast); nothing here re-implements the cast.
    Round to nearest by default. Optional stochastic rounding (``noise``) fixes the stall of a
    nearly constant gradient: the update's SQNR goes from 14 to 28 dB. It costs 3 dB when
    gradients are noisy (docs/LOG.md, optim entry).

Second moment ``v`` (non-negative, roughly the *square* of the gradient):
    we store ``sqrt(v)`` in FP16 (or BF16/FP32) with one power-of-two scale per tensor.
    Why the square root: ``v`` spans the square of the gradient's dynamic range. A tensor whose
    gradients span 1e6 has ``v`` spanning 1e12, past FP16's ~1e12 total range (1e9 of it
    normal), and a ``v`` that flushes to zero while ``m`` does not turns the update into
    ``m / eps`` -- a blow-up. ``sqrt(v)`` spans only the gradient's range. The per-tensor scale
    moves that range to the top of FP16, so tiny gradients (1e-8 and below) do not underflow.
    Rounding: with beta2 = 0.999 each step moves ``sqrt(v)`` by ~5e-4 relative, the size of
    an FP16 half-ulp, so round-to-nearest drifts: -5.6% in ``v`` after 4000 steps of
    stationary noise (measured, docs/LOG.md, optim entry). Stochastic rounding (``noise``, uniform in
    [0, 1)) is unbiased: +0.02% after 4000 steps.

Scales are powers of two, so rescaling is exact, and are recomputed from the current value on
every step ("current scaling"): no history, nothing to go stale, no margin needed.

Segments: DeepSpeed ZeRO steps the optimizer on flat partitions that concatenate many
parameters. Plain blocks would then straddle parameter boundaries, and a small parameter
sharing a block with a neighbour whose gradients are 1e5x larger flushes to zero (measured:
0.4 dB update SQNR, docs/LOG.md, dsopt entry). ``segments`` (lengths summing to ``numel``) restarts
the blocks at every segment start, so no block mixes two parameters.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from lowprec.fp8.cast.formats import is_fp8_dtype
from lowprec.fp8.cast.quantize import (
    Float8Data,
    dequantize,
    quantize_blockwise,
    quantize_tensorwise,
    saturated_cast,
)
from lowprec.fp8.cast.scaling import amax, amax_to_scale, block_amax

__all__ = [
    "EXP_AVG_DTYPES",
    "EXP_AVG_SQ_DTYPES",
    "encode_exp_avg",
    "decode_exp_avg",
    "encode_exp_avg_sq",
    "encode_root",
    "decode_exp_avg_sq",
    "stochastic_round",
    "dither",
    "state_bytes",
    "segment_layout",
]

EXP_AVG_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32)
EXP_AVG_SQ_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest power of two with ``amax * scale <= finfo(dtype).max`` (1 for float32)."""
    if dtype == torch.float32:
        return torch.ones((), dtype=torch.float32, device=amax.device)
    top = torch.finfo(dtype).max
    safe = torch.clamp(amax.to(torch.float64), min=1e-30)
    # Non-finite amax: NaN/inf scale. The caller's values carry the NaN into the state, where
    # the next step's update shows it; a NaN is never turned into a finite number.
    # Capped at 2**100 so that BF16's huge max cannot push the scale past float32's range.
    exponent = torch.clamp(torch.floor(torch.log2(top / safe)), max=100.0)
    return torch.exp2(exponent).to(torch.float32)


@lru_cache(maxsize=256)
def _segment_layout_cpu(segments: tuple[int, ...], block_size: int) -> tuple[torch.Tensor, int]:
    keep = []
    start = 0
    for length in segments:
        keep.append(torch.arange(start, start + length))
        start += -(-length // block_size) * block_size
    return torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long), start


def segment_layout(segments: tuple[int, ...], block_size: int, device=None) -> tuple[torch.Tensor, int]:
    """(``keep``, ``padded``): each segment padded to whole blocks and laid end to end;
    ``keep[i]`` is where element ``i`` of the flat tensor sits in that ``padded``-long layout."""
    keep, padded = _segment_layout_cpu(tuple(int(n) for n in segments), int(block_size))
    return keep.to(device) if device is not None else keep, padded


def encode_exp_avg(
    m: torch.Tensor,
    dtype: torch.dtype,
    block_size: int | None,
    noise: torch.Tensor | None = None,
    segments: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``m`` -> (payload in ``m``'s shape, float32 scale).

    Scale shape: ``()`` per tensor, ``(ceil(numel / block_size),)`` blockwise, or with
    ``segments`` one block run per segment (``sum(ceil(n / block_size))``). FP16/BF16/FP32
    payloads are stored unscaled (scale 1). ``noise`` (uniform [0, 1), ``m``'s shape) selects
    stochastic rounding; None rounds to nearest.
    """
    one = torch.ones((), dtype=torch.float32, device=m.device)
    if not is_fp8_dtype(dtype):
        return (m if noise is None else dither(m, dtype, noise)).to(dtype), one
    if segments is not None and block_size is not None:
        keep, padded_n = segment_layout(segments, block_size, m.device)
        flat = m.reshape(-1)
        padded = flat.new_zeros(padded_n)
        padded[keep] = flat
        scale = amax_to_scale(block_amax(padded.view(1, -1), (1, block_size)), dtype, power_of_2=True)
        scale = scale.reshape(-1)
        scaled = flat * scale.repeat_interleave(block_size)[keep]
        if noise is not None:
            scaled = dither(scaled, dtype, noise.reshape(-1))
        return saturated_cast(scaled, dtype).view(m.shape), scale
    flat = m.reshape(1, -1)
    block = block_size if block_size is not None and flat.shape[1] > block_size else None  # None: per tensor
    if noise is None:
        if block is None:
            q: Float8Data = quantize_tensorwise(flat, dtype, power_of_2=True)
            return q.data.view(m.shape), q.scale.reshape(())
        q = quantize_blockwise(flat, dtype, (1, block), power_of_2=True)
        return q.data.view(m.shape), q.scale.reshape(-1)
    # Stochastic: the same scales as above, then dither in the scaled domain and cast. A
    # value dithered past fp8_max saturates (only the block maximum can), NaN stays NaN.
    if block is None:
        scale = amax_to_scale(amax(flat), dtype, power_of_2=True)
        full = scale
    else:
        pad = (-flat.shape[1]) % block
        padded = torch.nn.functional.pad(flat, (0, pad))
        scale = amax_to_scale(block_amax(padded, (1, block)), dtype, power_of_2=True)
        full = scale.repeat_interleave(block, dim=1)[:, : flat.shape[1]]
    data = saturated_cast(dither(flat * full, dtype, noise.reshape(1, -1)), dtype)
    return data.view(m.shape), scale.reshape(()) if block is None else scale.reshape(-1)


def decode_exp_avg(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_size: int | None,
    segments: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_exp_avg`, in float32."""
    if scale.dim() == 0:
        return data.to(torch.float32) / scale
    if segments is not None and block_size is not None:
        keep, padded_n = segment_layout(segments, block_size, data.device)
        if scale.numel() * block_size != padded_n:
            raise ValueError(
                f"FP8 first moment has {scale.numel()} block scales but its parameter's segments "
                f"need {padded_n // block_size}: the state was saved under another layout (a "
                "different ZeRO stage or world size); resume with the settings it was saved with"
            )
        full = scale.repeat_interleave(block_size)[keep]
        return (data.reshape(-1).to(torch.float32) / full).view(data.shape)
    if block_size is None:
        raise ValueError("an FP8 first moment with block scales needs its block_size")
    flat = data.reshape(1, -1)
    q = Float8Data(flat, scale.reshape(1, -1), "block", (1, block_size))
    return dequantize(q).view(data.shape)


_MANTISSA_BITS = {
    torch.float16: 10,
    torch.bfloat16: 7,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}


def dither(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """``x + (noise - 1/2) * ulp_dtype(x)`` in float32: rounding this to nearest rounds ``x``
    up with probability equal to its distance from the grid point below (exact within a
    binade). ``noise`` is uniform in [0, 1) and supplied by the caller, so the function stays
    pure and a seeded caller stays reproducible."""
    if dtype == torch.float32:
        return x
    tiny = torch.finfo(dtype).tiny  # below it the spacing is that of the subnormals
    exponent = torch.floor(torch.log2(x.abs().clamp_min(tiny)))
    ulp = torch.exp2(exponent - _MANTISSA_BITS[dtype])
    return x + (noise - 0.5) * ulp


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to FP16/BF16/FP32 ``dtype`` stochastically (see :func:`dither`)."""
    return dither(x, dtype, noise).to(dtype)


def encode_exp_avg_sq(
    v: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``v`` (>= 0) -> (``sqrt(v) * scale`` in ``dtype``, float32 per-tensor scale).

    ``noise`` (uniform [0, 1), ``v``'s shape) selects stochastic rounding; None rounds to nearest.
    """
    return encode_root(v.sqrt(), dtype, noise)


def encode_root(
    root: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor | None = None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_exp_avg_sq` from ``sqrt(v)``; ``amax`` of the whole tensor when ``root`` is
    a shard of it (FSDP2: ``lowprec.optim.sharded``), else computed here."""
    if amax is None:
        amax = root.abs().amax() if root.numel() else torch.zeros((), device=root.device)
    scale = _pow2_scale(amax, dtype)
    scaled = root * scale
    if noise is None:
        return scaled.to(dtype), scale
    # |dither| < ulp/2 of a value <= max keeps the result finite; clamp >= 0 keeps v >= 0
    return stochastic_round(scaled, dtype, noise).clamp_min(0), scale


def decode_exp_avg_sq(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_exp_avg_sq`: returns ``v`` in float32."""
    root = data.to(torch.float32) / scale
    return root * root


def state_bytes(state: dict) -> int:
    """Bytes held by one parameter's optimizer state (tensors only)."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
