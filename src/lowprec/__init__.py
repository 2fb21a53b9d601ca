"""lowprec: low-precision (FP8, BF16, FP16) training for PyTorch.

``import lowprec.fp8`` needs nothing but torch. The Accelerate-compatible front
(``lowprec.Accelerator``) is imported lazily so that the engine stays importable
on machines that only have torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Accelerator", "__version__"]


def __getattr__(name: str):
    if name == "Accelerator":
        from lowprec.accelerator import Accelerator

        return Accelerator
    raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
