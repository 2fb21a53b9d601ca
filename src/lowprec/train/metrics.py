"""Run metrics: ``metrics.jsonl`` (one JSON object per line) and, optionally, TensorBoard.

Records carry a ``kind``: ``train`` (every ``logging_steps``: loss averaged over the window,
learning rate, gradient norm, tokens/s, peak memory, ``skipped_steps``), ``eval`` (validation
loss), ``generations`` (with ``eval_table_size``, at each evaluation: ``max_new_tokens`` and
``samples``, each ``index``, ``prompt``, ``reference``, ``generated``, ``new_tokens``; a
TensorBoard text too), ``fp8`` (per-layer telemetry), ``fp8_health`` (with ``fp8_health`` / ``fp8_guard``: per layer,
the operands' saturated / underflow fractions, their trends and headroom_bits, the input's
max_to_rms and, sampled, the output's sqnr_db; ``lowprec.fp8.observe.health``), ``fp8_guard`` (one per
guard episode: ``layer``, ``signal``, ``value``, ``moved``) and ``skip`` (one per optimizer step
skipped for NaN/inf loss or gradients, with the running count). Each line is flushed as written, so a killed run leaves a readable file;
on resume, :func:`truncate_after` drops the lines past the checkpoint's step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Iterator, Optional, TextIO, cast

import torch
from lowprec.fp8.observe.guard import Event
from lowprec.fp8.observe.health import health_scalars
from lowprec.train.generations import render_section

__all__ = ["MetricsWriter", "read_metrics", "truncate_after", "peak_memory_mb"]

FILE = "metrics.jsonl"


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def read_metrics(output_dir: str, kind: Optional[str] = None) -> list[dict[str, Any]]:
    path = os.path.join(output_dir, FILE)
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run may be cut
                continue
            if kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out


def truncate_after(output_dir: str, step: int) -> None:
    """Keep only records up to ``step`` (a resumed run rewrites what came after)."""
    kept = [r for r in read_metrics(output_dir) if r.get("step", 0) <= step]
    path = os.path.join(output_dir, FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class MetricsWriter:
    """Writes records on the main process only; no-op elsewhere."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool, append: bool, step: int = 0) -> None:
        """``append``: continue metrics.jsonl as cut back to ``step`` (a resume, a rollback), else a
        fresh file. TensorBoard keeps every events file in ``runs/``: ``purge_step`` hides what an
        earlier run (fresh: all of it) or the cut-off steps wrote there from ``step + 1`` on."""
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._file = open(os.path.join(output_dir, FILE), "a" if append else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "runs"), purge_step=step + 1 if append else 0)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        f = cast(TextIO, self._file)  # opened in __init__ when enabled
        f.write(json.dumps(record) + "\n")
        f.flush()
        if self._tb is not None:
            for tag, value in _scalars(record):
                self._tb.add_scalar(tag, value, record["step"])
            if record["kind"] == "fp8_guard":
                self._tb.add_text(
                    "fp8_guard",
                    Event(**{k: record[k] for k in ("layer", "signal", "value", "step", "moved")}).line(),
                    record["step"],
                )
            if record["kind"] == "generations":
                self._tb.add_text("generations", render_section(record), record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    kind = record["kind"]
    if kind in ("generations", "fp8_guard"):  # text (add_text above)
        return
    if kind == "fp8_health":  # None (not measured) and inf (exact) are not drawn
        yield from health_scalars(record["layers"]).items()
        return
    if kind == "fp8":
        for layer, ops in record["layers"].items():
            for op, stats in ops.items():
                for name, v in stats.items():
                    yield f"fp8/{layer}/{op}/{name}", v
        for module, entry in record.get("experts", {}).items():
            yield f"experts/{module}/max_share", entry["max_share"]
        return
    for k, v in record.items():
        if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{kind}/{k}", v
