"""What the backends on other libraries share."""

from __future__ import annotations

from torch import nn

from lowprec.logs import log_once
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.experts import experts_layout

__all__ = ["note_unconverted_conv1d", "warn_if_nothing_converted"]


def note_unconverted_conv1d(model: nn.Module, library: str) -> None:
    """A library that swaps ``nn.Linear`` only leaves transformers' ``Conv1D`` (GPT-2) and fused
    mixture-of-experts modules in high precision; say so once (the native engine converts them)."""
    n = sum(1 for m in model.modules() if is_conv1d(m))
    if n:
        log_once(
            f"lowprec: {library} converts nn.Linear only: {n} transformers Conv1D layer(s) stay in high "
            "precision; the native backend (fp8_backend: native) converts them to FP8"
        )
    n = sum(1 for m in model.modules() if experts_layout(m) is not None)
    if n:  # fused 3-D experts (Mixtral, Qwen3-MoE, ..., builtin:moe-tiny) are not Linear layers
        log_once(
            f"lowprec: {library} converts nn.Linear only: {n} mixture-of-experts module(s) with 3-D expert "
            "weights stay in high precision; the native backend (fp8_backend: native) runs them as grouped FP8 GEMMs"
        )


def warn_if_nothing_converted(converted: int, kept: list[tuple[str, str]], engine: str, fix: str) -> None:
    """``mixed_precision="fp8"`` that converted no layer trains in high precision only: say so once,
    as a warning, with why the layers were kept (``kept``: (layer, reason)) and ``fix``."""
    if converted:
        return
    reasons: dict[str, int] = {}
    for _, reason in kept:
        reasons[reason] = reasons.get(reason, 0) + 1
    why = "; ".join(f"{n} x {r}" for r, n in reasons.items()) if reasons else "the model has no Linear layer"
    log_once(
        f"lowprec: mixed_precision='fp8' converted no layer to FP8 ({engine}; kept in high precision: {why}): "
        f"this model trains without FP8. {fix}"
    )
