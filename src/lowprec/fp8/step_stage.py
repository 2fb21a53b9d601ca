"""FP8 scaling state across a skipped optimizer step, and amax spikes.

A step that the non-finite guard skips (``lowprec.utils.nonfinite``) must leave the scaling
state as it found it. But the forward records the input and weight amaxes into the delayed
histories (and advances the step counter, maybe refreshes the scales) before the loss is known,
and the backward records the finite grad_output amaxes of the layers the NaN has not reached.
Holding each record back until the step is accepted would change the numerics (the second
micro-batch of an accumulation window reads the first one's amax, TransformerEngine's rule);
instead :class:`ScalingStage` keeps a copy of every layer's scaling state as it was when the
last step ended (accepted or skipped) and, when a step is skipped, copies it back:
bit-identical, as if the step had never run.

Cost, per optimizer step: one ``torch.stack`` per group of same-shaped buffers (histories,
scales, step counters) over all layers, a few tensor ops for the spike check, no host read on
CUDA (on CPU one read, which is no device synchronisation). A skipped step adds one
``_foreach_copy_``.

Loading a state dict into a layer, or resetting its state, between two optimizer steps makes
the copy stale; such writes bump :func:`lowprec.fp8.state_epoch.state_epoch`, and the copy is taken
again before the next forward (:meth:`ScalingStage.refresh`, called where a forward starts).

**Amax spikes.** With ``amax_compute_algo: max`` one finite outlier (a 1e30 activation) sets
every scale built from that history for ``amax_history_len`` steps: all ordinary values are then
cast ``log2(spike / usual)`` binades below the format's top, where E4M3 keeps few bits or
flushes them to zero. A step is a *spike* for an operand when the largest amax in its history
after the step is more than ``2**SPIKE_LOG2`` (1024) times the largest before it (and that one
was not zero): ten binades, about ten times more than step-to-step drift in training, and the
point where an E4M3 tensor's old maximum is cast within two binades of E4M3's smallest normal.
Each spike is counted per layer and operand (``telemetry()``: ``amax_spikes``) and the first
one of each layer is logged as a warning (on CUDA one step later, read from an asynchronous
copy, or when telemetry is read). Only accepted steps are checked: a skipped step's amaxes
are discarded with the step.

Mixture-of-experts grouped GEMMs (``grouped.py``) keep the same state per expert (a leading
expert dim): it is copied and restored with the rest; their histories are not checked for
spikes (an expert that ran no token in a step recorded nothing, so there is no step-to-step
ratio to read).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

from lowprec.fp8.modules.grouped import Float8GroupedGemm
from lowprec.fp8.modules.linear import OPERANDS, Float8Linear
from lowprec.fp8.state_epoch import bump_state_epoch, state_epoch

__all__ = ["ScalingStage", "SPIKE_LOG2", "spike_counts", "warn_counted"]

logger = logging.getLogger("lowprec")

SPIKE_LOG2 = 10
_RATIO = 2.0**SPIKE_LOG2
_HISTORIES = {f"fp8_amax_history_{o}": i for i, o in enumerate(OPERANDS)}
_STAGE_ATTR = "_lowprec_scaling_stage"  # on each layer: (stage, row) for telemetry (not saved)


class _Group:
    """Same-shaped buffers of several layers, copied with one ``stack``."""

    __slots__ = ("entries", "saved", "index")

    def __init__(self) -> None:
        self.entries: list[tuple[dict, str]] = []  # (the layer's _buffers, buffer name): fresh each read
        self.saved: Optional[torch.Tensor] = None
        self.index: list[int] = []  # histories: layer row * 3 + operand, for the spike counts

    def live(self) -> list[torch.Tensor]:
        return [d[n] for d, n in self.entries]

    def save(self, now: Optional[torch.Tensor] = None) -> None:
        self.saved = torch.stack(self.live()) if now is None else now

    def kept(self) -> torch.Tensor:
        """The copy made by the last :meth:`save` (the stage saves once when it is built)."""
        if self.saved is None:
            raise RuntimeError("a scaling stage group was read before its first save")
        return self.saved

    def restore(self) -> None:
        torch._foreach_copy_(self.live(), list(self.kept().unbind(0)))


class ScalingStage:
    """The scaling state of every :class:`Float8Linear` in ``model`` as of the last step's end.

    ``accept()`` after an optimizer step that ran (checks for spikes, keeps the new state),
    ``discard()`` after one that was skipped (restores the kept state), ``refresh()`` before a
    forward (retakes the copy if a state dict was loaded since). A model without such state
    (current scaling) makes every call a no-op."""

    def __init__(self, model: nn.Module) -> None:
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        layers = [(n, m) for n, m in layers if any(m._buffers.get(b) is not None for b in m.recipe.kind.state_buffers)]
        self.names = [n for n, _ in layers]
        grouped = [m for m in model.modules() if isinstance(m, Float8GroupedGemm)]
        grouped = [m for m in grouped if any(m._buffers.get(b) is not None for b in m.recipe.kind.state_buffers)]
        self.grouped = len(grouped)
        # to find the stage from a wrapper of the model
        self.first: Optional[nn.Module] = layers[0][1] if layers else (grouped[0] if grouped else None)
        self.algos = [m.recipe.amax_compute_algo if m.recipe.kind.keeps_history else None for _, m in layers]
        groups: dict[tuple, _Group] = {}
        for row, (_, m) in enumerate(layers):
            setattr(m, _STAGE_ATTR, (self, row))
            for name in m.recipe.kind.state_buffers:
                t = m._buffers.get(name)
                if t is None:
                    continue
                hist = name in _HISTORIES
                g = groups.setdefault((hist, tuple(t.shape), t.dtype, t.device), _Group())
                g.entries.append((m._buffers, name))
                if hist:
                    g.index.append(row * len(OPERANDS) + _HISTORIES[name])
        for gemm in grouped:  # per-expert state: copied and restored, no spike check (module docstring)
            for name in gemm.recipe.kind.state_buffers:
                t = gemm._buffers.get(name)
                if t is not None:
                    groups.setdefault((False, tuple(t.shape), t.dtype, t.device), _Group()).entries.append(
                        (gemm._buffers, name)
                    )
        self.groups = [g for k, g in groups.items() if not k[0]]
        self.histories = [(g, torch.tensor(g.index, device=k[3])) for k, g in groups.items() if k[0]]
        device = self.histories[0][1].device if self.histories else torch.device("cpu")
        self.counts = torch.zeros(len(layers), len(OPERANDS), device=device)  # spikes per layer, operand
        self.warned: set[int] = set()
        self._pending: list[tuple[list[int], torch.Tensor, torch.cuda.Event]] = []
        self.epoch = -1
        self.save()

    @property
    def empty(self) -> bool:
        return not self.names and not self.grouped

    def save(self) -> None:
        for g in self.groups:
            g.save()
        for g, _ in self.histories:
            g.save()
        self.epoch = state_epoch()

    def refresh(self) -> None:
        """Retake the copy if a layer's state was loaded or reset since it was taken (O(1) otherwise)."""
        if self.epoch != state_epoch():
            self.save()

    @torch.no_grad()
    def discard(self) -> None:
        """The step was skipped: every scaling buffer back to its value when the last step ended."""
        if self.epoch != state_epoch():  # loaded mid-step: the copy predates the loaded state
            logger.warning("lowprec: FP8 scaling state was loaded during a skipped step; it is kept as loaded")
            self.save()
            return
        for g in self.groups:
            g.restore()
        for g, _ in self.histories:
            g.restore()
        bump_state_epoch()  # host mirrors of the state (NVFP4's stream position) are stale now
        self.epoch = state_epoch()  # the kept copy is what the buffers hold again

    @torch.no_grad()
    def accept(self) -> None:
        """The step ran: count the operands whose history took a spike, keep the new state."""
        if self.epoch != state_epoch():
            self.save()
            return
        found = []
        for g, index in self.histories:
            now = torch.stack(g.live())
            new_max, old_max = now.amax(dim=1), g.kept().amax(dim=1)
            spike = (new_max > old_max * _RATIO) & (old_max > 0)
            self.counts.view(-1).index_add_(0, index, spike.to(self.counts.dtype))
            found.append((g.index, torch.stack([spike.to(new_max.dtype), new_max, old_max])))
            g.save(now)
        for g in self.groups:
            g.save()
        self.epoch = state_epoch()
        if found:
            self._report(found)

    def _report(self, found: list[tuple[list[int], torch.Tensor]]) -> None:
        if self.counts.device.type != "cuda":  # a host read, but no device to wait for
            for index, rows in found:
                if bool(rows[0].any()):  # the per-layer lists only when there is something to say
                    self._warn(index, rows.tolist())
            return
        # CUDA: read last step's copy if it has arrived (Event.query never blocks), start this one's
        if self._pending and all(e.query() for _, _, e in self._pending):
            for index, host, _ in self._pending:
                self._warn(index, host.tolist())
            self._pending = []
        if not self._pending:
            for index, rows in found:
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((index, host, event))

    def _warn(self, index: list[int], rows: list[list[float]]) -> None:
        flags, new, old = rows
        for i, flag, a, b in zip(index, flags, new, old):
            row, op = divmod(i, len(OPERANDS))
            if flag and row not in self.warned:
                self.warned.add(row)
                _log_spike(self.names[row], OPERANDS[op], a, b, self.algos[row])

    def warn_counted(self) -> None:
        """Warn for layers whose spikes were counted but not yet logged (a host read of the
        counts: telemetry reads them anyway)."""
        for row, ops in enumerate(self.counts.tolist()):
            for op, n in enumerate(ops):
                if n and row not in self.warned:
                    self.warned.add(row)
                    _log_spike(self.names[row], OPERANDS[op], None, None, self.algos[row])


