"""A counter of writes to FP8 scaling state from outside a training step.

Any load, reset or restore of a layer's scaling buffers moves it on, so a copy of that state
(``step_stage.py``'s kept copy, NVFP4's host mirror of its rounding-stream position) knows it
is stale without reading every layer's buffers (which would wait for the GPU).
"""

from __future__ import annotations

__all__ = ["state_epoch", "bump_state_epoch"]

_EPOCH = [0]


def state_epoch() -> int:
    """The current count; compare with the one a copy was taken at."""
    return _EPOCH[0]


def bump_state_epoch() -> None:
    """Say that some module's scaling state was written from outside a step (load, reset, restore)."""
    _EPOCH[0] += 1
