"""``is_*_available``: whether an optional package can be imported (found, never imported here)."""

from __future__ import annotations

import importlib.util

__all__ = [
    "is_package_available",
    "is_torchao_available",
    "is_transformer_engine_available",
    "is_msamp_available",
    "is_deepspeed_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "is_mlflow_available",
    "is_comet_ml_available",
    "is_aim_available",
    "is_transformers_available",
    "is_peft_available",
    "is_torchdata_stateful_dataloader_available",
]


def is_package_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_torchao_available() -> bool:
    return is_package_available("torchao")


def is_transformer_engine_available() -> bool:
    return is_package_available("transformer_engine")


def is_msamp_available() -> bool:
    return is_package_available("msamp")


def is_deepspeed_available() -> bool:
    return is_package_available("deepspeed")


def is_tensorboard_available() -> bool:
    return is_package_available("torch.utils.tensorboard") and (
        is_package_available("tensorboard") or is_package_available("tensorboardX")
    )


def is_wandb_available() -> bool:
    return is_package_available("wandb")


def is_mlflow_available() -> bool:
    return is_package_available("mlflow")


def is_comet_ml_available() -> bool:
    return is_package_available("comet_ml")


def is_aim_available() -> bool:
    return is_package_available("aim")


def is_transformers_available() -> bool:
    return is_package_available("transformers")


def is_peft_available() -> bool:
    return is_package_available("peft")


def is_torchdata_stateful_dataloader_available() -> bool:
    return is_package_available("torchdata") and is_package_available("torchdata.stateful_dataloader")