def _log_spike(layer: str, operand: str, amax: Optional[float], before: Optional[float], algo: Optional[str]) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # every rank sees the same (all-reduced) histories
        return
    what = f"amax {amax:.4g} after a history maximum of {before:.4g}" if amax is not None else "amax spike"
    pinned = (
        "its scale stays set by it for amax_history_len steps (amax_compute_algo: max)"
        if algo == "max"
        else "its scale follows it at the next refresh"
    )
    logger.warning(
        "lowprec: FP8 %s %s: %s (more than 2**%d times; counted as amax_spikes in the FP8 telemetry); %s, "
        "and ordinary values may underflow. Warned once per layer",
        layer or "<model>",
        operand,
        what,
        SPIKE_LOG2,
        pinned,
    )


def spike_counts(layer: nn.Module) -> Optional[list[float]]:
    """The layer's spike count per operand (input, weight, grad_output), or ``None`` when no
    stage watches it (a model not prepared by the Accelerator, or current scaling)."""
    ref = getattr(layer, _STAGE_ATTR, None)
    if ref is None:
        return None
    stage, row = ref
    return stage.counts[row].tolist()


def warn_counted(model: nn.Module) -> None:
    """Log the spikes counted but not logged yet, for every stage watching ``model``'s layers."""
    stages = {id(ref[0]): ref[0] for m in model.modules() if (ref := getattr(m, _STAGE_ATTR, None)) is not None}
    for stage in stages.values():
        stage.warn_counted()
