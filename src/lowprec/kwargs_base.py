"""What every kwargs handler shares: the one reader of the environment, the value parsers with
the key named in their errors, and the two handler bases (:class:`KwargsHandler`, Accelerate's
contract; :class:`ForwardEveryField`). :mod:`lowprec.kwargs` (the Accelerate-named handlers) and
:mod:`lowprec.fp8_kwargs` (the FP8 recipe handlers) both build on it, and ``lowprec.kwargs``
re-exports the FP8 ones, so neither imports the other's module while it loads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional, cast

from lowprec.config import values as V
from lowprec.config.env import clear_environment

__all__ = [
    "FP8_PREFIX",
    "environ",
    "env_get",
    "env_flag",
    "env_int",
    "parse_bool",
    "parse_override_linear_precision",
    "KwargsHandler",
    "ForwardEveryField",
]

FP8_PREFIX = "ACCELERATE_FP8_"


# --------------------------------------------------------------------------- environment
def environ() -> Mapping[str, str]:
    """The one source of environment values for lowprec's Accelerate surface."""
    return os.environ


def env_get(name: str) -> Optional[str]:
    value = environ().get(name)
    return None if value is None or value == "" else value


def env_int(name: str, default: int) -> int:
    """An integer variable; a bad value is an error naming the variable."""
    raw = env_get(name)
    return default if raw is None else _int(f"environment variable {name}")(raw)


def parse_bool(value: Any, key: str) -> bool:
    """``y/yes/t/true/on/1`` and ``n/no/f/false/off/0`` (any case), as Accelerate's str_to_bool
    (:func:`lowprec.config.values.parse_bool`, with the key named in the error)."""

    try:
        return V.parse_bool(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a boolean; use true or false") from None


def env_flag(name: str, default: bool = False) -> bool:
    value = env_get(name)
    return default if value is None else parse_bool(value, name)


def parse_override_linear_precision(value: Any, key: str = "override_linear_precision") -> tuple:
    """Three booleans (fprop, dgrad, wgrad) from a tuple, a list or a string such as
    ``"(false, false, true)"`` (:func:`lowprec.config.values.parse_override_linear_precision`;
    Accelerate indexed the string per character, reference section 3.4, bug 6)."""

    try:
        return V.parse_override_linear_precision(value)
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None


def _int(key: str) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {value!r}") from None

    return convert


def _alias(obj: Any, name: str, alias: str, value: Any) -> None:
    """Fold a wizard-spelt alias (``amax_history_length``) into the real field."""
    if value is None:
        return
    if getattr(obj, name) is not None and getattr(obj, name) != value:
        raise ValueError(f"both {name}= and its alias {alias}= were given; keep {name}=")
    object.__setattr__(obj, name, value)


# --------------------------------------------------------------------------- base
class KwargsHandler:
    """Base of every handler, as in Accelerate: not a dataclass itself, so a script's own
    ``@dataclass`` subclass (frozen or not) works.

    ``to_kwargs()`` keeps Accelerate's contract: the fields that differ from a default instance
    built with the environment cleared. lowprec's handlers that configure another library
    (``GradScalerKwargs``, the FP8 recipes) derive from :class:`ForwardEveryField` instead.
    """

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.fields(cast(Any, self))  # the handler classes are dataclasses; this base is not
        return {f.name: getattr(self, f.name) for f in fields if not f.name.startswith("_")}

    def to_kwargs(self) -> dict[str, Any]:
        with clear_environment():
            default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


class ForwardEveryField(KwargsHandler):
    """``to_kwargs()`` returns every resolved field: forwarding only non-defaults lets the
    library's own defaults win silently (Accelerate's TE ``amax_compute_algo='max'`` against
    its documented ``'most_recent'``, reference section 8)."""

    def to_kwargs(self) -> dict[str, Any]:
        return self.to_dict()
