"""``LOWPREC_COMPILE_FP8=0``: keep FP8 GEMMs out of ``torch.compile``'s graphs (an escape hatch).

By default ``torch.compile`` traces the FP8 layers' GEMMs like any other code. From the fourth to
the sixth H200 run (torch 2.11, 2026-11-28) this module kept them eager on CUDA by default: a
compiled ``Float8Linear`` gave exact-zero gradients there. The cause was ours to fix: Dynamo
returns a traced autograd.Function's intermediates beside its result, and the GEMM's identity
``.to(out_dtype)`` made the result one of them too, so autograd gave its gradient to the other
slot (``gemm.as_dtype``; guarded on CPU by ``tests/test_fp8_result_identity.py``). With it fixed,
compiled matched eager bit for bit on the H200 (tensorwise, rowwise, delayed, blockwise).

Setting ``LOWPREC_COMPILE_FP8=0`` (on any device) excludes the GEMM part of every FP8 layer
(``Float8Linear`` and its subclasses, the grouped experts, the frozen ``Float8BaseLinear``) from
Dynamo's trace (``torch.compiler.disable``): the rest of the model still compiles, each layer
runs its eager code, at the cost of a graph break per FP8 layer (``fullgraph=True`` refuses it),
logged once. For a torch version whose compiled FP8 misbehaves, until it is fixed here.

A scaling kind may also ask for it on a device (``Kind.compile_break``): the microscaling kinds
(MXFP8, NVFP4) off CUDA, whose casts hold ``float8_e8m0fnu`` / ``float4_e2m1fn_x2`` tensors that
inductor's CPU code generator has no type for (compiling failed with an ``InductorError``);
logged once with that reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ENV", "keeps_eager", "eager_reason", "run_eagerly"]

logger = logging.getLogger("lowprec.fp8")
ENV = "LOWPREC_COMPILE_FP8"
_LOGGED: set[str] = set()


def keeps_eager() -> bool:
    """Whether ``LOWPREC_COMPILE_FP8`` asks to keep the FP8 GEMMs out of compiled graphs (0)."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def eager_reason(kind_reason: str | None) -> str | None:
    """Why this FP8 call runs outside the compiled graph (``LOWPREC_COMPILE_FP8=0``, else the
    scaling kind's ``compile_break`` for the device), or None: it is traced."""
    if keeps_eager():
        return f"{ENV}=0"
    return kind_reason


def _eager_call(why: str, fn: Callable[..., Any], *args: Any) -> Any:
    if why not in _LOGGED:
        _LOGGED.add(why)
        hint = "Unset it to trace them." if why == f"{ENV}=0" else "The rest of the model compiles."
        logger.warning(
            "lowprec: %s: under torch.compile these FP8 layers' GEMMs run eagerly (a graph break per "
            "layer; fullgraph=True refuses it). %s",
            why,
            hint,
        )
    return fn(*args)


_DISABLED: list[Callable[..., Any]] = []


def run_eagerly(fn: Callable[..., Any], *args: Any, why: str = f"{ENV}=0") -> Any:
    """``fn(*args)`` outside the compiled graph (a graph break), logged the first time for each
    reason. Called only while Dynamo traces; ``torch.compiler.disable`` is applied then, not at
    import (it imports ``torch._dynamo``, which imports triton: ``import lowprec.fp8`` stays
    torch-only)."""
    if not _DISABLED:
        _DISABLED.append(torch.compiler.disable(_eager_call, reason="lowprec: FP8 GEMMs kept out of the graph"))
    return _DISABLED[0](why, fn, *args)
