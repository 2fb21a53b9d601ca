"""Sample packing (``sample_packing: true``): short examples share a row of ``sequence_len`` tokens.

Two pure pieces: :func:`pack` chooses which examples share a row (first-fit decreasing, the
bin packing Axolotl's multipack sampler approximates; deterministic, so a resumed run sees the
same rows), and :func:`packed_causal_mask` turns position ids that restart at 0 for each example
into the block-diagonal causal mask that keeps examples from attending to each other. A new
example starts wherever the position id does not follow the previous one (``pos[t] != pos[t-1]
+ 1``), the same rule transformers applies to ``position_ids`` without an attention mask
(``masking_utils.find_packed_sequence_indices``), so both models see the same boundaries.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

__all__ = ["pack", "segment_ids", "packed_causal_mask"]


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most ``capacity`` tokens: longest first,
    each into the fullest row it still fits (best fit). Rows keep their examples in index order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row) sorted, for best-fit by bisect
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than sequence_len: {capacity}")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
        else:
            rows.append([i])
            bisect.insort(free, (capacity - n, len(rows) - 1))
    return [sorted(r) for r in rows]


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T) example index within each row (0, 0, 1, 1, 1, 2 ...)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(-1)


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids -> (B, 1, T, T) boolean SDPA mask (True = attend): causal, and only
    within the query's own example. Each query sees at least itself, so no row is all False."""
    seg = segment_ids(position_ids)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]
