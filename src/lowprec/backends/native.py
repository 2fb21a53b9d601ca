"""The native backend: lowprec's own FP8 engine (always available, any device)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional

from lowprec.backends.base import BaseBackend, PrepareContext
from lowprec.backends.spec import RECIPE_SETTINGS, BackendSpec, recipe_field
from lowprec.catalog import FSDP_FP8_ALL_GATHER_UNSUPPORTED
from lowprec.kwargs import NativeRecipeKwargs

if TYPE_CHECKING:
    from torch import nn

    from lowprec import fp8

__all__ = ["NativeBackend", "SPEC", "fallback_recipe"]

logger = logging.getLogger("lowprec")


class NativeBackend(BaseBackend):
    """Converts ``nn.Linear`` to :class:`lowprec.fp8.Float8Linear` in place (same Parameter
    objects, so an optimizer built before ``prepare`` keeps training the right tensors) and
    enters :func:`lowprec.fp8.autocast` around each forward."""

    def __init__(
        self,
        recipe: "fp8.Recipe",
        *,
        name: str = "native",
        reason: str = "",
        module_filter: Optional[Callable[["nn.Module", str], bool]] = None,
        skip_first_last: bool = True,
        skip_patterns: tuple = ("lm_head", "router", "gate"),
    ) -> None:
        self.recipe = recipe
        self.name = name
        self.engine = f"lowprec native engine ({recipe.name} recipe)"
        self.reason = reason or "native engine asked for"
        self.module_filter = module_filter
        self.skip_first_last = skip_first_last
        self.skip_patterns = tuple(skip_patterns)
        self.report: Any = None

    def convert(self, model: "nn.Module", ctx: PrepareContext) -> "nn.Module":
        from lowprec import fp8

        if ctx.emulate and self.recipe.gemm != "emulate":
            self.recipe = self.recipe.replace(gemm="emulate")
        if fp8.has_fp8_layers(model):
            return model  # prepared twice (e.g. several prepare calls): convert once
        self.report = fp8.convert(
            model,
            recipe=self.recipe,
            module_filter=self.module_filter,
            skip_first_last=self.skip_first_last,
            skip_patterns=self.skip_patterns,
        )
        # one line on the console (rank 0); the per-layer table at debug level and, from the
        # trainer, in output_dir/fp8_conversion.txt
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("lowprec: %s", self.report.summary())
        logger.debug("lowprec: FP8 conversion (%s):\n%s", self.engine, self.report)
        return model

    def fp8_context(self, model: "nn.Module") -> ContextManager:
        from lowprec import fp8

        # layers own their recipe (and its eval rule); the region only switches FP8 on
        return fp8.autocast(enabled=True)

    def plain_state_dict(self, state_dict: dict) -> dict:
        from lowprec import fp8

        return fp8.plain_state_dict(state_dict)

    def describe(self) -> dict:
        return {**super().describe(), "recipe": self.recipe.to_dict()}


def _create(handler: NativeRecipeKwargs, why: str) -> NativeBackend:
    return NativeBackend(handler.to_recipe(), reason=why, module_filter=handler.module_filter_func,
                         skip_first_last=handler.skip_first_last, skip_patterns=handler.skip_patterns)


def _handler_fields(fields: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {"overrides": {}}
    for key, value in fields.items():
        if key == "fp8_recipe":
            out["recipe"] = value
        elif key == "fp8_use_autocast_during_eval":
            out["use_autocast_during_eval"] = value
        else:
            out["overrides"][recipe_field(key)] = value
    return out


SPEC = BackendSpec(
    name="native",
    env_value="NATIVE",
    aliases=("lowprec",),
    summary="lowprec's own FP8 engine (always available; every recipe, CPU included)",
    kwargs_class=NativeRecipeKwargs,
    reads=("fp8_recipe", *RECIPE_SETTINGS),
    create=_create,
    native_recipe=NativeRecipeKwargs.to_recipe,
    to_handler_fields=_handler_fields,
    rejects={"fp8_enable_fsdp_float8_all_gather": FSDP_FP8_ALL_GATHER_UNSUPPORTED},
)


def fallback_recipe(spec: BackendSpec, handler: Any, why: str) -> tuple["fp8.Recipe", str]:
    """The native recipe that stands in for ``spec``'s library, and the logged reason."""
    from lowprec.backends.base import log_once

    recipe = spec.native_recipe(handler)
    reason = f"{why}; {spec.library} is not installed, so lowprec's native engine runs the same recipe ({recipe.name})"
    log_once(f"lowprec: FP8 backend {spec.name!r}: {reason}")
    return recipe, reason
