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
from lowprec.state.partial import DistributedType
from lowprec.utils.data_loader import skip_first_batches
from lowprec.utils.dataclasses import (
    DataLoaderConfiguration,
    FP8BackendType,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lowprec.utils.environment import clear_environment
from lowprec.utils.imports import (
    is_deepspeed_available,
    is_msamp_available,
    is_tensorboard_available,
    is_torchao_available,
    is_torchdata_stateful_dataloader_available,
    is_transformer_engine_available,
    is_wandb_available,
)
from lowprec.utils.memory import find_executable_batch_size, release_memory
from lowprec.utils.modeling import extract_model_from_parallel, init_empty_weights
from lowprec.utils.operations import (
    CannotPadNestedTensorWarning,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from lowprec.utils.parallelism import TorchTensorParallelPlugin
from lowprec.utils.random import set_seed

__all__ = [
    "TorchTensorParallelPlugin",
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
    "DataLoaderConfiguration",
    "DistributedType",
    "LoggerType",
    "ProfileKwargs",
    "TorchDynamoPlugin",
    "clear_environment",
    "ProjectConfiguration",
    "CannotPadNestedTensorWarning",
    "broadcast",
    "broadcast_object_list",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "init_empty_weights",
    "is_deepspeed_available",
    "is_msamp_available",
    "is_tensorboard_available",
    "is_torchao_available",
    "is_torchdata_stateful_dataloader_available",
    "is_transformer_engine_available",
    "is_wandb_available",
    "pad_across_processes",
    "release_memory",
    "skip_first_batches",
    "reduce",
    "send_to_device",
    "set_seed",
]
