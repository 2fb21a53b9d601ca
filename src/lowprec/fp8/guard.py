"""The FP8 guard: watch each layer's health signals (``health.py``) and warn or act.

A layer is *unhealthy at a check* when any signal crosses its threshold (:class:`Thresholds`,
defaults below); after ``patience`` unhealthy checks in a row an *episode* starts:

* ``warn``: one log line naming the layer, the signal, its value and the step (once per
  episode; the episode ends at the first healthy check);
* ``act``: the same line, and the layer moves to high precision (``Float8Linear.high_precision``:
  its three GEMMs run in the autocast dtype, bf16). A moved layer stays moved; :meth:`Guard.moves`
  lists the moves (layer, step, signal, value) and :meth:`Guard.restore` re-applies saved ones,
  so a resumed run keeps them.

Under several processes each one reads its own data, so their signals differ; the checks agree
(one ``all_gather_object`` per check): a layer crosses where any process saw it cross, so every
process warns and moves the same layers at the same steps, and only rank 0 logs.

Defaults, chosen on the reproducer ``benchmarks/fp8_guard_repro.py`` and the quickstart (the
worst healthy values measured there: underflow 0.0102 once, a dY operand, max_to_rms 80.3,
SQNR 24.9 dB; docs/LOG.md, branch health):

==================  ==========  =============================================================
signal              threshold   why
==================  ==========  =============================================================
saturated           > 1e-3      more than 0.1% of an operand's values clipped at the max
underflow           > 0.02      more than 2% of the non-zero values flushed to zero
max_to_rms (input)  > 200       one channel far above the rest (a growing SwiGLU outlier)
sqnr_db             < 15        the FP8 GEMM output's SQNR vs the float32 shadow GEMM (healthy
                                E4M3 tensorwise layers measure ~25-30 dB)
==================  ==========  =============================================================
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from lowprec.fp8.health import HealthProbe, signals
from lowprec.fp8.linear import Float8Linear

__all__ = ["Thresholds", "Event", "Guard", "HealthMonitor", "GUARD_MODES", "THRESHOLD_NAMES"]

logger = logging.getLogger("lowprec")

GUARD_MODES = ("off", "warn", "act")
THRESHOLD_NAMES = ("saturated", "underflow", "max_to_rms", "sqnr_db")


@dataclass(frozen=True)
class Thresholds:
    saturated: float = 1e-3
    underflow: float = 0.02
    max_to_rms: float = 200.0
    sqnr_db: float = 15.0
    patience: int = 3  # K: unhealthy checks in a row before warn / act

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1 (checks in a row), got {self.patience}")


@dataclass(frozen=True)
class Event:
    """One episode's start: ``layer``'s ``signal`` (e.g. ``input.underflow``) was ``value`` at
    ``step``; ``moved`` when the guard moved the layer to high precision."""

    layer: str
    signal: str
    value: float
    step: int
    moved: bool

    def line(self) -> str:
        what = "moved to high precision (bf16)" if self.moved else "FP8 numerics unhealthy"
        return (
            f"lowprec: fp8_guard: {self.layer}: {what} at step {self.step}: {self.signal} = {self.value:.4g} "
            "(threshold crossed on consecutive checks)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "signal": self.signal, "value": self.value, "step": self.step, "moved": self.moved}


def first_crossing(row: dict[str, Any], th: Thresholds) -> Optional[tuple[str, float]]:
    """The first signal of one layer's health row that crosses its threshold, or None."""
    for op in ("input", "weight", "grad_output"):
        st = row.get(op) or {}
        if (st.get("saturated") or 0.0) > th.saturated:
            return f"{op}.saturated", st["saturated"]
        if (st.get("underflow") or 0.0) > th.underflow:
            return f"{op}.underflow", st["underflow"]
    if row.get("max_to_rms") is not None and row["max_to_rms"] > th.max_to_rms:
        return "input.max_to_rms", row["max_to_rms"]
    if row.get("sqnr_db") is not None and row["sqnr_db"] < th.sqnr_db:
        return "sqnr_db", row["sqnr_db"]
    return None


