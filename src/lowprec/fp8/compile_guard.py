"""FP8 GEMMs on CUDA run outside ``torch.compile``'s graphs until compiled training is proven there.

On the fourth H200 run (torch 2.11, 2026-11-28) a compiled ``Float8Linear`` gave the eager
forward but an input gradient of exact zeros, for tensorwise, rowwise and delayed scaling
(``tests/test_gpu_fp8.py::test_compiled_matches_eager_on_cuda``); a compiled 4-layer model
trained to loss 7.2 where eager FP8 and bf16 reached 0.005. The same compiled layer matches
eager on CPU, with the GPU's code path emulated too (the Triton kernels in the interpreter,
``torch._scaled_mm``), so the fault is in what only a GPU runs; the cause is not found yet.

So, on CUDA, the GEMM part of an FP8 layer (``Float8Linear`` and its subclasses, the grouped
experts, the frozen ``Float8BaseLinear``) is excluded from Dynamo's trace
(``torch.compiler.disable``): ``torch.compile(model)`` still compiles everything around it
(attention, norms, activations) and the layer runs its eager code, which the GPU runs check. It
costs a graph break per FP8 layer (``fullgraph=True`` refuses it), logged once.
``LOWPREC_COMPILE_FP8=1`` traces the GEMMs anyway (to diagnose the fault). CPU and meta
tensors are traced as before: compiled matches eager there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ENV", "traced", "run_eagerly"]

logger = logging.getLogger("lowprec.fp8")
ENV = "LOWPREC_COMPILE_FP8"
_LOGGED: list[bool] = [False]


def traced(x: torch.Tensor) -> bool:
    """Whether a compiled graph may hold the FP8 GEMMs of a layer called on ``x``."""
    return x.device.type != "cuda" or os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _eager_call(fn: Callable[..., Any], *args: Any) -> Any:
    if not _LOGGED[0]:
        _LOGGED[0] = True
        logger.warning(
            "lowprec: under torch.compile on CUDA the FP8 layers' GEMMs run eagerly (a graph break per "
            "layer; the rest of the model compiles): compiled FP8 backward gave zero input gradients on "
            "the H200 (torch 2.11) and is not trusted there yet. %s=1 traces them anyway.",
            ENV,
        )
    return fn(*args)


_DISABLED: list[Callable[..., Any]] = []


def run_eagerly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` outside the compiled graph (a graph break), logged the first time. Called
    only while Dynamo traces; ``torch.compiler.disable`` is applied then, not at import (it
    imports ``torch._dynamo``, which imports triton: ``import lowprec.fp8`` stays torch-only)."""
    if not _DISABLED:
        _DISABLED.append(torch.compiler.disable(_eager_call))
    return _DISABLED[0](fn, *args)
