"""Checkpoint directories of a run: ``output_dir/checkpoint-<step>``, newest kept, oldest removed.

The contents come from ``Accelerator.save_state`` (atomic: written to a temporary directory that
replaces the target only when complete); the trainer registers its :class:`TrainerState` and
the data loader with ``register_for_checkpointing`` so the step counter and the data position
travel in the same directory.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["TrainerState", "checkpoint_dir", "list_checkpoints", "latest_checkpoint", "rotate", "resolve_resume"]

_PATTERN = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class TrainerState:
    """What the loop needs besides model/optimizer/scheduler/data: where it is."""

    step: int = 0
    tokens: int = 0
    train_time_s: float = 0.0
    # the settings this run trains with (resume_check.settings_of): saved with every checkpoint,
    # compared on resume; loading keeps this run's own (the saved ones are read before loading)
    settings: dict = field(default_factory=dict)
    # the loop's open logging window and counters (``Loop.window_state``), so that a run resumed
    # mid-window logs what the uninterrupted run logs; absent in older checkpoints (fresh window)
    loop: Optional[dict[str, Any]] = None
    # fp8_health / fp8_guard (``lowprec.fp8.observe.guard.HealthMonitor.state_dict``): moved layers, streaks, trends;
    # None when neither is on (and in older checkpoints)
    fp8_guard: Optional[dict[str, Any]] = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.train_time_s = float(state.get("train_time_s", 0.0))
        self.loop = state.get("loop")
        self.fp8_guard = state.get("fp8_guard")


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints, oldest first (temporary directories ignored)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _PATTERN.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, "lowprec_state.json")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def rotate(output_dir: str, keep: Optional[int]) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints; returns the removed paths."""
    if keep is None:
        return []
    found = list_checkpoints(output_dir)
    removed = [p for _, p in found[: max(0, len(found) - keep)]] if keep > 0 else [p for _, p in found]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def resolve_resume(value: Optional[str], output_dir: str) -> tuple[Optional[str], str]:
    """(checkpoint path or None, reason) for ``resume_from_checkpoint``."""
    if value is None:
        return None, "resume_from_checkpoint not set: fresh run"
    if value == "auto":
        path = latest_checkpoint(output_dir)
        if path is None:
            return None, f"resume_from_checkpoint: auto and no checkpoint in {output_dir}: fresh run"
        return path, f"resume_from_checkpoint: auto: latest checkpoint {path}"
    if not os.path.isfile(os.path.join(value, "lowprec_state.json")):
        raise ValueError(
            f"resume_from_checkpoint: {value!r} is not a checkpoint directory (no lowprec_state.json); "
            f"use auto or a checkpoint-<step> directory of output_dir"
        )
    return value, f"resume_from_checkpoint: {value}"
