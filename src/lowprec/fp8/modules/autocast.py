"""``fp8.autocast``: an override of FP8 for a region; conversion is the switch.

A converted layer (``Float8Linear``) runs its GEMMs in FP8 wherever it runs, in training mode,
and in eval mode only if its recipe says ``use_during_eval`` (TransformerEngine's behaviour:
evaluation metrics are usually better in high precision). That is torchao's convention, and the
one a model handed to code that knows nothing of lowprec needs (``transformers.Trainer``, TRL,
a plain loop): before, FP8 ran only inside ``autocast()``, and such a model trained silently in
full precision. ``autocast(enabled=False)`` turns FP8 off for its body: the layer is then a
plain ``nn.Linear`` (which ``torch.autocast`` still runs in bf16 if active).

Regions nest: the innermost decides. ``autocast(enabled=False)`` inside an FP8 region turns
FP8 off for its body; ``autocast(recipe=...)`` overrides every layer's recipe for its body (any
recipe, except delayed scaling on a layer converted without an amax history);
``autocast(use_during_eval=True/False)`` overrides the recipes' ``use_during_eval``. An ``autocast`` object can be
entered again, and re-entered recursively; each exit restores the state its enter saw.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lowprec.fp8.recipes import Recipe, as_recipe

__all__ = [
    "autocast",
    "fp8_enabled",
    "current_recipe_override",
    "current_eval_override",
    "recomputing",
    "recomputing_unmarked",
    "replay_context",
    "torch_autocast_dtype",
    "torch_autocast_off",
]


@dataclass
class _State:
    # None: no region entered, the converted layers decide (FP8 on); True/False: a region's choice
    enabled: bool | None = None
    recipe: Recipe | None = None
    use_during_eval: bool | None = None
    recomputing: bool = False  # inside an activation-checkpoint recompute (fp8.checkpoint)


# One module-level object: torch.compile guards on its attributes, so entering or leaving a
# region re-specialises a compiled model instead of breaking its graph.
_STATE = _State()


def fp8_enabled() -> bool:
    """False only inside an ``autocast(enabled=False)`` region (the innermost region decides);
    outside every region converted layers run FP8, so this is True."""
    return _STATE.enabled is not False


def current_recipe_override() -> Recipe | None:
    return _STATE.recipe


def recomputing() -> bool:
    """True while an activation checkpoint re-runs a forward for backward (``fp8.checkpoint``,
    or any ``torch.utils.checkpoint``: see :func:`recomputing_unmarked`): layers must reproduce
    the first forward (same scales) and must not update their scaling state a second time."""
    return _STATE.recomputing or recomputing_unmarked()


def recomputing_unmarked() -> bool:
    """True for a forward that runs while autograd's engine runs a backward, outside a replayed
    region: a recompute by ``torch.utils.checkpoint`` without our ``context_fn``, either
    ``use_reentrant`` (transformers' ``gradient_checkpointing_enable``, TRL's default). torch's
    own non-reentrant checkpoint tells a recompute the same way (``_current_graph_task_id``).
    Nothing says which FP8 region the first forward ran in, so each layer replays its own last
    decision (``Float8Linear._active_recipe``). Not under ``torch.compile``, whose compiled
    backward does not re-run module forwards."""
    if _STATE.recomputing or torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _Replay:
    """The FP8 region a checkpointed forward ran in, re-entered for its recompute."""

    def __init__(self, enabled: bool, recipe: Recipe | None, use_during_eval: bool | None) -> None:
        self.state = (enabled, recipe, use_during_eval, True)
        self._saved: list = []

    def __enter__(self) -> "_Replay":
        self._saved.append((_STATE.enabled, _STATE.recipe, _STATE.use_during_eval, _STATE.recomputing))
        _STATE.enabled, _STATE.recipe, _STATE.use_during_eval, _STATE.recomputing = self.state
        return self

    def __exit__(self, *exc: object) -> None:
        _STATE.enabled, _STATE.recipe, _STATE.use_during_eval, _STATE.recomputing = self._saved.pop()


def replay_context():
    """(forward context, recompute context) for ``torch.utils.checkpoint``'s ``context_fn``:
    the recompute runs in the FP8 region of the original forward, wherever backward is called."""
    import contextlib

    return contextlib.nullcontext(), _Replay(_STATE.enabled, _STATE.recipe, _STATE.use_during_eval)


def current_eval_override() -> bool | None:
    """``use_during_eval`` of the innermost region that set it, else None (the recipe decides)."""
    return _STATE.use_during_eval


class autocast:  # noqa: N801 - a context manager named like torch.autocast
    """Context manager: ``with fp8.autocast(): loss = model(x)``.

    Args:
        enabled: FP8 on (True) or off (False) for the body.
        recipe: optional recipe (a :class:`Recipe` or a name, as ``convert`` takes) that
            overrides each layer's own for the body.
        use_during_eval: True/False overrides the recipes' ``use_during_eval`` for the body;
            None (default) leaves it to them.
    """

    def __init__(
        self, enabled: bool = True, recipe: Recipe | str | None = None, use_during_eval: bool | None = None
    ) -> None:
        if recipe is not None:
            recipe = as_recipe(recipe, "fp8.autocast")
        self.enabled = bool(enabled)
        self.recipe = recipe
        self.use_during_eval = use_during_eval
        self._saved: list[tuple[bool | None, Recipe | None, bool | None]] = []

    def __enter__(self) -> "autocast":
        self._saved.append((_STATE.enabled, _STATE.recipe, _STATE.use_during_eval))
        _STATE.enabled = self.enabled
        if self.recipe is not None:
            _STATE.recipe = self.recipe
        if self.use_during_eval is not None:
            _STATE.use_during_eval = self.use_during_eval
        return self

    def __exit__(self, *exc: object) -> None:
        _STATE.enabled, _STATE.recipe, _STATE.use_during_eval = self._saved.pop()

    def __call__(self, fn):
        """Use as a decorator: the function body runs inside this region."""
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(self.enabled, self.recipe, self.use_during_eval):
                return fn(*args, **kwargs)

        return wrapper


# --- torch.autocast on any device ----------------------------------------------------------
# torch.autocast raises for device types it does not know (meta, which fp8.trace_as traces on,
# and out-of-tree backends); there is no autocast state to read or turn off on those.
# Asked once per device type, outside any graph: Dynamo in torch 2.11 cannot trace
# torch._C._is_autocast_available (a graph break in every Float8Linear forward), while a dict
# read traces as a constant. The common types are filled at import.
_AUTOCAST_AVAILABLE: dict[str, bool] = {}


def autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available(device_type)``, cached per device type."""
    ok = _AUTOCAST_AVAILABLE.get(device_type)
    if ok is None:
        ok = _AUTOCAST_AVAILABLE[device_type] = bool(torch.amp.is_autocast_available(device_type))
    return ok


for _type in ("cpu", "cuda", "meta", "xpu", "mps", "hpu"):
    try:
        autocast_available(_type)
    except (RuntimeError, ValueError):  # a device type this build does not know
        pass


def torch_autocast_dtype(device_type: str, default):
    """The ``torch.autocast`` dtype active for ``device_type``, else ``default``."""
    if autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def torch_autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``, or a no-op where autocast does not exist."""
    if autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()
