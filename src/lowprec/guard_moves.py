"""The FP8 guard's saved moves (``lowprec.fp8.observe.guard``), read as plain dicts: torch-free, so the
reports and plots that read them from ``metrics.jsonl`` or a checkpoint import no torch.

A move is ``Event.to_dict()``: ``{"layer", "signal", "value", "step", "moved"}``; a move back to
FP8 (``recover_after``) also carries ``"direction": "to_fp8"`` and ``"checks"``. Under
``fp8_guard_scope: gemm`` a move (and a move back) also carries ``"gemms"``, the GEMMs it moved
(``["dgrad", "wgrad"]``); a move without ``"gemms"`` (``scope: layer``, or a checkpoint written
before scopes existed) moved the whole layer.

Which GEMMs a signal moves under ``scope: gemm`` (:data:`SIGNAL_GEMMS`): each operand is read by
two of a Linear's three GEMMs (output = x W^T: fprop; grad_input = dY W: dgrad; grad_weight =
dY^T x: wgrad), so an operand's signal moves the two GEMMs that cast it; the SQNR is measured on
the forward GEMM's output, so it moves fprop.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = [
    "TO_BF16",
    "TO_FP8",
    "GEMMS",
    "GUARD_SCOPES",
    "SIGNAL_GEMMS",
    "gemms_of_signal",
    "is_move_back",
    "moved_gemms",
    "moved_layers",
    "gemms_text",
]

TO_BF16, TO_FP8 = "to_bf16", "to_fp8"
GEMMS = ("fprop", "dgrad", "wgrad")
GUARD_SCOPES = ("layer", "gemm")

# the operand (or measurement) a signal is about -> the GEMMs that read it
SIGNAL_GEMMS = {
    "input": ("fprop", "wgrad"),  # x: saturated, underflow, max_to_rms
    "weight": ("fprop", "dgrad"),  # W: saturated, underflow
    "grad_output": ("dgrad", "wgrad"),  # dY: saturated, underflow
    "sqnr_db": ("fprop",),  # the forward GEMM's output vs its float32 shadow
}


def gemms_of_signal(signal: str) -> tuple[str, ...]:
    """The GEMMs a signal (``input.underflow``, ``sqnr_db``, ...) is about, in GEMM order."""
    return SIGNAL_GEMMS[signal.split(".")[0]]


def is_move_back(ev: Mapping[str, Any]) -> bool:
    """Whether a saved event moved its layer (or GEMMs) back to FP8."""
    return ev.get("direction") == TO_FP8


def moved_gemms(moves: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, ...]]:
    """Each layer with a GEMM in high precision after the saved ``moves`` (and moves back), in
    move order: the GEMMs (all three for a whole-layer move)."""
    now: dict[str, set] = {}
    for mv in moves:
        gemms = set(mv.get("gemms") or GEMMS)  # no "gemms": the whole layer
        have = now.pop(mv["layer"], set())  # a layer moved again goes to the end
        now[mv["layer"]] = have - gemms if is_move_back(mv) else have | gemms
    return {layer: tuple(g for g in GEMMS if g in s) for layer, s in now.items() if s}


def moved_layers(moves: Sequence[Mapping[str, Any]]) -> list[str]:
    """The layers with a GEMM (or all three) in high precision after the saved ``moves`` (and
    moves back), in move order."""
    return list(moved_gemms(moves))


def gemms_text(ev: Mapping[str, Any]) -> str:
    """`` (dgrad, wgrad)`` for a per-GEMM move, ``""`` for a whole layer's: for reports."""
    return f" ({', '.join(ev['gemms'])})" if ev.get("gemms") else ""
