"""Accelerate's FP8 helper functions, served by lowprec's engine.

``convert_model`` / ``has_transformer_engine_layers`` keep Accelerate's names and signatures;
without TransformerEngine they convert to (and detect) lowprec ``Float8Linear`` layers, with
TE's rule (every Linear whose dims are multiples of 16, no early return on a skipped layer).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

from torch import nn

from lowprec import fp8
from lowprec.backends.registry import native_recipe_for
from lowprec.backends.engines.te import te_convert
from lowprec.backends.te import SPEC as TE_SPEC
from lowprec.backends.torchao import SPEC as AO_SPEC

__all__ = [
    "convert_model",
    "has_transformer_engine_layers",
    "has_ao_layers",
    "has_fp8_layers",
    "contextual_fp8_autocast",
    "apply_fp8_autowrap",
]


def _te_installed() -> bool:
    return TE_SPEC.available()


def _ao_installed() -> bool:
    return AO_SPEC.available()


def convert_model(
    model: nn.Module, to_transformer_engine: bool = True, _convert_linear: bool = True, _convert_ln: bool = True
) -> nn.Module:
    if not to_transformer_engine:
        fp8.unconvert(model)
        return model
    if _te_installed():
        import transformer_engine.pytorch as te

        te_convert(model, te)
        return model
    if _convert_linear:
        fp8.convert(model, recipe=fp8.Recipe.from_name("delayed"), skip_first_last=False, skip_patterns=())
    return model


def has_transformer_engine_layers(model: nn.Module) -> bool:
    if _te_installed():
        import transformer_engine.pytorch as te

        if any(isinstance(m, (te.Linear, te.LayerNorm)) for m in model.modules()):
            return True
    return fp8.has_fp8_layers(model)


def has_ao_layers(model: nn.Module) -> bool:
    if _ao_installed():
        from torchao.float8.float8_linear import Float8Linear

        if any(isinstance(m, Float8Linear) for m in model.modules()):
            return True
    return fp8.has_fp8_layers(model)


has_fp8_layers = fp8.has_fp8_layers


def contextual_fp8_autocast(
    model_forward: Callable, fp8_recipe: Optional[Any] = None, use_during_eval: bool = False
) -> Callable:
    """Wrap a bound forward: FP8 on in training mode (and in eval if ``use_during_eval``)."""
    recipe = fp8_recipe if isinstance(fp8_recipe, fp8.Recipe) else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # in eval, use_during_eval=True must beat each layer's own recipe (use_during_eval=False
        # by default), so it is passed as an override; otherwise the recipes decide
        with fp8.autocast(
            enabled=use_during_eval or self.training, recipe=recipe, use_during_eval=True if use_during_eval else None
        ):
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward  # type: ignore[attr-defined]
    return forward


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: Any = None) -> nn.Module:
    """Make ``model.forward`` run inside the FP8 region (recipe from the handler, if any)."""

    recipe = native_recipe_for(fp8_recipe_handler) if fp8_recipe_handler is not None else None
    use_during_eval = bool(getattr(fp8_recipe_handler, "use_autocast_during_eval", False))
    new_forward = contextual_fp8_autocast(model.forward, recipe, use_during_eval)
    if hasattr(model.forward, "__func__"):
        model.forward = types.MethodType(new_forward, model)
    else:
        model.forward = functools.partial(new_forward, model)
    return model
