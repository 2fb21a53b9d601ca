"""``is_*_available``: whether an optional package can be imported (found, never imported here)."""

from __future__ import annotations

import importlib.util
from typing import Callable

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


def _probe(name: str, *modules: str, also_one_of: tuple[str, ...] = ()) -> Callable[[], bool]:
    """An Accelerate-style ``is_<name>_available()``: every module in ``modules`` is found, and
    one of ``also_one_of`` when given."""

    def available() -> bool:
        found = all(is_package_available(m) for m in modules)
        return found and (not also_one_of or any(is_package_available(m) for m in also_one_of))

    available.__name__ = available.__qualname__ = f"is_{name}_available"
    available.__doc__ = f"Whether {' and '.join(modules)} can be imported (found, not imported)."
    return available


is_torchao_available = _probe("torchao", "torchao")
is_transformer_engine_available = _probe("transformer_engine", "transformer_engine")
is_msamp_available = _probe("msamp", "msamp")
is_deepspeed_available = _probe("deepspeed", "deepspeed")
# TensorBoard logging needs torch's writer and one of the two event-file libraries
is_tensorboard_available = _probe("tensorboard", "torch.utils.tensorboard", also_one_of=("tensorboard", "tensorboardX"))
is_wandb_available = _probe("wandb", "wandb")
is_mlflow_available = _probe("mlflow", "mlflow")
is_comet_ml_available = _probe("comet_ml", "comet_ml")
is_aim_available = _probe("aim", "aim")
is_transformers_available = _probe("transformers", "transformers")
is_peft_available = _probe("peft", "peft")
is_torchdata_stateful_dataloader_available = _probe(
    "torchdata_stateful_dataloader", "torchdata", "torchdata.stateful_dataloader"
)
