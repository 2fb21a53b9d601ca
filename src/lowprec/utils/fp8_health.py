"""The FP8 guard in a script on the Accelerate API: ``NativeRecipeKwargs(fp8_guard=...)``.

When the Accelerator prepares a model the native engine converted, and the handler asks for
health signals (``fp8_health``, or any ``fp8_guard`` but ``off``), :class:`HealthHooks` builds a
:class:`~lowprec.fp8.observe.guard.HealthMonitor` for it (``lowprec train``'s probe and guard) and drives
it from the prepared optimizer's step, as the trainer drives it from its logging steps:

* a check every ``fp8_health_every`` optimizer steps that ran (steps the optimizer skipped,
  gradient-accumulation micro-steps and non-finite steps alike, are not steps: they neither count
  nor check);
* before the forward of a step that will be checked: telemetry on for the model's FP8 layers and
  :meth:`~lowprec.fp8.observe.guard.HealthMonitor.arm` (input max-to-rms; the shadow-GEMM SQNR every
  ``fp8_health_sqnr_every`` steps). There is no "step begins" call in an Accelerate script, so
  this happens at the end of the step before (and at ``prepare`` for step 1): the first check is
  armed like every other. A skipped step leaves it armed for the step that runs instead;
* after the optimizer step (and after the backend's own hook: FP8 scaling state kept, amaxes
  agreed): :meth:`~lowprec.fp8.observe.guard.HealthMonitor.check` with that step's telemetry, then
  telemetry off. Under several processes the check agrees crossings across ranks (one
  ``all_gather_object``), so every process moves the same layers at the same step.

Records: the guard logs each episode (warn / act) and each move back as one ``lowprec`` logger
line on rank 0, as in the trainer; with trackers initialized, each check is also written through
``accelerator.log`` (``fp8_health/<layer>/<signal>`` scalars, ``fp8_guard_moved_layers``, and a
``fp8_guard`` text line per event). :meth:`HealthHooks.state_dicts` and
:meth:`HealthHooks.load_state_dicts` carry the optimizer-step count and the monitor's state
(moves, streaks, trends) through ``save_state`` / ``load_state`` as JSON
(``fp8_health_{i}.json``, ``lowprec.checkpoint.state``), so a resumed script keeps moved layers
in bf16 and continues exactly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from torch import nn

from lowprec.fp8.observe.guard import Event, Guard, HealthMonitor, moved_layers
from lowprec.fp8.observe.health import health_scalars
from lowprec.fp8.convert import has_fp8_layers
from lowprec.fp8.observe.telemetry import disable as disable_telemetry
from lowprec.fp8.observe.telemetry import enable as enable_telemetry
from lowprec.fp8.observe.telemetry import telemetry

__all__ = ["ModelHealth", "HealthHooks"]

logger = logging.getLogger("lowprec")


class ModelHealth:
    """One converted model's monitor and the optimizer steps it has seen. ``records`` holds the
    last check's records (``kind: fp8_health``, then one ``kind: fp8_guard`` per event)."""

    def __init__(self, model: nn.Module, handler: Any, log: Callable[[dict, int], None]) -> None:
        self.model = model
        self.every = handler.fp8_health_every
        self.monitor = HealthMonitor(
            model,
            handler.fp8_guard,
            handler.fp8_guard_patience,
            handler.fp8_health_sqnr_every,
            dict(handler.fp8_guard_thresholds or {}),
            recover_after=handler.fp8_guard_recover_after,
            scope=handler.fp8_guard_scope,
        )
        self.steps = 0  # optimizer steps that ran
        self.driven = False  # an optimizer's step drives it (the Accelerator hooks one)
        self.records: list[dict[str, Any]] = []
        self._log = log
        self._arm_next()

    def _arm_next(self) -> None:
        """Telemetry and the probe for the next step, when it is a checked one."""
        step = self.steps + 1
        if step % self.every == 0:
            enable_telemetry(self.model)
            self.monitor.arm(step)

    def after_step(self) -> None:
        """The optimizer stepped: count it; at a checked step, check (a collective under several
        processes) and report."""
        self.steps += 1
        if self.steps % self.every == 0:
            tele = telemetry(self.model)
            disable_telemetry(self.model)
            self.records = self.monitor.check(self.steps, tele)
            self._report()
        self._arm_next()

    def _report(self) -> None:
        values: dict[str, Any] = {}
        for rec in self.records:
            if rec["kind"] == "fp8_health":
                values.update(health_scalars(rec["layers"]))
            else:  # one text line per event, as the logger wrote it
                ev = Event(**{k: v for k, v in rec.items() if k != "kind"})
                values[f"fp8_guard/{ev.layer}"] = ev.line()
        values["fp8_guard_moved_layers"] = len(self.monitor.moved_layers())
        self._log(values, self.steps)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "every": self.every, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        self.monitor.clear_moves()  # the checkpoint's moves, not the ones made since
        self.monitor.load_state_dict(state.get("monitor", {}))
        disable_telemetry(self.model)  # armed for the step count of before: armed again below
        self.monitor.probe.take()
        self._arm_next()