@dataclass
class Guard:
    """``mode``: warn or act. ``check(step, health)`` after each health reading; returns the
    episodes that started at this check (already logged)."""

    model: nn.Module
    mode: str = "warn"
    thresholds: Thresholds = field(default_factory=Thresholds)
    streak: dict[str, int] = field(default_factory=dict)
    in_episode: set = field(default_factory=set)
    moved: list = field(default_factory=list)  # Event.to_dict() of each move, in order
    events: list = field(default_factory=list)  # Event.to_dict() of every episode (warn and act)

    def __post_init__(self) -> None:
        if self.mode not in ("warn", "act"):
            raise ValueError(f"guard mode must be warn or act, got {self.mode!r}")
        self.layers = {n: m for n, m in self.model.named_modules() if isinstance(m, Float8Linear)}

    def check(self, step: int, health: dict[str, Any]) -> list[Event]:
        """Every process must call this at the same steps (a collective under several processes:
        the layers' crossings are agreed, so every rank warns and moves the same layers)."""
        events = []
        hits = _agreed_crossings(
            {name: first_crossing(row, self.thresholds) for name, row in health.items() if name in self.layers}
        )
        for name in [n for n in self.layers if n in hits]:  # model order
            layer = self.layers[name]
            if layer.high_precision:  # moved already: nothing left to act on
                continue
            hit = hits[name]
            if hit is None:
                self.streak[name] = 0
                self.in_episode.discard(name)
                continue
            self.streak[name] = self.streak.get(name, 0) + 1
            if self.streak[name] < self.thresholds.patience or name in self.in_episode:
                continue
            self.in_episode.add(name)
            ev = Event(name, hit[0], float(hit[1]), step, moved=self.mode == "act")
            if ev.moved:
                layer.high_precision = True
                self.moved.append(ev.to_dict())
            if _rank() == 0:
                logger.warning(ev.line())
            events.append(ev)
            self.events.append(ev.to_dict())
        return events

    def moves(self) -> list[dict[str, Any]]:
        return list(self.moved)

    def restore(self, moves: list[dict[str, Any]]) -> None:
        """Re-apply saved moves (a resumed run); a layer name this model lacks is an error."""
        for mv in moves:
            if mv["layer"] not in self.layers:
                raise ValueError(
                    f"fp8_guard: the checkpoint moved layer {mv['layer']!r}, which this model does not have"
                )
            self.layers[mv["layer"]].high_precision = True
        self.moved = [dict(m) for m in moves]


class HealthMonitor:
    """The health probe and (``guard`` warn / act) the guard of one model, checked at logging
    steps: :meth:`arm` before the step (input max-to-rms every check; the shadow-GEMM SQNR once
    ``sqnr_every`` steps have passed), :meth:`check` after it, with the step's FP8 telemetry.
    :meth:`state_dict` / :meth:`load_state_dict` carry the moves, streaks and trends into a
    checkpoint. Used by ``lowprec train`` (``train/health.py``) and by transformers'
    ``FP8Callback``."""

    def __init__(
        self,
        model: nn.Module,
        guard: str,
        patience: int,
        sqnr_every: int,
        thresholds: Optional[dict[str, float]] = None,
    ) -> None:
        self.probe = HealthProbe(model)
        th = Thresholds(patience=patience, **(thresholds or {}))
        self.guard = None if guard == "off" else Guard(model, mode=guard, thresholds=th)
        self.sqnr_every = sqnr_every
        self.previous: Optional[dict[str, Any]] = None
        self.last_sqnr_step: Optional[int] = None
        self.kept: list[dict[str, Any]] = []  # a checkpoint's moves when this run has no guard

    def arm(self, step: int) -> None:
        """Before optimizer step ``step`` (1-based), a logging step."""
        sqnr = self.last_sqnr_step is None or step - self.last_sqnr_step >= self.sqnr_every
        if sqnr:
            self.last_sqnr_step = step
        self.probe.arm(outliers=True, sqnr=sqnr)

    def check(self, step: int, tele: dict) -> list[dict[str, Any]]:
        """The records of this logging step: ``fp8_health``, then one ``fp8_guard`` per new episode."""
        health = signals(tele, self.probe.layers, self.probe.take(), self.previous)
        self.previous = health
        records: list[dict[str, Any]] = [{"kind": "fp8_health", "step": step, "layers": health}]
        if self.guard is not None:
            records += [{"kind": "fp8_guard", **ev.to_dict()} for ev in self.guard.check(step, health)]
        return records

    def moves(self) -> list[dict[str, Any]]:
        return self.kept if self.guard is None else self.guard.moves()

    def state_dict(self) -> dict[str, Any]:
        g = self.guard
        return {
            "previous": self.previous,
            "last_sqnr_step": self.last_sqnr_step,
            "streak": dict(g.streak) if g else {},
            "in_episode": sorted(g.in_episode) if g else [],
            "moved": self.moves(),
            "events": list(g.events) if g else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous = state.get("previous")
        self.last_sqnr_step = state.get("last_sqnr_step")
        if self.guard is None:
            if state.get("moved"):
                Guard(self.probe.model, mode="act").restore(state["moved"])
                self.kept = list(state["moved"])
            return
        self.guard.streak = dict(state.get("streak", {}))
        self.guard.in_episode = set(state.get("in_episode", []))
        self.guard.events = list(state.get("events", []))
        self.guard.restore(state.get("moved", []))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agreed_crossings(
    local: dict[str, Optional[tuple[str, float]]],
) -> dict[str, Optional[tuple[str, float]]]:
    """Each layer's crossing as every process sees it. One process: its own. Several (each
    reads its own data, so their signals differ): a layer crosses where any process saw it cross,
    reported with the lowest such rank's signal and value, so that all of them warn and move
    the same layers at the same steps (a layer in FP8 on one rank and bf16 on another would make
    the replicas compute differently). One ``all_gather_object`` per check."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    agreed: dict[str, Optional[tuple[str, float]]] = {}
    for seen in everyone:
        for name, hit in seen.items():
            if agreed.get(name) is None:
                agreed[name] = hit
    return agreed
