"""Activation checkpointing that keeps FP8 layers consistent.

``torch.utils.checkpoint`` re-runs a forward during backward. Backward is usually called
outside ``fp8.autocast()``, so a plain checkpoint would recompute Float8Linear in high
precision (saving other tensors than the first forward: a ``CheckpointError``), and delayed
scaling would record its amaxes twice. ``fp8.checkpoint`` re-enters the FP8 region of the
original forward for the recompute, and delayed-scaling layers replay the scales of that
forward without touching their state (TransformerEngine's ``te.checkpoint`` does the same).

    h = fp8.checkpoint(block, h)      # instead of torch.utils.checkpoint.checkpoint(block, h)

Non-reentrant checkpointing only. A layer checkpointed twice before one backward (e.g. two
micro-batches in flight) replays the scales of its *last* forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.checkpoint as _ckpt

from lowprec.fp8.modules.autocast import replay_context

__all__ = ["checkpoint"]


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` with the FP8
    region replayed for the recompute. Keyword arguments go to ``function``."""
    return _ckpt.checkpoint(function, *args, use_reentrant=False, context_fn=replay_context, **kwargs)
