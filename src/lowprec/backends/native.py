"""The native backend's declaration: lowprec's own FP8 engine (always available, any device).
Its implementation, :class:`~lowprec.backends.engines.native.NativeBackend`, is in
``lowprec/backends/engines/native.py``."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lowprec.backends.spec import (
    ENGINE_SETTINGS,
    RECIPE_SETTINGS,
    BackendSpec,
    Implementation,
    moved_to_engine,
    recipe_field,
)
from lowprec.catalog import check_fsdp_fp8_all_gather
from lowprec.kwargs import NativeRecipeKwargs

__all__ = ["SPEC"]

# the implementation's name, importable from here as before (loaded when asked for)
__getattr__ = moved_to_engine("native", ("NativeBackend",), __name__)


def _handler_fields(fields: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {"overrides": {}}
    for key, value in fields.items():
        if key == "fp8_recipe":
            out["recipe"] = value
        elif key == "fp8_use_autocast_during_eval":
            out["use_autocast_during_eval"] = value
        elif key in ("fp8_enable_fsdp_float8_all_gather", "fp8_force_recompute_fp8_weight_in_bwd"):
            out[key.removeprefix("fp8_")] = value
        else:
            out["overrides"][recipe_field(key)] = value
    return out


def _check_fields(recipe: Optional[str], fields: Mapping[str, Any]) -> Optional[tuple[str, str]]:
    """Launch-time refusal of what :class:`NativeBackend` would refuse at construction."""
    if fields.get("fp8_enable_fsdp_float8_all_gather"):
        try:
            check_fsdp_fp8_all_gather(recipe or "tensorwise")
        except ValueError as exc:
            return "fp8_enable_fsdp_float8_all_gather", str(exc)
    return None


SPEC = BackendSpec(
    env_value="NATIVE",
    aliases=("lowprec",),
    summary="lowprec's own FP8 engine (always available; every recipe, CPU included)",
    kwargs_class=NativeRecipeKwargs,
    reads=(
        "fp8_recipe",
        *RECIPE_SETTINGS,
        *ENGINE_SETTINGS,
        "fp8_enable_fsdp_float8_all_gather",
        "fp8_force_recompute_fp8_weight_in_bwd",
    ),
    create=Implementation("native:create"),
    native_recipe=NativeRecipeKwargs.to_recipe,
    to_handler_fields=_handler_fields,
    check_fields=_check_fields,
)
