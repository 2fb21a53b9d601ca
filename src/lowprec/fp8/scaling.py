"""Scale computation: small pure functions, no module state.

Convention: ``q = saturate(x * scale)`` quantizes and ``x ~= q / scale`` dequantizes, so a
scale is ``fp8_max / amax`` (optionally divided by ``2**margin`` and rounded down to a power
of two). GEMM kernels take the reciprocal ("dequantization scale").

Special values, one rule each:

* zero tensor: amax is clamped to ``AMAX_EPS`` so the scale is large and finite; zeros
  quantize to zeros exactly.
* NaN anywhere: amax is NaN, the scale is NaN, and every quantized value is NaN. A NaN is
  never turned into a finite number.
* +-inf anywhere: amax is inf, the scale is 0, finite values quantize to 0 and inf to NaN
  (0 * inf). The output of the GEMM is NaN, so the overflow is visible downstream.
* delayed scaling: a non-finite amax is *not* written into the history (it would poison the
  next ``amax_history_len`` steps); the step's own output still carries the NaN.
"""

from __future__ import annotations

import torch

from lowprec.fp8.formats import fp8_max

__all__ = [
    "AMAX_EPS",
    "amax",
    "amax_along",
    "block_amax",
    "amax_to_scale",
    "record_amax",
    "history_to_amax",
]

# Smallest amax used to build a scale. With E5M2 (max 57344) the scale stays below 6e16,
# comfortably inside float32, and zeros stay zeros.
AMAX_EPS = 1e-12


def amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor absolute maximum as a float32 scalar (NaN propagates).

    ``max(-min, max)`` from one ``aminmax`` pass: no ``abs()`` temporary the size of ``x``
    (on CPU a fresh large temporary costs page faults on every call).
    """
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(-lo, hi).to(torch.float32)


def amax_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Absolute maximum over ``dim`` (kept), one value per slice: rowwise / axiswise scaling."""
    lo, hi = torch.aminmax(x.detach(), dim=dim, keepdim=True)
    return torch.maximum(-lo, hi).to(torch.float32)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Absolute maximum of each ``block[0] x block[1]`` tile of a 2-D tensor.

    The tensor's dims must be multiples of the block (callers pad first). Returns a
    ``(rows // block[0], cols // block[1])`` float32 tensor.
    """
    r, c = x.shape
    br, bc = block
    tiles = x.detach().reshape(r // br, br, c // bc, bc)
    # max(-min, max) over each tile: two reads, no abs() temporary the size of x
    return torch.maximum(-tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))).to(torch.float32)


def amax_to_scale(
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    margin: int = 0,
    power_of_2: bool = False,
) -> torch.Tensor:
    """``scale = fp8_max / amax / 2**margin``, optionally rounded down to a power of two.

    Rounding *down* keeps ``amax * scale <= fp8_max``: nothing saturates that would not have
    saturated with the exact scale. Computed in float64 (as torchao does) so that the
    division rounds once.
    """
    safe = torch.clamp(amax.to(torch.float64), min=AMAX_EPS)
    scale = fp8_max(dtype) / safe
    if margin:
        scale = scale / (2.0**margin)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale.to(torch.float32)


def record_amax(history: torch.Tensor, new_amax: torch.Tensor) -> torch.Tensor:
    """Return the history with ``new_amax`` pushed to the front (index 0 = newest).

    A non-finite amax leaves the history unchanged. Pure: the caller copies the result into
    its buffer.
    """
    pushed = torch.cat([new_amax.reshape(1).to(history.dtype), history[:-1]])
    return torch.where(torch.isfinite(new_amax), pushed, history)


def history_to_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is built from: ``max`` over the window or ``most_recent``."""
    if algo == "max":
        return history.amax()
    if algo == "most_recent":
        return history[0]
    raise ValueError(f"amax_compute_algo={algo!r}; use 'max' or 'most_recent'")
