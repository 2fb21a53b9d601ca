"""lowprec: low-precision (FP8, BF16, FP16) training for PyTorch.

``import lowprec.fp8`` needs nothing but torch. The Accelerate-compatible front
(``lowprec.Accelerator`` and the names Accelerate exports at its top level) is imported lazily so
that the engine stays importable on machines that only have torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it (imported on first access)
_LAZY = {
    "Accelerator": "lowprec.accelerator",
    "AcceleratorState": "lowprec.state",
    "PartialState": "lowprec.state.partial",
    "DistributedType": "lowprec.state.partial",
    "GradientState": "lowprec.utils.data_loader",
    "skip_first_batches": "lowprec.utils.data_loader",
    "DataLoaderConfiguration": "lowprec.utils.dataclasses",
    "ProjectConfiguration": "lowprec.utils.dataclasses",
    "find_executable_batch_size": "lowprec.utils.memory",
    "init_empty_weights": "lowprec.utils.modeling",
    "init_on_device": "lowprec.utils.modeling",
    "ParallelismConfig": "lowprec.parallelism_config",
    # the kwargs handlers and plugins Accelerate also exports at its top level
    "AutocastKwargs": "lowprec.kwargs",
    "DeepSpeedPlugin": "lowprec.kwargs",
    "DistributedDataParallelKwargs": "lowprec.kwargs",
    "FullyShardedDataParallelPlugin": "lowprec.kwargs",
    "GradScalerKwargs": "lowprec.kwargs",
    "InitProcessGroupKwargs": "lowprec.kwargs",
    "ProfileKwargs": "lowprec.utils.dataclasses",
}
# submodules reachable as attributes after ``import lowprec`` (``accelerate.utils.set_seed`` style)
_SUBMODULES = ("utils", "state", "logging", "fp8", "optim", "integrations")

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"lowprec.{name}")
    raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
