"""Resolve the FP8 settings once (:class:`FP8Settings`) and build the backend they name.

Backend: explicit handler > ``ACCELERATE_FP8_BACKEND`` > auto (native). A TE, MS-AMP or
torchao recipe asked for where that library is missing runs the same recipe on lowprec's native
engine (each backend's ``SPEC.create`` decides), and the choice is logged once with its reason.
Nothing here names a backend: the declarations in ``backends/<name>.py`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from lowprec.backends.base import Backend
from lowprec.logs import log_once
from lowprec.backends.spec import BackendSpec, get_spec, lookup, specs
from lowprec.decision import Decision
from lowprec.fp8_kwargs import FP8RecipeKwargs, RecipeKwargs
from lowprec.kwargs_base import FP8_PREFIX, env_flag, env_get, environ
from lowprec.config.env import ENV_VARS, FP8_OVERRIDE_VARS

__all__ = [
    "FP8Settings",
    "resolve_fp8_settings",
    "select_backend",
    "default_handler",
    "native_recipe_for",
    "warn_unread_env",
    "env_vars_read",
]


@dataclass(frozen=True)
class FP8Settings:
    """The resolved FP8 settings of one process: every value with the reason it was chosen.

    ``handler`` is the backend's kwargs object with every field resolved (explicit argument >
    ``ACCELERATE_FP8_*`` variable > the one default); the engine's recipe is built from it
    once, by :func:`select_backend` (``spec.create``)."""

    backend: Decision  # canonical backend name
    handler: RecipeKwargs
    use_during_eval: Decision
    opt_level: Decision
    fsdp_float8_all_gather: Decision
    unread_env: tuple[str, ...] = ()

    @property
    def spec(self) -> BackendSpec:
        return get_spec(self.backend.value)

    def values(self) -> dict[str, Any]:
        """What the settings mean, without the reasons: equal for the same request made through
        any entry point (Accelerator kwargs, environment, launch flags or YAML, trainer YAML)."""
        recipe = self.spec.native_recipe(self.handler) if self.spec.native_recipe is not None else None
        return {
            "backend": self.backend.value,
            "recipe": None if recipe is None else recipe.to_dict(),
            "use_during_eval": self.use_during_eval.value,
            "opt_level": self.opt_level.value,
            "fsdp_float8_all_gather": self.fsdp_float8_all_gather.value,
        }

    def decisions(self) -> dict[str, Decision]:
        return {
            "fp8_backend_requested": self.backend,
            "fp8_use_during_eval": self.use_during_eval,
            "fp8_opt_level": self.opt_level,
            "fp8_fsdp_float8_all_gather": self.fsdp_float8_all_gather,
        }


def default_handler(handler: Optional[RecipeKwargs]) -> tuple[RecipeKwargs, str]:
    """The handler to use and why: the user's, or one built for the env-named backend."""
    if isinstance(handler, FP8RecipeKwargs):
        return handler.to_handler(), f"FP8RecipeKwargs(backend={handler.backend!r}) (deprecated spelling)"
    if handler is not None:
        return handler, f"{type(handler).__name__} passed in kwargs_handlers"
    raw = env_get("ACCELERATE_FP8_BACKEND")
    spec = lookup(raw, "ACCELERATE_FP8_BACKEND")
    if spec is not None:
        return spec.kwargs_class(), f"env ACCELERATE_FP8_BACKEND={raw}"
    return get_spec("native").kwargs_class(), "auto: no FP8 backend asked for; the native engine is always available"


def _field(handler: RecipeKwargs, name: str, default: Any, env: str) -> Decision:
    if not hasattr(handler, name):
        return Decision(default, f"{type(handler).__name__} has no {name}")
    # the handler resolved it: explicit argument > variable > the one default (lowprec.catalog)
    source = f"env {FP8_PREFIX + env}" if env_get(FP8_PREFIX + env) is not None else "the default"
    return Decision(getattr(handler, name), f"{type(handler).__name__}.{name}: the argument if given, else {source}")


def resolve_fp8_settings(handler: Optional[RecipeKwargs] = None) -> FP8Settings:
    """The one resolver: handler (or environment) -> :class:`FP8Settings`; warns once about
    ``ACCELERATE_FP8_*`` variables the chosen backend does not read."""
    handler, why = default_handler(handler)
    spec = get_spec(handler.backend)
    unread = tuple(warn_unread_env(handler))
    for setting, refusal in spec.rejects.items():  # e.g. native + ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=true
        if setting in _env_names() and env_flag(_env_names()[setting]):
            raise ValueError(refusal)
    return FP8Settings(
        backend=Decision(spec.name, why),
        handler=handler,
        use_during_eval=_field(handler, "use_autocast_during_eval", False, "USE_AUTOCAST_DURING_EVAL"),
        opt_level=_field(handler, "opt_level", None, "OPT_LEVEL"),
        fsdp_float8_all_gather=_field(handler, "enable_fsdp_float8_all_gather", False, "ENABLE_FSDP_FLOAT8_ALL_GATHER"),
        unread_env=unread,
    )


def select_backend(handler: Union[None, RecipeKwargs, FP8Settings]) -> Backend:
    """The running backend for a handler (or already resolved settings)."""
    settings = handler if isinstance(handler, FP8Settings) else resolve_fp8_settings(handler)
    return settings.spec.build(settings.handler, settings.backend.reason)


def native_recipe_for(handler: RecipeKwargs):
    """The native engine's recipe equivalent to a handler (the fallback's 'same recipe')."""
    for spec in specs():
        if isinstance(handler, spec.kwargs_class) and spec.native_recipe is not None:
            return spec.native_recipe(handler)
    raise TypeError(f"not an FP8 recipe handler: {type(handler).__name__}")


def _env_names() -> dict[str, str]:
    """launch setting -> the variable that carries it (lowprec.config.env's table)."""

    return {v.field: v.name for v in ENV_VARS}


def env_vars_read(spec: BackendSpec) -> set[str]:
    """The FP8 variables a backend reads (ACCELERATE_FP8_BACKEND is read by the selection)."""

    names = _env_names()
    out = {FP8_PREFIX + "BACKEND", *spec.reads_env}
    for setting in spec.reads:
        out.update(FP8_OVERRIDE_VARS if setting == "fp8_override_linear_precision" else (names[setting],))
    return out


def warn_unread_env(handler: RecipeKwargs) -> list[str]:
    """Log once per variable each ``ACCELERATE_FP8_*`` / ``LOWPREC_FP8_RECIPE`` that is set but
    that the chosen backend's handler never reads (so the user does not believe it took effect).
    Returns the names."""
    spec = get_spec(handler.backend)
    reads = env_vars_read(spec)
    unread = sorted(
        name
        for name, value in environ().items()
        if value != "" and (name.startswith(FP8_PREFIX) or name == "LOWPREC_FP8_RECIPE") and name not in reads
    )
    for name in unread:
        readers = [s for s in specs() if name in env_vars_read(s)]
        hint = (
            "it is read by "
            + ", ".join(f"the {s.name} backend (ACCELERATE_FP8_BACKEND={s.env_value})" for s in readers)
            if readers
            else "it has no effect there"
        )
        log_once(
            f"lowprec: {name} is set but the {handler.backend} FP8 backend ({type(handler).__name__}) "
            f"does not read it; {hint}"
        )
    return unread
