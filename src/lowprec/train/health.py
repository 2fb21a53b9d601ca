"""``fp8_health`` / ``fp8_guard`` in ``lowprec train``: the engine's health probe and guard
(``lowprec.fp8.observe.health``, ``lowprec.fp8.observe.guard``) run at each logging step.

At a logging step the loop already turns FP8 telemetry on; :meth:`~lowprec.fp8.observe.guard.HealthMonitor.arm` also arms the
probe (input max-to-rms every check; the shadow-GEMM SQNR when ``fp8_health_sqnr_every`` steps
have passed since the last one). :meth:`~lowprec.fp8.observe.guard.HealthMonitor.check` turns that step's telemetry into one
``fp8_health`` record (per layer and operand) and, with a guard, ``fp8_guard`` records (one per
episode: layer, signal, value, step, moved; with ``fp8_guard_recover_after``, one per move back
too: ``direction: to_fp8``). :meth:`state_dict` travels in the checkpoint
(``TrainerState.fp8_guard``), so a resumed run keeps the moves, moves back, streaks and trends.
"""

from __future__ import annotations

import logging
from typing import Any

from lowprec.fp8.observe.guard import Guard, HealthMonitor, moved_layers
from lowprec.train.outputs import write_conversion_report

__all__ = ["attach_health"]

logger = logging.getLogger("lowprec")


def attach_health(run: Any) -> None:
    """fp8_health / fp8_guard (``health.py``): the probe's hooks, and the moves, streaks and
    trends of a resumed checkpoint; a checkpoint's moves are kept even with fp8_guard off now."""
    cfg = run.cfg
    saved = run.state.fp8_guard or {}
    if run.fp8_layers and cfg.fp8_health_on:
        run.health = HealthMonitor(
            run.inner,
            cfg.fp8_guard,
            cfg.fp8_guard_patience,
            cfg.fp8_health_sqnr_every,
            cfg.fp8_guard_thresholds or {},
            recover_after=cfg.fp8_guard_recover_after,
            scope=cfg.fp8_guard_scope,
        )
        run.health.load_state_dict(saved)
        run.on_move = lambda: write_conversion_report(run.acc, run.output_dir, tuple(run.health.moves()))
    elif saved.get("moved") and run.fp8_layers:
        Guard(run.inner, mode="act").restore(saved["moved"])
        run.kept_moves = list(saved["moved"])
    now = moved_layers(run.health.moves() if run.health is not None else run.kept_moves)
    if now and run.main:
        logger.warning(
            "lowprec: fp8_guard: %d layer(s) moved to high precision by the checkpoint's run stay moved: %s",
            len(now),
            ", ".join(now),
        )
