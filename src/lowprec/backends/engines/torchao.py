"""The torchao backend (declared in ``lowprec/backends/torchao.py``): ``torchao.float8.convert_to_float8_training`` (real torchao, optional).

Differences from Accelerate, each a fix of a bug in reference section 8:

* the default module filter excludes the first and last Linear *of the whole model* and any
  Linear whose dims are not multiples of 16 (bug 8);
* FSDP2 float8 all-gather is only switched on under FSDP2; elsewhere it would swap every weight
  for a new Parameter behind the optimizer (bug 1). Parameters that do change are remapped in
  the optimizer by name on every path (by the Accelerator, for every backend).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable

from torch import nn

from lowprec.backends.base import BaseBackend, PrepareContext
from lowprec.logs import log_once
from lowprec.backends.engines.native import NativeBackend
from lowprec.backends.engines.shared import note_unconverted_conv1d, warn_if_nothing_converted
from lowprec.fp8 import default_module_filter
from lowprec.fp8.recipes import Recipe
from lowprec.kwargs import AORecipeKwargs

__all__ = ["TorchAOBackend", "first_last_linear_filter", "create", "native_recipe", "fallback"]


def first_last_linear_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """A torchao ``module_filter_fn`` with the engine's default rule (:func:`lowprec.fp8.
    default_module_filter`): skip the model's first and last Linear, any Linear with a dim not
    divisible by 16, and output heads / MoE routers by name."""
    rule = default_module_filter(model)
    return lambda module, fqn: not isinstance(module, nn.Linear) or rule(module, fqn) is None


@contextlib.contextmanager
def _high_precision(model: nn.Module):
    from torchao.float8.float8_linear import Float8Linear

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in layers:
        m.forward = types.MethodType(nn.Linear.forward, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward


class TorchAOBackend(BaseBackend):
    name = "torchao"

    def __init__(self, handler: Any, reason: str = "") -> None:
        import torchao  # noqa: F401 - fail here, with the import error, if it is missing

        self.handler = handler
        self.engine = f"torchao {getattr(torchao, '__version__', '?')} Float8Linear"
        self.reason = reason or "AORecipeKwargs / fp8_backend=ao and torchao is installed"
        self.config: Any = None
        self._fsdp_all_gather = False

    def build_config(self, ctx: PrepareContext) -> Any:
        from torchao.float8 import Float8LinearConfig

        h = self.handler
        fsdp2 = ctx.distributed_type == "FSDP"
        if h.config is not None:
            config = h.config
        elif h.recipe is not None and h.recipe != "tensorwise":
            config = Float8LinearConfig.from_recipe_name(h.recipe)
        else:
            config = Float8LinearConfig(
                pad_inner_dim=h.pad_inner_dim,
                enable_fsdp_float8_all_gather=h.enable_fsdp_float8_all_gather and fsdp2,
            )
        if config.enable_fsdp_float8_all_gather and not fsdp2:
            log_once(
                "lowprec: torchao enable_fsdp_float8_all_gather only applies under FSDP2; "
                "switched off here so the optimizer keeps the model's parameters"
            )
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        if h.force_recompute_fp8_weight_in_bwd is False:
            log_once(
                "lowprec: torchao's Float8Linear keeps the high-precision weight for backward and re-casts it "
                "(torchao has no FP8 copy to keep); force_recompute_fp8_weight_in_bwd=false has no effect here"
            )
        if ctx.emulate and not config.emulate:
            config = dataclasses.replace(config, emulate=True)
        self._fsdp_all_gather = bool(config.enable_fsdp_float8_all_gather)
        return config

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        if any(isinstance(m, Float8Linear) for m in model.modules()):
            return model
        self.config = self.build_config(ctx)
        module_filter = self.handler.module_filter_func or first_last_linear_filter(model)
        # new weight Parameters (FSDP2 all-gather) are remapped into the optimizer by the
        # Accelerator, by name, whatever the order of prepare calls
        convert_to_float8_training(model, module_filter_fn=module_filter, config=self.config)
        note_unconverted_conv1d(model, "torchao")
        kept = [(n, "not picked by the module filter") for n, m in model.named_modules() if type(m) is nn.Linear]
        warn_if_nothing_converted(
            sum(isinstance(m, Float8Linear) for m in model.modules()),
            kept,
            "torchao",
            "Your module_filter_func picked none"
            if self.handler.module_filter_func
            else "The default filter keeps the first and last Linear and any with a dim not divisible by 16; "
            "pass AORecipeKwargs(module_filter_func=...) to pick layers",
        )
        return model

    def fp8_context(self, model: nn.Module):
        """torchao's Float8Linear has no off switch: in eval mode (unless
        ``use_autocast_during_eval``) its layers run ``nn.Linear.forward`` for the call."""
        if model.training or self.handler.use_autocast_during_eval:
            return contextlib.nullcontext()
        return _high_precision(model)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if self._fsdp_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # one all-reduce for all scales instead of one per layer in the next forward
            precompute_float8_dynamic_scale_for_fsdp(model)

    def plain_state_dict(self, state_dict: dict) -> dict:
        # WeightWithDynamicFloat8CastTensor wraps the real tensor in ``_tensor``
        return {k: getattr(v, "_tensor", v) for k, v in state_dict.items()}

    def describe(self) -> dict:
        cfg = None if self.config is None else repr(self.config)
        return {**super().describe(), "config": cfg}


def native_recipe(handler: AORecipeKwargs) -> Any:
    """torchao's recipe by name on lowprec's engine (torchao-only switches logged as unused)."""
    ignored = [
        k for k, v in (("config", handler.config is not None), ("pad_inner_dim", handler.pad_inner_dim is False)) if v
    ]
    if ignored:
        log_once(
            f"lowprec: AORecipeKwargs {', '.join(ignored)} configure torchao only and have no "
            "effect on lowprec's native engine (torchao is not installed)"
        )
    return Recipe.from_name(
        handler.recipe or "tensorwise",
        use_during_eval=handler.use_autocast_during_eval,
        force_recompute_fp8_weight_in_bwd=handler.force_recompute_fp8_weight_in_bwd,
    )


def fallback(handler: AORecipeKwargs, recipe: Any, reason: str) -> BaseBackend:
    return NativeBackend(recipe, name="torchao", reason=reason, module_filter=handler.module_filter_func)


def create(handler: AORecipeKwargs, reason: str) -> TorchAOBackend:
    return TorchAOBackend(handler, reason)
