"""``set_seed``: seed python, numpy (if installed) and torch on every device."""

from __future__ import annotations

import random
from typing import Optional, cast

import torch

__all__ = ["set_seed", "synchronize_rng_states"]


def set_seed(seed: int, device_specific: bool = False) -> None:
    if device_specific:
        import torch.distributed as dist

        seed += dist.get_rank() if dist.is_initialized() else 0
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # seeds CUDA too


def synchronize_rng_states(rng_types: list, generator: Optional[torch.Generator] = None) -> None:
    """Copy process 0's random state to every process (Accelerate's ``rng_types``: ``"torch"``,
    ``"cuda"``, ``"generator"``, the latter being ``generator``); nothing to do on one process."""
    import torch.distributed as dist

    for kind in rng_types:
        kind = getattr(kind, "value", kind)  # an RNGType enum member
        if kind not in ("torch", "cuda", "generator"):
            raise ValueError(f"rng_types: {kind!r} is not supported; use 'torch', 'cuda' or 'generator'")
        if kind == "generator" and generator is None:
            raise ValueError("rng_types contains 'generator' but no synchronized_generator was given")
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            continue
        if kind == "cuda" and not torch.cuda.is_available():
            continue
        state = {
            "torch": torch.get_rng_state,
            "cuda": torch.cuda.get_rng_state,
            "generator": lambda: cast(torch.Generator, generator).get_state(),  # checked above
        }[kind]()
        box = [state]
        dist.broadcast_object_list(box, src=0)
        {
            "torch": torch.set_rng_state,
            "cuda": torch.cuda.set_rng_state,
            "generator": lambda s: cast(torch.Generator, generator).set_state(s),
        }[kind](box[0])
