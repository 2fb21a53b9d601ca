"""FP8 scaling state stays float32 when the model's dtype changes.

``model.to(torch.float16)``, ``.half()`` and ``.bfloat16()`` cast every floating-point buffer of
every module. A converted layer's buffers are its FP8 scaling state and telemetry (delayed
scaling's amax histories and scales, the last scales, the per-operand statistics), not model
values: cast to float16, a gradient scale above 65504 (an E5M2 scale reaches 1e8 for gradients
of 1e-4) became inf and the input gradient came out all zeros; cast to bf16, the histories and
scales lost their low bits. TransformerEngine and torchao keep this state in float32 too. So a
module with this mixin keeps its float32 buffers float32 through any ``_apply`` that changes
their dtype, and moves them with the rest (the same values on the new device).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Float32State"]


class Float32State:
    """Mixin for a module whose own buffers are all FP8 scaling state (see module docstring)."""

    _buffers: dict[str, torch.Tensor | None]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        kept = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return out
