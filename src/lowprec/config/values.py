"""Parsers for single launch values, shared by CLI flags, the YAML schema and env vars.

Each parser takes what a user may write (any case, the spellings Accelerate and its wizard
use) and returns the one canonical value, or raises ``ValueError`` with a message that lists
the valid choices (and the closest one). The caller prefixes the flag, key or env var name.
Pure functions, no torch: the launcher must start fast.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

from lowprec.catalog import FIELD_MINIMUMS, MXFP8_UNSUPPORTED, RECIPE_NAMES
from lowprec.errors import did_you_mean

__all__ = [
    "MIXED_PRECISIONS",
    "FP8_BACKENDS",
    "FP8_RECIPES",
    "FP8_FORMATS",
    "AMAX_COMPUTE_ALGOS",
    "OPT_LEVELS",
    "FP8_FALLBACKS",
    "DYNAMO_BACKENDS",
    "choice",
    "parse_bool",
    "parse_int",
    "parse_float",
    "parse_mixed_precision",
    "parse_fp8_backend",
    "parse_fp8_recipe",
    "parse_fp8_format",
    "parse_amax_compute_algo",
    "parse_opt_level",
    "parse_fp8_fallback",
    "parse_dynamo_backend",
    "parse_override_linear_precision",
    "parse_recipe_int",
    "format_bool",
]

MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
FP8_RECIPES = RECIPE_NAMES  # lowprec.catalog: the one torch-free table of recipes
FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2")
FP8_FALLBACKS = ("bf16", "emulate")
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "cudagraphs")

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def choice(value: Any, choices: Sequence[str], *, upper: bool = False) -> str:
    """``value`` matched case-insensitively against ``choices`` (returned in their case)."""
    text = str(value).strip()
    by_key = {c.lower(): c for c in choices}
    key = text.lower().replace("-", "_")
    if key in by_key:
        return by_key[key].upper() if upper else by_key[key]
    raise ValueError(
        f"{text!r} is not valid{did_you_mean(key, by_key)}; choose one of {', '.join(choices)}"
    )


def parse_bool(value: Any) -> bool:
    """Booleans as YAML, env vars and flags spell them (Accelerate's str_to_bool set)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false")


def format_bool(value: bool) -> str:
    return "true" if value else "false"


def parse_int(value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool):  # bool is an int subclass; True is not a count
        raise ValueError(f"{value!r} is not an integer")
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{number} is too small; it must be >= {minimum}")
    return number


def parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None


def _no(value: Any) -> Any:
    # YAML 1.1 reads an unquoted `no` as False; Accelerate's files quote it, hand-written ones
    # often do not.
    return "no" if value is False else value


def parse_mixed_precision(value: Any) -> str:
    return choice(_no(value), MIXED_PRECISIONS)


def __getattr__(name: str) -> Any:
    if name == "FP8_BACKENDS":  # generated from the backend declarations (lowprec.backends.spec)
        from lowprec.backends.spec import AUTO, specs

        return (*(s.env_value.lower() for s in specs()), AUTO)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_fp8_backend(value: Any) -> str:
    """Any spelling of a backend -> the lower-case ``ACCELERATE_FP8_BACKEND`` value that
    ``lowprec launch`` stores (``torchao`` -> ``ao``, as Accelerate's FP8BackendType);
    ``auto`` stays ``auto``."""
    from lowprec.backends.spec import AUTO, spelling_table

    key = str(value).strip().lower()
    table = spelling_table()
    if key == AUTO:
        return AUTO
    if key not in table:
        names = (*(s.env_value.lower() for s in table.values()), AUTO)
        raise ValueError(f"{str(value).strip()!r} is not valid{did_you_mean(key, table)}; "
                         f"choose one of {', '.join(dict.fromkeys(names))}")
    return table[key].env_value.lower()


def parse_fp8_recipe(value: Any) -> str:
    if str(value).strip().lower().replace("-", "_") in ("mxfp8", "mx_fp8"):
        raise ValueError(MXFP8_UNSUPPORTED)
    return choice(value, FP8_RECIPES)


def parse_recipe_int(name: str) -> Callable[[Any], int]:
    """The parser of an integer recipe field with its one minimum (lowprec.catalog)."""
    return lambda value: parse_int(value, minimum=FIELD_MINIMUMS[name])


def parse_fp8_format(value: Any) -> str:
    return choice(value, FP8_FORMATS)


def parse_amax_compute_algo(value: Any) -> str:
    return choice(value, AMAX_COMPUTE_ALGOS)


def parse_opt_level(value: Any) -> str:
    text = str(value).strip().upper()
    if text in ("01", "02"):  # the digit zero: MS-AMP levels use the letter O
        raise ValueError(f"{value!r} uses the digit zero; write the letter O: O{text[1]}")
    return choice(text, OPT_LEVELS)


def parse_fp8_fallback(value: Any) -> str:
    return choice(value, FP8_FALLBACKS)


def parse_dynamo_backend(value: Any) -> str:
    return choice(_no(value), DYNAMO_BACKENDS)


def parse_override_linear_precision(value: Any) -> tuple[bool, bool, bool]:
    """``(fprop, dgrad, wgrad)`` from a list/tuple of bools or strings, or a string such as
    ``"(false, false, true)"``, ``"[false,false,true]"`` or ``"false,false,true"``.

    Accelerate indexed the string form per character (``FPROP='('``, reference §3.4 bug 3)
    and read a lone ``false`` the same way (issue #3489); both are parsed whole here. A lone
    boolean is rejected: it does not say which GEMM it means.
    """
    items: Any = value
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            text = text[1:-1]
        items = [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(items, (bool, int)) or not isinstance(items, (list, tuple)):
        raise ValueError(
            f"{value!r} is not three booleans; write (fprop, dgrad, wgrad), "
            "e.g. [false, false, true]"
        )
    if len(items) != 3:
        raise ValueError(
            f"{value!r} has {len(items)} entries; write three booleans (fprop, dgrad, wgrad), "
            "e.g. [false, false, true]"
        )
    out = []
    for item in items:
        if isinstance(item, str) and item.strip() in ("True", "False"):
            item = ast.literal_eval(item.strip())
        out.append(parse_bool(item))
    return (out[0], out[1], out[2])
