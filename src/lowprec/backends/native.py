"""The native backend: lowprec's own FP8 engine (always available, any device)."""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Optional

from torch import nn

from lowprec import fp8
from lowprec.backends.base import BaseBackend, PrepareContext

__all__ = ["NativeBackend"]

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
        module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
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

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module:
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
        logger.info("lowprec: FP8 conversion (%s):\n%s", self.engine, self.report)
        return model

    def fp8_context(self, model: nn.Module) -> ContextManager:
        # layers own their recipe (and its eval rule); the region only switches FP8 on
        return fp8.autocast(enabled=True)

    def plain_state_dict(self, state_dict: dict) -> dict:
        return fp8.plain_state_dict(state_dict)

    def describe(self) -> dict:
        return {**super().describe(), "recipe": self.recipe.to_dict()}
