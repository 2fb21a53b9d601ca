"""The input classes the compiled Triton casts specialise on (read by the self-check, which
checks each class at its first use, and by the ops, which may run a class as two passes)."""

from __future__ import annotations

import torch

__all__ = ["input_class", "INPUT_DTYPES"]

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the fused casts read


def input_class(x: torch.Tensor) -> tuple:
    """What the compiled kernels specialise on: dtype, rows % 16 == 0, cols % 16 == 0."""
    return (x.dtype, x.shape[0] % 16 == 0, x.shape[-1] % 16 == 0)
