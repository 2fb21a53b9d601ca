"""The FP8 guard: watch each layer's health signals (``health.py``) and warn or act.

A layer is *unhealthy at a check* when any signal crosses its threshold (:class:`Thresholds`,
defaults below); after ``patience`` unhealthy checks in a row an *episode* starts:

* ``warn``: one log line naming the layer, the signal, its value and the step (once per
  episode; the episode ends at the first healthy check);
* ``act``: the same line, and the layer moves to high precision (``Float8Linear.high_precision``:
  its three GEMMs run in the autocast dtype, bf16). :meth:`Guard.moves` lists the moves (layer,
  step, signal, value) and :meth:`Guard.restore` replays saved ones, so a resumed run keeps them.

A moved layer stays moved unless ``recover_after`` (M, :class:`Thresholds`; default None: never)
is set. Then the guard keeps judging it with the same thresholds on signals measured *on the
side* (``HealthProbe(side=True)``, ``health.py``): a moved layer casts nothing, so its telemetry
is stale and its output is a bf16 GEMM's; the probe casts its x, W and dY as the recipe would, at
the checks it already takes, and computes the statistics and (sampled) the emulated FP8 GEMM's
SQNR from those casts (input max-to-rms is read from x as for any layer). Each operand is scaled
from its own amax: what a current-scaling recipe does every step and what delayed scaling does
on its first step back (below). Measuring the would-be casts is what "FP8 would be fine again"
means, and it costs only the casts the layer stopped making, on moved layers, at logging steps
(cheaper than replaying the layer's FP8 forward, which would also advance its scaling state). A check
counts toward M when no signal crosses and the signal that moved the layer was measured (a
layer moved for its SQNR counts the sampled checks only); any crossing sets the count back to 0.
After M such checks in a row the layer moves back to FP8: one log line, an :class:`Event` with
``direction="to_fp8"`` (carrying the signal and value of the move it undoes) appended to the
moves, and the layer's scaling state reset (``reset_fp8_state``: a delayed-scaling history from
before the move would scale today's tensors; reset, the first step back is exactly tensorwise, as
after conversion). It is
then watched as any FP8 layer, and may be moved again. :meth:`Guard.restore` replays moves and
moves back in order, so a resumed run has each layer in the state it had when saved.

Under several processes each one reads its own data, so their signals differ; the checks agree
(one ``all_gather_object`` per check): a layer crosses where any process saw it cross, so every
process warns and moves the same layers at the same steps, and only rank 0 logs; a moved layer's
check is healthy only where no process saw a crossing, so the moves back agree too.

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

from lowprec.fp8.observe.health import HealthProbe, guarded_layers, signals
from lowprec.fp8.observe.telemetry import grouped_telemetry
from lowprec.guard_moves import (
    GEMMS,
    GUARD_SCOPES,
    TO_BF16,
    TO_FP8,
    gemms_of_signal,
    is_move_back,
    moved_gemms,
    moved_layers,
)
from lowprec.guard_settings import GUARD_MODES, THRESHOLD_NAMES

__all__ = [
    "Thresholds",
    "Event",
    "Guard",
    "HealthMonitor",
    "GUARD_MODES",
    "GUARD_SCOPES",
    "THRESHOLD_NAMES",
    "is_move_back",
    "moved_layers",
]

logger = logging.getLogger("lowprec")


@dataclass(frozen=True)
class Thresholds:
    saturated: float = 1e-3
    underflow: float = 0.02
    max_to_rms: float = 200.0
    sqnr_db: float = 15.0
    patience: int = 3  # K: unhealthy checks in a row before warn / act
    recover_after: Optional[int] = None  # M: healthy checks in a row before act moves a layer back (None: never)

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1 (checks in a row), got {self.patience}")
        if self.recover_after is not None and self.recover_after < 1:
            raise ValueError(f"recover_after must be >= 1 (checks in a row) or None, got {self.recover_after}")


@dataclass(frozen=True)
class Event:
    """One episode's start: ``layer``'s ``signal`` (e.g. ``input.underflow``) was ``value`` at
    ``step``; ``moved`` when the guard moved the layer to high precision. A move back to FP8
    (``recover_after``) is ``moved`` with ``direction`` ``"to_fp8"``, the signal and value of the
    move it undoes and ``checks``, the healthy checks in a row it waited; in ``to_dict`` (records,
    checkpoints) only a move back carries ``direction``, so a run without one writes what it did
    before move-backs existed. ``gemms``: under ``scope="gemm"``, the GEMMs this event moved (or
    moved back), e.g. ``("dgrad", "wgrad")``; empty (and absent from ``to_dict``): the whole
    layer, as every event of ``scope="layer"`` and every checkpoint from before scopes."""

    layer: str
    signal: str
    value: float
    step: int
    moved: bool
    direction: str = TO_BF16
    checks: int = 0
    gemms: tuple = ()

    def line(self) -> str:
        which = f" ({', '.join(self.gemms)})" if self.gemms else ""
        if self.direction == TO_FP8:
            return (
                f"lowprec: fp8_guard: {self.layer}: moved back to FP8{which} at step {self.step}: {self.checks} "
                f"healthy checks in a row measured on the side (it moved for {self.signal} = {self.value:.4g})"
            )
        what = "moved to high precision (bf16)" if self.moved else "FP8 numerics unhealthy"
        if self.moved and self.gemms:
            what = f"moved {', '.join(self.gemms)} to high precision (bf16)"
        return (
            f"lowprec: fp8_guard: {self.layer}: {what} at step {self.step}: {self.signal} = {self.value:.4g} "
            "(threshold crossed on consecutive checks)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {"layer": self.layer, "signal": self.signal, "value": self.value, "step": self.step, "moved": self.moved}
        if self.direction == TO_FP8:
            d.update(direction=TO_FP8, checks=self.checks)
        if self.gemms:
            d["gemms"] = list(self.gemms)
        return d


def signal_value(row: dict[str, Any], signal: str) -> Optional[float]:
    """The value of ``signal`` (as :func:`first_crossing` names it) in a health row, or None."""
    if signal == "sqnr_db":
        return row.get("sqnr_db")
    op, stat = signal.split(".")
    return row.get("max_to_rms") if stat == "max_to_rms" else (row.get(op) or {}).get(stat)


def _crossings(row: dict[str, Any], th: Thresholds):
    """Every signal of one layer's health row that crosses its threshold, in the guard's order."""
    for op in ("input", "weight", "grad_output"):
        st = row.get(op) or {}
        if (st.get("saturated") or 0.0) > th.saturated:
            yield f"{op}.saturated", st["saturated"]
        if (st.get("underflow") or 0.0) > th.underflow:
            yield f"{op}.underflow", st["underflow"]
    if row.get("max_to_rms") is not None and row["max_to_rms"] > th.max_to_rms:
        yield "input.max_to_rms", row["max_to_rms"]
    if row.get("sqnr_db") is not None and row["sqnr_db"] < th.sqnr_db:
        yield "sqnr_db", row["sqnr_db"]


def first_crossing(row: dict[str, Any], th: Thresholds, moved: tuple = ()) -> Optional[tuple[str, float]]:
    """The first signal of one layer's health row that crosses its threshold, or None.
    ``moved``: GEMMs already in high precision; a signal all of whose GEMMs are among them is
    passed over (its operand is no longer cast for them: stale telemetry, nothing left to move)."""
    for sig, value in _crossings(row, th):
        if not set(gemms_of_signal(sig)) <= set(moved):
            return sig, value
    return None


@dataclass
class Guard:
    """``mode``: warn or act. ``check(step, health)`` after each health reading; returns the
    events of this check (already logged): episodes started and, with ``recover_after``, moves
    back."""

    model: nn.Module
    mode: str = "warn"
    thresholds: Thresholds = field(default_factory=Thresholds)
    streak: dict[str, int] = field(default_factory=dict)
    in_episode: set = field(default_factory=set)
    moved: list = field(default_factory=list)  # Event.to_dict() of each move (and move back), in order
    events: list = field(default_factory=list)  # Event.to_dict() of every event (warn and act)
    healthy: dict[str, int] = field(default_factory=dict)  # a moved layer's healthy checks in a row
    scope: str = "layer"  # layer: act moves the whole layer; gemm: only the GEMMs that read the signal's operand

    def __post_init__(self) -> None:
        if self.mode not in ("warn", "act"):
            raise ValueError(f"guard mode must be warn or act, got {self.mode!r}")
        if self.mode != "act" and self.thresholds.recover_after is not None:
            raise ValueError("recover_after moves layers back to FP8, which only the act mode moves: use mode act")
        if self.scope not in GUARD_SCOPES:
            raise ValueError(f"guard scope must be {' or '.join(GUARD_SCOPES)}, got {self.scope!r}")
        self.layers = guarded_layers(self.model)

    def check(self, step: int, health: dict[str, Any]) -> list[Event]:
        """Every process must call this at the same steps (a collective under several processes:
        the layers' crossings are agreed, so every rank warns and moves the same layers)."""
        rows = {name: row for name, row in health.items() if self._judged(name, row)}
        if self.scope == "gemm":
            return self._check_gemms(step, rows)
        hits = _agreed_crossings({name: first_crossing(row, self.thresholds) for name, row in rows.items()})
        events: list[Event] = []
        for name in [n for n in self.layers if n in hits]:  # model order
            if self.layers[name].high_precision:
                ev = self._recover(name, hits[name], rows.get(name, {}), step)
            else:
                ev = self._watch(name, hits[name], step)
            self._emit(ev, events)
        return events

    def _emit(self, ev: Optional[Event], events: list[Event]) -> None:
        """An event of this check: logged (rank 0), returned and kept."""
        if ev is None:
            return
        if _rank() == 0:
            logger.warning(ev.line())
        events.append(ev)
        self.events.append(ev.to_dict())

    def _judged(self, name: str, row: dict[str, Any]) -> bool:
        """An FP8 layer is judged at every check; a moved one (nothing left to act on) only when
        it may move back: ``recover_after`` set, moved by this guard, measured on the side."""
        layer = self.layers.get(name)
        if layer is None:
            return False
        if self.scope == "gemm":  # judged per signal: see _check_gemms
            return True
        if not layer.high_precision:
            return True
        return self.thresholds.recover_after is not None and bool(row.get("side_cast")) and name in self._moves_of()

    def _watch(
        self, name: str, hit: Optional[tuple[str, float]], step: int, moved: Optional[tuple] = None
    ) -> Optional[Event]:
        """An FP8 layer's check: the unhealthy streak, and an episode's start after ``patience``.
        ``moved`` (``scope="gemm"``: the layer's GEMMs in high precision now, moved or by its
        recipe): act moves the GEMMs of the signal's operand that are still in FP8, not the layer."""
        if hit is None:
            self.streak[name] = 0
            self.in_episode.discard(name)
            return None
        self.streak[name] = self.streak.get(name, 0) + 1
        if self.streak[name] < self.thresholds.patience or name in self.in_episode:
            return None
        self.in_episode.add(name)
        if moved is None:
            ev = Event(name, hit[0], float(hit[1]), step, moved=self.mode == "act")
            if ev.moved:
                self.layers[name].high_precision = True
                self.moved.append(ev.to_dict())
            return ev
        layer = self.layers[name]
        # a grouped expert projection moves whole (Float8GroupedGemm.per_gemm_moves)
        wanted = gemms_of_signal(hit[0]) if getattr(layer, "per_gemm_moves", True) else GEMMS
        gemms = tuple(g for g in wanted if g not in moved) if self.mode == "act" else ()
        ev = Event(name, hit[0], float(hit[1]), step, moved=self.mode == "act", gemms=gemms)
        if ev.moved:
            layer.set_high_precision_gemms((*layer.high_precision_gemms, *gemms))
            self.moved.append(ev.to_dict())
        return ev

    def _recover(self, name: str, hit: Optional[tuple[str, float]], row: dict[str, Any], step: int) -> Optional[Event]:
        """A moved layer's check (on side-measured signals): back to FP8 after ``recover_after``
        healthy checks in a row that measured the signal it moved for."""
        move = self._moves_of()[name]
        if hit is not None:
            self.healthy[name] = 0
            return None
        if signal_value(row, move["signal"]) is None:  # e.g. the SQNR, not sampled at this check
            return None
        self.healthy[name] = self.healthy.get(name, 0) + 1
        if self.healthy[name] < (self.thresholds.recover_after or 0):
            return None
        ev = Event(name, move["signal"], move["value"], step, True, TO_FP8, self.healthy.pop(name))
        layer = self.layers[name]
        layer.high_precision = False
        layer.reset_fp8_state()  # the scaling state of before the move does not fit today's tensors
        self.streak[name] = 0
        self.in_episode.discard(name)
        self.moved.append(ev.to_dict())
        return ev

    def _check_gemms(self, step: int, rows: dict[str, dict[str, Any]]) -> list[Event]:
        """``scope="gemm"``: per layer, the first crossing of a signal whose GEMMs are not all
        moved yet (watched as in :meth:`_watch`; an episode moves those GEMMs) and, for a layer
        with moved GEMMs, any crossing at all on a side-measured row (a move back after
        ``recover_after`` healthy checks restores every GEMM moved). One collective per check."""
        now = moved_gemms(self.moved)
        local: dict[Any, Optional[tuple[str, float]]] = {}
        for name, row in rows.items():
            # GEMMs in high precision now (moved, or by the recipe): their operands' signals are stale
            covered = tuple(g for g, hp in self.layers[name].gemm_precision().items() if hp)
            local[(name, "new")] = first_crossing(row, self.thresholds, covered)
            local[(name, "any")] = first_crossing(row, self.thresholds)
        hits = _agreed_crossings(local)
        events: list[Event] = []
        for name in [n for n in self.layers if n in rows]:  # model order
            ev = self._judge_gemms(name, hits[(name, "new")], hits[(name, "any")], rows[name], step, now)
            self._emit(ev, events)
        return events

    def _judge_gemms(
        self,
        name: str,
        new: Optional[tuple[str, float]],
        anyhit: Optional[tuple[str, float]],
        row: dict[str, Any],
        step: int,
        now: dict[str, tuple[str, ...]],
    ) -> Optional[Event]:
        moved = now.get(name, ())  # the GEMMs this guard moved (a move back restores these)
        if new is not None and moved:
            self.healthy[name] = 0  # a crossing on a GEMM still in FP8: the count starts again
        layer = self.layers[name]
        ev = self._watch(name, new, step, tuple(g for g, hp in layer.gemm_precision().items() if hp))
        if ev is not None or new is not None or not moved:
            return ev
        if self.thresholds.recover_after is None or not row.get("side_cast"):
            return None
        if anyhit is not None:
            self.healthy[name] = 0
            return None
        period = self._period_of(name)
        if any(signal_value(row, mv["signal"]) is None for mv in period):  # e.g. an SQNR not sampled now
            return None
        self.healthy[name] = self.healthy.get(name, 0) + 1
        if self.healthy[name] < self.thresholds.recover_after:
            return None
        first = period[0]
        ev = Event(name, first["signal"], first["value"], step, True, TO_FP8, self.healthy.pop(name), tuple(moved))
        layer = self.layers[name]
        layer.high_precision = False
        layer.set_high_precision_gemms(())
        layer.reset_fp8_state()  # as a layer's move back: the first step back is exactly tensorwise
        self.streak[name] = 0
        self.in_episode.discard(name)
        self.moved.append(ev.to_dict())
        return ev

    def _period_of(self, name: str) -> list[dict[str, Any]]:
        """``name``'s moves since its last move back (what a move back now undoes)."""
        period: list[dict[str, Any]] = []
        for mv in self.moved:
            if mv["layer"] == name:
                period = [] if is_move_back(mv) else [*period, mv]
        return period

    def _moves_of(self) -> dict[str, dict[str, Any]]:
        """Each layer this guard has in high precision now: the move that put it there."""
        now = set(moved_layers(self.moved))
        return {mv["layer"]: mv for mv in self.moved if mv["layer"] in now and not is_move_back(mv)}

    def moves(self) -> list[dict[str, Any]]:
        return list(self.moved)

    def restore(self, moves: list[dict[str, Any]]) -> None:
        """Re-apply saved moves and moves back, in order (a resumed run); a layer name this model
        lacks is an error."""
        for mv in moves:
            if mv["layer"] not in self.layers:
                raise ValueError(
                    f"fp8_guard: the checkpoint moved layer {mv['layer']!r}, which this model does not have"
                )
        for mv in moves:
            layer, back = self.layers[mv["layer"]], is_move_back(mv)
            if not mv.get("gemms"):  # a whole layer's move (and any checkpoint from before scopes)
                layer.high_precision = not back
                if back:
                    layer.set_high_precision_gemms(())
                continue
            now = set(layer.high_precision_gemms)
            layer.set_high_precision_gemms(now - set(mv["gemms"]) if back else now | set(mv["gemms"]))
            if back:
                layer.high_precision = False
        self.moved = [dict(m) for m in moves]


class HealthMonitor:
    """The health probe and (``guard`` warn / act) the guard of one model, checked at logging
    steps: :meth:`arm` before the step (input max-to-rms every check; the shadow-GEMM SQNR once
    ``sqnr_every`` steps have passed), :meth:`check` after it, with the step's FP8 telemetry.
    :meth:`state_dict` / :meth:`load_state_dict` carry the moves, streaks and trends into a
    checkpoint. Used by ``lowprec train`` (``train/health.py``) and by transformers'
    ``FP8Callback``. ``recover_after``: the guard's M (:class:`Thresholds`); set, the probe
    measures moved layers on the side. ``scope``: the guard's (:class:`Guard`): ``layer`` moves
    a layer, ``gemm`` only the GEMMs of the unhealthy operand."""

    def __init__(
        self,
        model: nn.Module,
        guard: str,
        patience: int,
        sqnr_every: int,
        thresholds: Optional[dict[str, float]] = None,
        recover_after: Optional[int] = None,
        scope: str = "layer",
    ) -> None:
        # with recover_after, moved layers are measured on the side (what FP8 would do now)
        self.probe = HealthProbe(model, side=recover_after is not None)
        self.layers = guarded_layers(model)  # the Linear layers and the grouped expert projections
        th = Thresholds(patience=patience, recover_after=recover_after, **(thresholds or {}))
        self.guard = None if guard == "off" else Guard(model, mode=guard, thresholds=th, scope=scope)
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
        """The records of this logging step: ``fp8_health``, then one ``fp8_guard`` per event (an
        episode started, a move back)."""
        # grouped expert projections: their worst routed expert's statistics (no probe readings)
        tele = {**tele, **grouped_telemetry(self.probe.model)}
        health = signals(tele, self.layers, self.probe.take(), self.previous)
        self.previous = health
        records: list[dict[str, Any]] = [{"kind": "fp8_health", "step": step, "layers": health}]
        if self.guard is not None:
            records += [{"kind": "fp8_guard", **ev.to_dict()} for ev in self.guard.check(step, health)]
        return records

    def moves(self) -> list[dict[str, Any]]:
        """Every move (and move back) so far, in order (``Event.to_dict``)."""
        return self.kept if self.guard is None else self.guard.moves()

    def moved_layers(self) -> list[str]:
        """The layers in high precision now."""
        return moved_layers(self.moves())

    def state_dict(self) -> dict[str, Any]:
        g = self.guard
        return {
            "previous": self.previous,
            "last_sqnr_step": self.last_sqnr_step,
            "streak": dict(g.streak) if g else {},
            "in_episode": sorted(g.in_episode) if g else [],
            "moved": self.moves(),
            "events": list(g.events) if g else [],
            "healthy": dict(g.healthy) if g else {},
        }

    def clear_moves(self) -> None:
        """Every watched layer back in FP8 (grouped expert projections too), before a checkpoint's
        moves are restored in a process that made moves since (``load_state``, a rollback)."""
        for layer in self.layers.values():
            layer.high_precision = False
            layer.set_high_precision_gemms(())

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
        self.guard.healthy = dict(state.get("healthy", {}))
        self.guard.restore(state.get("moved", []))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agreed_crossings(
    local: dict[Any, Optional[tuple[str, float]]],
) -> dict[Any, Optional[tuple[str, float]]]:
    """Each layer's crossing as every process sees it. One process: its own. Several (each
    reads its own data, so their signals differ): a layer crosses where any process saw it cross,
    reported with the lowest such rank's signal and value, so that all of them warn and move
    the same layers at the same steps (a layer in FP8 on one rank and bf16 on another would make
    the replicas compute differently). One ``all_gather_object`` per check. Keys: layer names
    (``scope="layer"``), or ``(layer, "new" | "any")`` pairs (``scope="gemm"``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    agreed: dict[Any, Optional[tuple[str, float]]] = {}
    for seen in everyone:
        for name, hit in seen.items():
            if agreed.get(name) is None:
                agreed[name] = hit
    return agreed
