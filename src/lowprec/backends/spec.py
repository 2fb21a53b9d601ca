"""What a backend declares about itself (:class:`BackendSpec`), and the registry of them.

Each ``lowprec/backends/<name>.py`` ends with one ``SPEC = BackendSpec(...)``: its name, the
spellings users type, the library it needs, its kwargs class, the FP8 settings it reads and
how it becomes a running :class:`~lowprec.backends.base.Backend` (and, where its library is
missing, which recipe lowprec's engine runs instead). The running backend itself (torch,
``lowprec.fp8``, the backend's library) is in ``lowprec/backends/engines/<name>.py``; a
declaration names what it needs from there with an :class:`Implementation`, which imports it
on the first call (the one place an implementation is loaded). Everything that lists backends (the
registry, ``--fp8_backend``'s help, the wizard, ``lowprec env``, the docs tables, the
"this backend does not read that field" checks) is generated from these declarations, so a
new backend is one module plus one line in :data:`BACKEND_MODULES` (torchtitan keeps its
converters the same way). Torch-free: the launcher imports this.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, cast

from lowprec.catalog import RECIPE_OPTIONS
from lowprec.errors import did_you_mean
from lowprec.backends import availability
from lowprec.logs import log_once
from lowprec.catalog import TE_SWITCHES, recipes_markdown

__all__ = [
    "BackendSpec",
    "BACKEND_MODULES",
    "AUTO",
    "register",
    "unregister",
    "specs",
    "get_spec",
    "lookup",
    "spelling_table",
    "is_available",
    "backends_markdown",
    "docs_page",
    "RECIPE_SETTINGS",
    "ENGINE_SETTINGS",
    "handler_field",
    "recipe_field",
    "spec_or_native",
    "trainer_backends",
    "Implementation",
    "ENGINES",
    "moved_to_engine",
]

AUTO = "auto"  # "pick for me": the native engine, which is always available
# The modules that declare a backend, in the order they are listed to users.
BACKEND_MODULES = ("native", "torchao", "te", "msamp")
# Where the implementations are: lowprec.backends.engines.<name> (these import torch).
ENGINES = "lowprec.backends.engines"
# Launch settings that tune an FP8 scaling recipe (read by the backends that run one).
RECIPE_SETTINGS = (
    "fp8_format",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_margin",
    "fp8_interval",
    "fp8_override_linear_precision",
    "fp8_use_autocast_during_eval",
)
# Recipe options only lowprec's engine has (lowprec.catalog.RECIPE_OPTIONS, accelerate=False).
ENGINE_SETTINGS = tuple(o.setting for o in RECIPE_OPTIONS.values() if not o.accelerate)


@dataclass(frozen=True)
class Implementation:
    """``"<module>:<attribute>"`` of :data:`ENGINES`, standing in for it in a declaration.

    Calling it imports ``lowprec.backends.engines.<module>`` (on the first call: torch,
    ``lowprec.fp8``, ...) and calls the attribute, so a declaration names its implementation
    without importing it: the launcher reads the declarations torch-free. This is the one place
    a backend's implementation is loaded.
    """

    target: str

    def resolve(self) -> Any:
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(f"{ENGINES}.{module}"), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


def moved_to_engine(module: str, names: tuple[str, ...], where: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``names``, which moved from the declaration
    ``where`` to ``lowprec.backends.engines.<module>``: their old import path keeps working and
    loads the implementation only when one of them is asked for."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return Implementation(f"{module}:{name}").resolve()
        raise AttributeError(f"module {where!r} has no attribute {name!r}")

    return __getattr__


@dataclass(frozen=True)
class BackendSpec:
    """One backend, as data.

    ``name`` is the canonical name, the kwargs class's ``backend`` (``Backend.name`` too); ``env_value``
    the spelling of ``ACCELERATE_FP8_BACKEND`` (Accelerate's ``FP8BackendType``); its lower
    case is what ``lowprec launch`` stores. ``reads`` are launch setting names
    (``fp8_format``, ...; see :mod:`lowprec.config.env`). ``create(handler, reason)`` returns the
    running backend on its ``library``; where that is missing, ``fallback(handler, recipe,
    reason)`` returns the native engine running ``native_recipe(handler)`` (:meth:`build`
    decides and logs why).
    """

    env_value: str
    summary: str
    kwargs_class: type
    reads: tuple[str, ...]
    create: Callable[[Any, str], Any]  # (handler, reason) -> the backend running on `library`
    name: str = ""  # kwargs_class.backend; given, it must agree
    aliases: tuple[str, ...] = ()
    library: Optional[str] = None  # import name; None: always available
    distributions: tuple[str, ...] = ()  # pip names to look up for `lowprec env`
    reads_env: tuple[str, ...] = ()  # variables it reads that are no launch setting
    native_recipe: Optional[Callable[[Any], Any]] = None  # handler -> lowprec.fp8.Recipe
    fallback: Optional[Callable[[Any, Any, str], Any]] = None  # (handler, recipe, reason) -> native stand-in
    to_handler_fields: Optional[Callable[[Mapping[str, Any]], dict]] = None  # launch fields -> kwargs
    rejects: Mapping[str, str] = field(default_factory=dict)  # launch field -> why it is refused
    # (recipe name, launch fields) -> (field, why) for a combination it refuses, or None
    check_fields: Optional[Callable[[Optional[str], Mapping[str, Any]], Optional[tuple[str, str]]]] = None
    fp8_formats: tuple[str, ...] = ("HYBRID", "E4M3")  # E5M2 in the forward pass: TE only
    # `lowprec train`'s `fp8_backend: <name>`: the recipes it runs through the backend's own
    # library (empty: the trainer does not offer this backend; the native engine is its default)
    trainer_recipes: tuple[str, ...] = ()
    trainer_handler: Optional[Callable[[str], Any]] = None  # recipe name -> kwargs handler

    def __post_init__(self) -> None:
        declared = getattr(self.kwargs_class, "backend", None)
        if not isinstance(declared, str) or (self.name and self.name != declared):
            raise ValueError(
                f"BackendSpec: {self.kwargs_class.__name__}.backend ({declared!r}) must name the backend "
                f"({self.name or declared!r})"
            )
        object.__setattr__(self, "name", declared)

    def spellings(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.name, self.env_value.lower(), *self.aliases)))

    def available(self) -> bool:
        return self.library is None or availability.module_available(self.library)

    def build(self, handler: Any, why: str) -> Any:
        """The running backend: on the library where it is installed (or none is needed), else
        the native engine running the same recipe, the reason logged once."""
        if self.available():
            return self.create(handler, why if self.library is None else f"{why}; {self.library} installed")

        # a spec with a library declares both (every SPEC does); where one did not, the call still
        # raises the TypeError it always did
        native_recipe = cast(Callable[[Any], Any], self.native_recipe)
        fallback = cast(Callable[[Any, Any, str], Any], self.fallback)
        recipe = native_recipe(handler)
        reason = (
            f"{why}; {self.library} is not installed, so lowprec's native engine runs the same recipe ({recipe.name})"
        )
        log_once(f"lowprec: FP8 backend {self.name!r}: {reason}")
        return fallback(handler, recipe, reason)

    def handler_from_fields(self, fields: Mapping[str, Any]) -> Any:
        """The kwargs handler for launch-style settings (``fp8_margin=2`` -> ``margin=2``)."""
        if self.to_handler_fields is not None:
            return self.kwargs_class(**self.to_handler_fields(fields))
        return self.kwargs_class(**{handler_field(k): v for k, v in fields.items()})


def spec_or_native(value: Any) -> BackendSpec:
    """The backend a launch setting names; ``None``/``auto`` is the native engine."""
    return lookup(value) or get_spec("native")


def trainer_backends() -> dict[str, BackendSpec]:
    """The backends ``lowprec train``'s ``fp8_backend`` offers besides the native engine."""
    return {spec.name: spec for spec in specs() if spec.trainer_recipes}


def handler_field(setting: str) -> str:
    """Launch setting name -> kwargs field name (``fp8_format`` keeps its prefix)."""
    return setting if setting == "fp8_format" else setting.removeprefix("fp8_")


def recipe_field(setting: str) -> str:
    """Launch setting name -> :class:`lowprec.fp8.Recipe` field name."""
    return "use_during_eval" if setting == "fp8_use_autocast_during_eval" else handler_field(setting)


_REGISTRY: dict[str, BackendSpec] = {}
_LOADED = [False]


def _load() -> None:
    if not _LOADED[0]:
        _LOADED[0] = True
        for module in BACKEND_MODULES:
            spec = importlib.import_module(f"lowprec.backends.{module}").SPEC
            _REGISTRY.setdefault(spec.name, spec)


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend (a plug-in or a test's); its spellings must be new."""
    _load()
    taken = {s: other.name for other in _REGISTRY.values() for s in other.spellings()}
    clash = [s for s in spec.spellings() if s in taken and taken[s] != spec.name]
    if clash:
        raise ValueError(f"backend {spec.name!r}: spelling(s) {clash} already name {taken[clash[0]]!r}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def specs() -> tuple[BackendSpec, ...]:
    _load()
    return tuple(_REGISTRY.values())


def spelling_table() -> dict[str, BackendSpec]:
    return {s: spec for spec in specs() for s in spec.spellings()}


def lookup(value: Any, key: str = "fp8_backend") -> Optional[BackendSpec]:
    """The backend a user spelt (any case); ``None`` for no/none/auto/empty."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "no", "none", AUTO):
        return None
    table = spelling_table()
    if text not in table:
        names = ", ".join(s.env_value.lower() for s in specs())
        raise ValueError(f"{key}={value!r} is not known{did_you_mean(text, table)}; use one of {names} (any case)")
    return table[text]


def get_spec(name: str) -> BackendSpec:
    """The spec of a canonical name (or any spelling)."""
    spec = lookup(name)
    if spec is None:
        raise ValueError(f"{name!r} names no backend")
    return spec


def backends_markdown() -> str:
    """The docs table of backends, generated from the declarations."""
    rows = ["| backend | spellings | library | kwargs class | reads |", "| --- | --- | --- | --- | --- |"]
    for s in specs():
        rows.append(
            f"| {s.name} | {', '.join(s.spellings())} | {s.library or '(none: lowprec engine)'} | "
            f"{s.kwargs_class.__name__} | {', '.join(s.reads) or '-'} |"
        )
    return "\n".join(rows)


def docs_page() -> str:
    """``docs/backends.md``: regenerate with ``python -m lowprec.backends.spec > docs/backends.md``."""

    return (
        "# FP8 backends and recipes\n\n"
        "Generated from the declarations (`SPEC` in `src/lowprec/backends/<name>.py`, `RECIPES` in\n"
        "`src/lowprec/catalog.py`) by `python -m lowprec.backends.spec > docs/backends.md`; a test keeps\n"
        "it current. `reads` lists the launch settings (flags `--<name>`, `fp8_config:` keys without the\n"
        "`fp8_` prefix, `ACCELERATE_FP8_*` variables) each backend uses; any other is an error at launch.\n\n"
        "## Backends\n\n" + backends_markdown() + "\n\n"
        "## Recipes (the native engine)\n\n"
        "`reads`: the scaling fields the recipe uses besides `fp8_format`, `override_linear_precision`\n"
        "and `use_during_eval`; setting another one is an error in launch and the trainer's YAML and\n"
        "one warning in the Python API.\n\n" + recipes_markdown() + "\n\n"
        "TransformerEngine's switches name these recipes: "
        + ", ".join(f"`{k}` -> `{v}`" for k, v in TE_SWITCHES.items())
        + " (TE runs its own recipe where it is installed, the native engine this one elsewhere).\n"
    )


def is_available(name: str) -> bool:
    """A backend's library (by any spelling of the backend), or any module by import name."""
    spec = spelling_table().get(str(name).lower())
    if spec is not None:
        return spec.available()
    return availability.module_available(name)


if __name__ == "__main__":
    print(docs_page(), end="")
