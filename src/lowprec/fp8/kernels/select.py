"""Run-time choice between the Triton kernels and the torch path.

The Triton path runs only on CUDA tensors, only when ``triton`` can be imported, and never
when ``LOWPREC_DISABLE_TRITON=1``. Nothing here imports triton: ``importlib.util.find_spec``
answers whether it *could* be imported, so ``import lowprec.fp8`` stays torch-only and works
where triton is absent (CPU CI).

Both checks are wrapped in ``torch.compiler.assume_constant_result``: under
``torch.compile`` Dynamo evaluates them once while tracing and bakes the answer into the graph
instead of breaking the graph on ``importlib`` / ``os.environ``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["DISABLE_ENV", "available", "triton_importable", "disabled_by_env"]

DISABLE_ENV = "LOWPREC_DISABLE_TRITON"

_IMPORTABLE: list[bool] = []  # memo; a list so tests can clear it


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    """Whether ``import triton`` would succeed (checked once, without importing it)."""
    if not _IMPORTABLE:
        try:
            _IMPORTABLE.append(importlib.util.find_spec("triton") is not None)
        except (ImportError, ValueError):  # a broken or half-installed package
            _IMPORTABLE.append(False)
    return _IMPORTABLE[0]


@torch.compiler.assume_constant_result
def disabled_by_env() -> bool:
    """``LOWPREC_DISABLE_TRITON=1`` (or true/yes/on) forces the torch path everywhere."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def available(device: torch.device | str) -> bool:
    """True where the fused Triton casts run: a CUDA device, triton importable, not disabled.

    CPU tensors always take the torch path (the Triton interpreter is for tests only).
    """
    if torch.device(device).type != "cuda":
        return False
    return triton_importable() and not disabled_by_env()
