"""The TransformerEngine backend, declared in ``lowprec/backends/te.py`` (UNTESTED HERE: TE
cannot be installed on this CPU machine).

Written against TE's documented API (``transformer_engine.pytorch.Linear``, ``LayerNorm``,
``fp8_autocast``; ``transformer_engine.common.recipe.DelayedScaling``, ``MXFP8BlockScaling``,
``NVFP4BlockScaling``, ``Format``) and covered by tests with a recording stand-in module. Fixes over Accelerate:
no early return on a non-%16 Linear (bug 7), every resolved recipe field forwarded (bug 10),
``interval`` only passed to TE versions that still take it, the handler used on every
distributed path (bugs 2, 3), and no "model and optimizer together" rule (bug 16).
"""

from __future__ import annotations

import inspect
from typing import Any, ContextManager, cast

import torch
from torch import nn

from lowprec.backends.base import BaseBackend, PrepareContext
from lowprec.logs import log_once
from lowprec.backends.engines.native import NativeBackend
from lowprec.backends.engines.shared import note_unconverted_conv1d
from lowprec.backends.spec import get_spec
from lowprec.catalog import te_switch_recipe
from lowprec.fp8.recipes import Recipe
from lowprec.kwargs import TERecipeKwargs

__all__ = ["TEBackend", "te_convert", "build_te_recipe", "create", "native_recipe", "fallback"]


def te_convert(model: nn.Module, te: Any) -> int:
    """Swap ``nn.Linear`` (dims divisible by 16) and ``nn.LayerNorm`` for TE modules, in place,
    copying weights. Returns the number of swapped modules."""
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            new: Any = None  # a TE module (duck-typed: TE is optional)
            if type(child) is nn.Linear:
                if child.in_features % 16 or child.out_features % 16:
                    continue  # skip this layer only; siblings still convert
                new = te.Linear(
                    child.in_features, child.out_features, bias=child.bias is not None, params_dtype=child.weight.dtype
                )
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
            elif type(child) is nn.LayerNorm and child.elementwise_affine:
                new = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=child.weight.dtype)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
            if new is not None:
                new.to(child.weight.device)
                setattr(parent, child_name, new)
                swapped += 1
    return swapped


# the recipe a TE switch names (catalog.TE_SWITCHES) -> TE's recipe class, and whether that class
# takes fp8_format (NVFP4BlockScaling has E2M1 elements with E4M3 scales, nothing to choose)
_TE_BLOCK_RECIPES = {"mxfp8": ("MXFP8BlockScaling", True), "nvfp4": ("NVFP4BlockScaling", False)}


def build_te_recipe(handler: Any, recipe_module: Any) -> Any:
    """The TE recipe object from a resolved :class:`TERecipeKwargs`: all fields, explicitly."""
    fmt = recipe_module.Format[handler.fp8_format]
    switch = te_switch_recipe(vars(handler))
    if switch is not None:
        cls, takes_format = _TE_BLOCK_RECIPES[switch]
        return getattr(recipe_module, cls)(**({"fp8_format": fmt} if takes_format else {}))
    kwargs = dict(
        margin=handler.margin,
        fp8_format=fmt,
        amax_history_len=handler.amax_history_len,
        amax_compute_algo=handler.amax_compute_algo,
        override_linear_precision=tuple(handler.override_linear_precision),
    )
    accepted = inspect.signature(recipe_module.DelayedScaling).parameters
    if "interval" in accepted:
        kwargs["interval"] = handler.interval
    elif handler.interval != 1:
        log_once(f"lowprec: this TransformerEngine has no DelayedScaling.interval; interval={handler.interval} ignored")
    return recipe_module.DelayedScaling(**kwargs)


class TEBackend(BaseBackend):
    name = "te"

    def __init__(self, handler: Any, reason: str = "") -> None:
        import transformer_engine.common.recipe as te_recipe
        import transformer_engine.pytorch as te

        self.te = te
        self.handler = handler
        self.recipe = build_te_recipe(handler, te_recipe)
        self.engine = "TransformerEngine"
        self.reason = reason or "TERecipeKwargs / fp8_backend=te and transformer_engine is installed"

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module:
        # TE modules bring new Parameters; the Accelerator remaps the optimizer by name
        te_convert(model, self.te)
        note_unconverted_conv1d(model, "TransformerEngine")
        return model

    def fp8_context(self, model: nn.Module) -> ContextManager:
        enabled = model.training or self.handler.use_autocast_during_eval
        return self.te.fp8_autocast(enabled=enabled, fp8_recipe=self.recipe)

    def plain_state_dict(self, state_dict: dict) -> dict:
        return {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}


def native_recipe(handler: TERecipeKwargs) -> Any:
    """TE's recipe on lowprec's engine: DelayedScaling as the delayed recipe with every resolved
    field; ``use_mxfp8_block_scaling`` / ``use_nvfp4_block_scaling`` as the mxfp8 / nvfp4 recipes
    (TE's MXFP8BlockScaling / NVFP4BlockScaling semantics, ``lowprec/fp8/cast/mx.py``, ``nvfp4.py``)."""
    engine_formats = get_spec("native").fp8_formats  # the rule lives in the declarations (E5M2: TE only)
    if handler.fp8_format not in engine_formats:
        raise ValueError(
            f"fp8_format={handler.fp8_format!r} needs TransformerEngine; the native engine runs "
            f"{' or '.join(engine_formats)}"
        )
    # _resolve_fields (the handler's __post_init__) filled it: (fprop, dgrad, wgrad), never None
    override = cast("tuple[bool, bool, bool]", handler.override_linear_precision)
    switch = te_switch_recipe(vars(handler))
    if switch is not None:
        # TE's block-scaled recipes have no amax history, margin or interval: those fields are
        # TE-DelayedScaling's; fp8_format stays (MXFP8BlockScaling takes it; E4M3 is TE's default)
        takes_format = _TE_BLOCK_RECIPES[switch][1]
        return Recipe.from_name(
            switch,
            fp8_format=handler.fp8_format if takes_format else "E4M3",
            override_linear_precision=tuple(override),
            use_during_eval=handler.use_autocast_during_eval,
        )
    return Recipe.from_name(
        "delayed",
        fp8_format=handler.fp8_format,
        margin=handler.margin,
        interval=handler.interval,
        amax_history_len=handler.amax_history_len,
        amax_compute_algo=handler.amax_compute_algo,
        override_linear_precision=tuple(override),
        use_during_eval=handler.use_autocast_during_eval,
    )


def fallback(handler: TERecipeKwargs, recipe: Any, reason: str) -> BaseBackend:
    # TE converts every eligible Linear, the first and last included
    return NativeBackend(recipe, name="te", reason=reason, skip_first_last=False, skip_patterns=())


def create(handler: TERecipeKwargs, reason: str) -> TEBackend:
    return TEBackend(handler, reason)
