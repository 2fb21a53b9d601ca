"""Random Hadamard transform (RHT) on the weight-gradient GEMM's inputs (NVFP4 recipe).

``grad_W = dY^T X`` contracts over the token dim M. With Q an orthogonal 16x16 matrix applied
block-diagonally along M, ``(Q^T dY)^T (Q^T X) = dY^T Q Q^T X = dY^T X``: the GEMM's value is
unchanged, but each 16-element block of the transformed operands mixes 16 tokens, which spreads
an outlier over its block and makes the 1x16 FP4 blocks better conditioned (NVIDIA, arXiv
2509.25149, section 4.2; TransformerEngine's NVFP4 recipe applies it to Wgrad only).

Q = H16 diag(signs) / 4: H16 the Sylvester Hadamard matrix (entries +-1), ``signs`` a fixed
random +-1 vector drawn from the recipe's seed. Every entry is +-1/4, a power of two, so Q and
Q^T Q = I are exact in float32. Ragged M is zero-padded to whole 16-row blocks (zero rows add
nothing to the GEMM).
"""

from __future__ import annotations

import functools

import torch

from lowprec.fp8.gemm.capability import device_constant

__all__ = ["HADAMARD_SIZE", "hadamard_matrix", "random_hadamard", "apply_rht", "rht_sign_bits", "rht", "rht_rows"]

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), entries +-1, float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _signs(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (n,), generator=g).to(torch.float32) * 2 - 1


def random_hadamard(seed: int, n: int = HADAMARD_SIZE, device=None) -> torch.Tensor:
    """Q = H diag(signs) / sqrt(n), orthogonal; ``signs`` drawn from ``seed`` (reproducible).

    With a ``device``, made there once per (seed, n, device) and shared (not for in-place use):
    a host-to-device copy in every NVFP4 backward made the step wait for the GPU (found by
    ``test_training_step_never_syncs_the_host`` on the H200)."""
    if device is not None:
        return device_constant(("hadamard", int(seed), n), device, lambda d: random_hadamard(seed, n).to(d))
    return hadamard_matrix(n) * _signs(seed, n) / (n**0.5)


def apply_rht(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``Q^T`` applied to each block of ``n`` rows of a 2-D ``x`` (rows zero-padded to whole
    blocks); returns float32 of shape (padded rows, cols)."""
    n = q.shape[0]
    rows, cols = x.shape
    x32 = x.to(torch.float32)
    pad = (-rows) % n
    if pad:
        x32 = torch.nn.functional.pad(x32, (0, 0, 0, pad))
    blocks = x32.reshape(-1, n, cols)
    return torch.matmul(q.t().to(x32.device), blocks).reshape(-1, cols)


@functools.lru_cache(maxsize=64)
def rht_sign_bits(seed: int) -> int:
    """``random_hadamard(seed)``'s signs (16) as a host integer: bit i set where sign i is -1."""
    return sum(1 << i for i, v in enumerate(_signs(seed, HADAMARD_SIZE).tolist()) if v < 0)


def rht(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``apply_rht(x, random_hadamard(seed))`` as the fused cast kernel computes it, bit for bit
    (:func:`rht_rows` with the seed's signs): the same transform as the matmul in
    :func:`apply_rht` up to float32 summation order."""
    return rht_rows(x, rht_sign_bits(seed))


def rht_rows(x: torch.Tensor, sign_bits: int) -> torch.Tensor:
    """``Q^T`` on each block of 16 rows of a 2-D ``x`` (rows zero-padded to whole blocks), Q =
    H16 diag(signs) / 4 with sign i = -1 where bit i of ``sign_bits`` is set:
    ``(Q^T x)_j = signs_j / 4 * (H16 x)_j``, H16 x by the fast Walsh-Hadamard butterfly (stages
    of pairs 8, 4, 2, 1 rows apart: ``a + b``, ``a - b``), then the exact factor ``+-1/4``.
    float32 of shape (padded rows, cols)."""
    n = HADAMARD_SIZE
    rows, cols = x.shape
    y = x.to(torch.float32)
    if rows % n:
        y = torch.nn.functional.pad(y, (0, 0, 0, (-rows) % n))
    for g, h in ((1, 8), (2, 4), (4, 2), (8, 1)):
        y = y.reshape(-1, g, 2, h, cols)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
    row = device_constant(
        ("rht_rows", int(sign_bits)),
        x.device,
        lambda d: torch.tensor([-0.25 if sign_bits >> i & 1 else 0.25 for i in range(n)], device=d),
    )
    return (y.reshape(-1, n, cols) * row[:, None]).reshape(-1, cols)
