"""Triton kernels: both NVFP4 operands of an activation (or of dY) from one read of it.

``t`` (M, C) feeds two GEMMs: the one contracting over C (``quantize_nvfp4(t)``: 1 x 16 blocks along
the rows, tensor scale from ``amax(t)``) and the weight-gradient GEMM contracting over M
(``quantize_nvfp4(rht(t).t())``: the random Hadamard transform along M in 16-row blocks, tensor
scale from ``amax(rht(t))``). One program loads a ``16 x BLOCK_N`` tile of ``t`` once and gives:

* :func:`nvfp4_dual_amax_kernel`: both amaxes (atomic maxes of float32 bits into two int32 slots;
  NaN tracked apart), the pass before the cast;
* :func:`cast_nvfp4_dual_kernel`: both casts, each with its own tensor encode factor and its own
  rounding (round to nearest, or stochastic with its own stream and its own element indexing:
  ``row * NP + column`` on the plain layout, ``column * MP + row`` on the rotated one), the
  rotated tile computed in registers (``triton_nvfp4_rht.py``'s helpers).

With the plain operand turned off (``PLAIN`` / ``ROW`` false) the same kernels are the rotated
operand's alone: ``lowprec::rht_amax`` and ``lowprec::cast_nvfp4_rht``. The arithmetic is the one
of ``cast_nvfp4_kernel``'s 1 x 16 form and of the Hadamard helpers, so the bits are theirs:
checked under the Triton interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.fp8.kernels.triton_nvfp4 import _block_scale, _row_block_amax, _row_codes, _store_rows
from lowprec.fp8.kernels.triton_nvfp4_rht import _amax_bits, _cast_rht_store, _load16, _rht

__all__ = ["nvfp4_dual_amax_kernel", "cast_nvfp4_dual_kernel"]


@triton.jit
def nvfp4_dual_amax_kernel(
    t_ptr, amax_ptr, sign_bits, M, N, stride_m, stride_n, BLOCK_N: tl.constexpr, PLAIN: tl.constexpr
):
    """``PLAIN``: ``max |t|`` into ``amax_ptr[0]`` and ``max |apply_rht(t)|`` into ``amax_ptr[1]``;
    else the second alone into ``amax_ptr[0]`` (``lowprec::rht_amax``). int32 float bits, starting
    at 0; 0x7FC00000 where a tile holds a NaN."""
    x, _, _ = _load16(t_ptr, tl.program_id(0), tl.program_id(1), M, N, stride_m, stride_n, BLOCK_N)
    rotated = _amax_bits(_rht(x, sign_bits, BLOCK_N))
    if PLAIN:
        tl.atomic_max(amax_ptr, _amax_bits(x))
        tl.atomic_max(amax_ptr + 1, rotated)
    else:
        tl.atomic_max(amax_ptr, rotated)


@triton.jit
def cast_nvfp4_dual_kernel(
    t_ptr,
    s_ptr,
    q_ptr,
    sc_ptr,
    qt_ptr,
    st_ptr,
    sign_bits,
    M,
    N,
    stride_m,
    stride_n,
    key,
    key_t,
    SOFT_CAST: tl.constexpr,
    SR: tl.constexpr,
    SR_T: tl.constexpr,
    ROW: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S_T: tl.constexpr,
):
    """``s_ptr``: the tensor encode factors (float32), the plain operand's at 0 and the rotated
    one's at ``S_T`` (1; 0 where ``s_ptr`` holds the rotated one's alone: ``lowprec::cast_nvfp4_rht``).
    ``ROW``: ``quantize_nvfp4(t)`` into ``q`` (M, NP/2) and ``sc`` (M, NP/16), stochastic with the
    stream ``key`` where ``SR``; ``RHT``: ``quantize_nvfp4(apply_rht(t).t())`` into ``qt`` (N, MP/2)
    and ``st`` (N, MP/16), stochastic with ``key_t`` where ``SR_T``. NP / MP: N / M padded to 16."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    x, rm, rn = _load16(t_ptr, pid_m, pid_n, M, N, stride_m, stride_n, BLOCK_N)
    if ROW:
        ra, rnan = _row_block_amax(x, 16, BLOCK_N)
        byte, enc = _block_scale(ra, rnan > 0, tl.load(s_ptr), SOFT_CAST)
        codes = _row_codes(x, enc, rm, rn, N, key, SR, 16, BLOCK_N)
        _store_rows(q_ptr, sc_ptr, codes, byte, rm, pid_n, M, N, 16, BLOCK_N)
    if RHT:
        y = _rht(x, sign_bits, BLOCK_N)
        _cast_rht_store(y, tl.load(s_ptr + S_T), rm, rn, pid_m, M, N, qt_ptr, st_ptr, key_t, SR_T, SOFT_CAST, BLOCK_N)
