"""The FP8 guard's saved moves (``lowprec.fp8.guard``), read as plain dicts: torch-free, so the
reports and plots that read them from ``metrics.jsonl`` or a checkpoint import no torch.

A move is ``Event.to_dict()``: ``{"layer", "signal", "value", "step", "moved"}``; a move back to
FP8 (``recover_after``) also carries ``"direction": "to_fp8"`` and ``"checks"``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["TO_BF16", "TO_FP8", "is_move_back", "moved_layers"]

TO_BF16, TO_FP8 = "to_bf16", "to_fp8"


def is_move_back(ev: Mapping[str, Any]) -> bool:
    """Whether a saved event moved its layer back to FP8."""
    return ev.get("direction") == TO_FP8


def moved_layers(moves: Sequence[Mapping[str, Any]]) -> list[str]:
    """The layers in high precision after the saved ``moves`` (and moves back), in move order."""
    now: dict[str, bool] = {}
    for mv in moves:
        now.pop(mv["layer"], None)  # a layer moved again goes to the end
        now[mv["layer"]] = not is_move_back(mv)
    return [layer for layer, moved in now.items() if moved]
