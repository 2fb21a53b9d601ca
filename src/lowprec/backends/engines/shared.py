"""What the backends on other libraries share."""

from __future__ import annotations

from torch import nn

from lowprec.logs import log_once
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.experts import experts_layout

__all__ = ["note_unconverted_conv1d"]


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