class HealthHooks:
    """The Accelerator's :class:`ModelHealth` per converted model (keyed by the unwrapped model),
    and the moves of a checkpoint loaded into a model that this run does not watch (kept, and
    saved again, as the trainer keeps them with ``fp8_guard: off``)."""

    def __init__(self) -> None:
        self.by_model: dict[int, ModelHealth] = {}
        self.kept: dict[int, list[dict[str, Any]]] = {}  # id(model) -> a checkpoint's moves

    def attach(self, model: nn.Module, handler: Any, log: Callable[[dict, int], None]) -> Optional[ModelHealth]:
        """A monitor for ``model`` (converted by the native engine) when ``handler`` asks for health."""
        if not getattr(handler, "fp8_health_on", False) or id(model) in self.by_model:
            return self.by_model.get(id(model))
        if not has_fp8_layers(model):  # FP8 experts (grouped GEMMs) are watched too
            logger.warning(
                "lowprec: fp8_guard / fp8_health: the model has no FP8 layer (every Linear and experts module "
                "was kept in high precision); nothing is watched"
            )
            return None
        self.by_model[id(model)] = health = ModelHealth(model, handler, log)
        return health

    def of(self, model: nn.Module) -> Optional[ModelHealth]:
        return self.by_model.get(id(model))

    def after_step(self, model: nn.Module, backend_after_step: Callable[[], None]) -> Callable[[], None]:
        """What runs after an optimizer step of ``model`` that ran: the backend's hook (the step's
        FP8 scaling state kept, amaxes agreed), then, for the first optimizer of a watched model
        only (a second one would count the steps twice), the health check."""
        health = self.by_model.get(id(model))
        if health is None or health.driven:
            return backend_after_step
        health.driven = True

        def step_and_check() -> None:
            backend_after_step()
            health.after_step()

        return step_and_check

    def state_dict(self, model: nn.Module) -> Optional[dict[str, Any]]:
        """What ``save_state`` writes for ``model`` (None: nothing to write)."""
        health = self.by_model.get(id(model))
        if health is not None:
            return health.state_dict()
        return {"monitor": {"moved": self.kept[id(model)]}} if self.kept.get(id(model)) else None

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], main: bool = True) -> None:
        """A checkpoint's state for ``model``; its moves are re-applied even when this run does
        not watch the model (the layers were trained in bf16 from then on). ``main``: this
        process logs."""
        health = self.by_model.get(id(model))
        moves = list(state.get("monitor", {}).get("moved", []))
        if health is not None:
            health.load_state_dict(state)
        elif moves:
            Guard(model, mode="act").restore(moves)
            self.kept[id(model)] = moves
        now = moved_layers(moves)
        if now and main:
            logger.warning(
                "lowprec: fp8_guard: %d layer(s) moved to high precision by the checkpoint's run stay moved: %s",
                len(now),
                ", ".join(now),
            )

    def clear(self) -> None:
        self.by_model.clear()
        self.kept.clear()
