"""Accelerate-named helpers: ``from lowprec.utils import TERecipeKwargs, set_seed, ...``."""

from lowprec.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    MSAMPRecipeKwargs,
    NativeRecipeKwargs,
    TERecipeKwargs,
    recipe_kwargs_from_config,
)
from lowprec.utils.fp8 import (
    apply_fp8_autowrap,
    contextual_fp8_autocast,
    convert_model,
    has_ao_layers,
    has_fp8_layers,
    has_transformer_engine_layers,
)
from lowprec.utils.operations import gather, pad_across_processes, reduce, send_to_device
from lowprec.utils.random import set_seed

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "FP8RecipeKwargs",
    "FP8BackendType",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "MSAMPRecipeKwargs",
    "NativeRecipeKwargs",
    "TERecipeKwargs",
    "recipe_kwargs_from_config",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "has_ao_layers",
    "has_fp8_layers",
    "has_transformer_engine_layers",
    "gather",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
]


def __getattr__(name: str):
    if name == "FP8BackendType":  # lives with the Accelerator; imported lazily to avoid a cycle
        from lowprec.accelerator import FP8BackendType

        return FP8BackendType
    raise AttributeError(f"module 'lowprec.utils' has no attribute {name!r}")
