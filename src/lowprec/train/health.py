"""``fp8_health`` / ``fp8_guard`` in ``lowprec train``: the engine's health probe and guard
(``lowprec.fp8.health``, ``lowprec.fp8.guard``) run at each logging step.

At a logging step the loop already turns FP8 telemetry on; :meth:`RunHealth.arm` also arms the
probe (input max-to-rms every check; the shadow-GEMM SQNR when ``fp8_health_sqnr_every`` steps
have passed since the last one). :meth:`RunHealth.check` turns that step's telemetry into one
``fp8_health`` record (per layer and operand) and, with a guard, ``fp8_guard`` records (one per
episode: layer, signal, value, step, moved). :meth:`state_dict` travels in the checkpoint
(``TrainerState.fp8_guard``), so a resumed run keeps the moves, the streaks and the trends.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import nn

from lowprec.fp8.guard import Guard, Thresholds
from lowprec.fp8.health import HealthProbe, signals
from lowprec.train.outputs import write_conversion_report

__all__ = ["RunHealth", "attach_health"]

logger = logging.getLogger("lowprec")


class RunHealth:
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


def attach_health(run: Any) -> None:
    """fp8_health / fp8_guard (``health.py``): the probe's hooks, and the moves, streaks and
    trends of a resumed checkpoint; a checkpoint's moves are kept even with fp8_guard off now."""
    cfg = run.cfg
    saved = run.state.fp8_guard or {}
    if run.fp8_layers and cfg.fp8_health_on:
        run.health = RunHealth(
            run.inner, cfg.fp8_guard, cfg.fp8_guard_patience, cfg.fp8_health_sqnr_every, cfg.fp8_guard_thresholds or {}
        )
        run.health.load_state_dict(saved)
        run.on_move = lambda: write_conversion_report(run.acc, run.output_dir, tuple(run.health.moves()))
    elif saved.get("moved") and run.fp8_layers:
        Guard(run.inner, mode="act").restore(saved["moved"])
        run.kept_moves = list(saved["moved"])
    moves = run.health.moves() if run.health is not None else run.kept_moves
    if moves and run.main:
        logger.warning(
            "lowprec: fp8_guard: %d layer(s) moved to high precision by the checkpoint's run stay moved: %s",
            len(moves),
            ", ".join(m["layer"] for m in moves),
        )
