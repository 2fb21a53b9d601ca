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

from typing import TYPE_CHECKING

import torch

from lowprec.fp8.cast.formats import fp8_max

if TYPE_CHECKING:
    from lowprec.fp8.recipes import Recipe

__all__ = [
    "AMAX_EPS",
    "amax",
    "no_grad_view",
    "amax_along",
    "block_amax",
    "amax_to_scale",
    "record_amax",
    "history_to_amax",
    "delayed_scale_step",
]


def amax_eps() -> float:
    """Smallest amax used to build a scale. With E5M2 (max 57344) the scale stays below 6e16,
    comfortably inside float32, and zeros stay zeros.

    ``AMAX_EPS`` as a literal in the code, for what ``torch.compile`` traces: a float read
    from a module global becomes a graph input under ``dynamic=True``, which Dynamo cannot lift
    out of a traced autograd.Function (see ``formats.fp8_max``)."""
    return 1e-12


AMAX_EPS = amax_eps()


def no_grad_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an input that records no autograd graph: ``x.detach()`` only where that matters
    (a detach is a dispatched op; inside an autograd Function's forward/backward, grad mode is
    off and ``x`` itself records nothing)."""
    return x.detach() if x.requires_grad and torch.is_grad_enabled() else x


def amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor absolute maximum as a float32 scalar (NaN propagates).

    ``max(-min, max)`` from one ``aminmax`` pass: no ``abs()`` temporary the size of ``x``
    (on CPU a fresh large temporary costs page faults on every call).
    """
    lo, hi = torch.aminmax(no_grad_view(x))
    return torch.maximum(-lo, hi).to(torch.float32)


def amax_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Absolute maximum over ``dim`` (kept), one value per slice: rowwise / axiswise scaling."""
    lo, hi = torch.aminmax(no_grad_view(x), dim=dim, keepdim=True)
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
    division rounds once: a true tensor division, not ``fp8_max / t`` (which torch runs as
    ``t.reciprocal() * fp8_max``, two roundings: 448 / 56 came out 7.999999999999999). The
    power of two is the float64's exponent, read from its bits, not ``exp2(floor(log2(s)))``,
    whose ``log2`` rounds differently on CPU and CUDA next to a power of two. So the scale is
    the same number on every device and in the Triton kernels (the H200 run found them 2x
    apart for amax 56). NaN stays NaN (``clamp`` keeps it); an inf amax gives 0.
    """
    safe = torch.clamp(amax.to(torch.float64), min=amax_eps())
    scale = torch.div(torch.full_like(safe, fp8_max(dtype)), safe)
    if margin:
        scale = scale / (2.0**margin)  # a power of two: exact
    if power_of_2:
        scale = floor_pow2(scale)
    return scale.to(torch.float32)


_EXPONENT_BITS = 0x7FF0000000000000  # float64 sign (0) and exponent: floor to a power of two


def floor_pow2(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= ``s`` for positive normal float64 ``s`` (its exponent, from
    the bits; exact on every device), 0 for 0, NaN for NaN."""
    floored = (s.view(torch.int64) & _EXPONENT_BITS).view(torch.float64)
    return torch.where(torch.isnan(s), s, floored)


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


def delayed_scale_step(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    amax_now: torch.Tensor,
    dtype: torch.dtype,
    recipe: Recipe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of delayed scaling for one operand; pure.

    Returns ``(scale_used, new_history, new_scale)``: the scale to cast this step's tensor
    with (from earlier steps, or from ``amax_now`` while the history holds nothing), the
    history with ``amax_now`` recorded, and the scale for the next step (refreshed when
    ``(step + 1) % interval == 0``, otherwise kept).
    """
    have_history = history_to_amax(history, "max") > 0
    pow2 = recipe.power_of_2_scales
    scale_now = amax_to_scale(amax_now, dtype, margin=recipe.margin, power_of_2=pow2)
    scale_used = torch.where(have_history, scale, scale_now)
    # A non-finite tensor casts with a NaN scale, as current scaling does (module docstring): the
    # history keeps it out, and the NaN reaches the GEMM output on every kernel path, including
    # the CPU upcast, which does not decode NaN bytes (cpu_gemm.py).
    scale_used = torch.where(torch.isfinite(amax_now), scale_used, torch.full_like(scale_used, float("nan")))
    new_history = record_amax(history, amax_now)
    refresh = ((step + 1) % recipe.interval == 0) | ~have_history
    candidate = amax_to_scale(
        history_to_amax(new_history, recipe.amax_compute_algo), dtype, margin=recipe.margin, power_of_2=pow2
    )
    new_scale = torch.where(refresh, candidate, scale_used)
    return scale_used, new_history, new_scale
