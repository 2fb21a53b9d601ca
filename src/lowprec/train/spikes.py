"""Loss spikes: a robust z-score of each optimizer step's training loss over the
last ``loss_spike_window`` steps, and, with ``loss_spike: act``, the PaLM recipe: roll back to the
last checkpoint and skip the batches that produced the spike.

    z = (loss - median(window)) / (1.4826 * MAD(window))       MAD: median absolute deviation

A step is a spike when the window is full and z > ``loss_spike_zscore``; a spike's loss does not
enter the window (it would widen it). ``warn`` logs each spike once and writes a ``loss_spike``
record; ``act`` also restores the latest checkpoint (weights, optimizer, schedule, RNG, FP8
state, data position), skips the micro-batches from it to the spike step inclusive, and goes on;
after ``loss_spike_max_rollbacks`` rollbacks (counted for the life of the process) the next spike
stops the run (exit code 3) in one line.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["robust_z", "SpikeDetector"]


def robust_z(value: float, window: list[float]) -> float:
    """(value - median) / (1.4826 * MAD); inf when the window does not vary and value is above it."""
    med = statistics.median(window)
    mad = statistics.median(abs(v - med) for v in window)
    if mad == 0.0:
        return 0.0 if value <= med else float("inf")
    return (value - med) / (1.4826 * mad)


@dataclass
class SpikeDetector:
    window: int = 50
    zscore: float = 6.0
    losses: deque = field(default_factory=deque)

    def observe(self, loss: float) -> Optional[tuple[float, float]]:
        """(z, median) when ``loss`` is a spike (it is then kept out of the window), else None."""
        if len(self.losses) >= self.window:
            z = robust_z(loss, list(self.losses))
            if z > self.zscore:
                return z, statistics.median(self.losses)
            self.losses.popleft()
        self.losses.append(loss)
        return None
