"""The precisions ``lowprec compare`` runs, by name, and the config keys each one sets.

Names, from highest to lowest precision (the order decides the default baseline)::

    fp32  bf16  fp16  bf16-full
    fp8                      the config's fp8_recipe on lowprec's engine
    fp8-<recipe>             a named recipe on lowprec's engine: fp8-tensorwise, fp8-delayed, ...
    fp8-torchao              the config's recipe through torchao's Float8Linear (fp8_backend: torchao)
    fp8-torchao-<recipe>     a named torchao recipe: fp8-torchao-rowwise, ...

Only the precision keys change between the runs of one comparison; everything else (model,
data, schedule, seed) is the config's.
"""

from __future__ import annotations

from typing import Any, cast

from lowprec.backends.spec import BackendSpec, trainer_backends
from lowprec.catalog import RECIPE_NAMES
from lowprec.errors import did_you_mean
from lowprec.train.config import FP8RecipeSpec, TrainConfig
from lowprec.train.config.compare import FP8_BACKENDS

__all__ = [
    "HIGH_PRECISIONS",
    "FP8_ONLY_OFF",
    "precision_names",
    "precision_overrides",
    "precision_rank",
    "library_backend",
    "is_fp8",
]

# precision -> config keys, highest first
HIGH_PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {"fp8": False, "fp16": None, "bf16": False},
    "bf16": {"fp8": False, "fp16": None, "bf16": True},
    "fp16": {"fp8": False, "fp16": True, "bf16": False},
    "bf16-full": {"fp8": False, "fp16": None, "bf16": "full"},
}


# the keys that watch FP8 layers, as a high-precision run of a comparison gets them
FP8_ONLY_OFF: dict[str, Any] = {
    "fp8_guard": "off",
    "fp8_health": None,
    "fp8_guard_recover_after": None,
    "fp8_guard_scope": "layer",
}


def precision_names() -> list[str]:
    """Every valid name (for messages and ``--help``)."""
    fp8 = ["fp8"] + [f"fp8-{r}" for r in RECIPE_NAMES]
    for name, spec in trainer_backends().items():
        fp8 += [f"fp8-{name}"] + [f"fp8-{name}-{r}" for r in spec.trainer_recipes]
    return list(HIGH_PRECISIONS) + fp8


def _fp8_parts(name: str) -> tuple[str, str | None]:
    """``fp8-torchao-rowwise`` -> (torchao, rowwise); ``fp8`` -> (native, None: the config's)."""
    rest = name[len("fp8") :].lstrip("-")
    for backend in trainer_backends():
        if rest == backend or rest.startswith(backend + "-"):
            return backend, (rest[len(backend) :].lstrip("-") or None)
    return FP8_BACKENDS[0], (rest or None)


def is_fp8(name: str) -> bool:
    return name == "fp8" or name.startswith("fp8-")


def library_backend(name: str) -> BackendSpec | None:
    """The library backend an FP8 precision runs through (``fp8-torchao``), None for the engine."""
    return trainer_backends().get(_fp8_parts(name)[0]) if is_fp8(name) else None


def precision_rank(name: str) -> int:
    """Position in highest-to-lowest order (every FP8 variant shares the last place)."""
    return list(HIGH_PRECISIONS).index(name) if name in HIGH_PRECISIONS else len(HIGH_PRECISIONS)


def precision_overrides(name: str, cfg: TrainConfig) -> dict[str, Any]:
    """The config keys that turn ``cfg`` into the ``name`` run (``ValueError`` for a bad name)."""
    if name in HIGH_PRECISIONS:  # no FP8 layers: nothing for the FP8 health keys to watch
        return {**HIGH_PRECISIONS[name], "fp8_backend": FP8_BACKENDS[0], **FP8_ONLY_OFF}
    names = precision_names()
    if not is_fp8(name):
        raise ValueError(f"--precisions: unknown precision {name!r}{did_you_mean(name, names)}; use {', '.join(names)}")
    backend, recipe = _fp8_parts(name)
    library = trainer_backends().get(backend)
    valid = library.trainer_recipes if library else RECIPE_NAMES
    if recipe is not None and recipe not in valid:
        raise ValueError(f"--precisions: unknown precision {name!r}{did_you_mean(name, names)}; use {', '.join(names)}")
    keys: dict[str, Any] = {"fp8": True, "fp16": None, "fp8_backend": backend}
    # FP8 keeps the config's bf16 choice for the non-FP8 ops (auto by default)
    keys["bf16"] = cfg.bf16 if cfg.bf16 is not False else "auto"
    spec = cast(FP8RecipeSpec, cfg.fp8_recipe)  # validated: the schema made a name a spec
    own = spec.name
    if recipe is None or recipe == own:  # the config's recipe, with its field overrides
        keys["fp8_recipe"] = {"name": own, **spec.overrides}
    else:
        keys["fp8_recipe"] = recipe
    if library and (recipe or own) not in library.trainer_recipes:
        raise ValueError(
            f"--precisions {name}: {backend} has no {own!r} recipe (the config's fp8_recipe); "
            f"name one: {', '.join(f'fp8-{backend}-{r}' for r in library.trainer_recipes)}"
        )
    return keys
