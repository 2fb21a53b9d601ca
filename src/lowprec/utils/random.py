"""``set_seed``: seed python, numpy (if installed) and torch on every device."""

from __future__ import annotations

import random

import torch

__all__ = ["set_seed"]


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
